"""``bench.serve``'s TTFT by hop: where a request's time to first token goes, over HTTP and in
process, so that one run says which hop the HTTP path adds.

Over HTTP, per load point:

* the client's own clocks, per request (``serve_client.Result``): request sent -> first token
  chunk received (the client TTFT), split at the response head (the server sends it once the
  request's first output is there: ``entrypoints/http/sse.py``);
* the server's histograms, scraped from ``/metrics`` right before and right after the point:
  each family's delta over the point (``_sum`` / ``_count``: an exact mean; quantiles
  interpolated within the buckets, as Prometheus' ``histogram_quantile`` does). A family the
  server lacks (an older one, ``--server-root``) is reported as "-".

In process (``bench.throughput --modes inproc``): the caller's TTFT (``generate()`` -> first
output) and the engine's histograms from ``AsyncEngine.health_nowait()`` before and after.

Derived rows are differences of means (means add up; quantiles do not): they cover the hops no
clock measures on its own (the network and the client's reads; the IPC, the engine's inbox and the
output's way back).
"""

from __future__ import annotations

import math
import re
import statistics
from typing import Any, NamedTuple, Optional, Sequence

from .common import percentile, print_table

#: hop -> the families that measure it, ours first (finer buckets), then vLLM's name
FAMILIES = {
    "server_ttft": ("enginecore_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    "submit": ("enginecore_request_time_to_submit_seconds",),
    "queue": ("enginecore_request_queue_time_seconds", "vllm:request_queue_time_seconds"),
    "prefill": ("enginecore_request_prefill_time_seconds", "vllm:request_prefill_time_seconds"),
    "arrival_offset": ("enginecore_request_arrival_offset_seconds",),
    "server_e2e": ("enginecore_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
    "decode": ("enginecore_request_decode_time_seconds", "vllm:request_decode_time_seconds"),
    "step": ("enginecore_step_time_seconds",),
}
#: hop -> the engine's Health field prefix (engine/core/stats.py's histogram_bounds keys)
ENGINE_KEYS = {"queue": "queue_time", "prefill": "prefill_time", "arrival_offset": "arrival_offset",
               "decode": "decode_time", "step": "step_time"}

#: (key, label, what it measures) in the order printed; ``run`` says which run has the row
ROWS = (
    ("client_send_offset", "client send offset", "the common start t0 -> request sent"),
    ("client_ttft", "client TTFT", "request sent -> first token chunk received"),
    ("client_head", "  sent -> response head", "request sent -> response head received"),
    ("client_head_to_first", "  head -> first token", "response head -> first token chunk"),
    ("inproc_ttft", "in-process TTFT", "generate() -> first output"),
    ("server_ttft", "server TTFT", "API route entered -> first output in the API server"),
    ("submit", "  API: route -> submit", "API route entered -> submitted to the engine"),
    ("queue", "engine queue", "engine core arrival -> first scheduled"),
    ("prefill", "engine prefill", "first scheduled -> first token in the core"),
    ("arrival_offset", "engine arrival offset", "busy period start -> engine core arrival"),
    ("client_minus_server", "= client - server TTFT", "client, network, uvicorn, SSE send"),
    ("api_engine_residual", "= server - submit - queue - prefill",
     "IPC, engine intake + inbox, output back"),
    ("inproc_residual", "= TTFT - queue - prefill", "inbox wait, output delivery"),
    ("client_e2e", "client e2e", "request sent -> response end"),
    ("server_e2e", "server e2e", "API route entered -> last output in the API server"),
    ("decode", "engine decode", "first token in the core -> finished in the core"),
    ("step", "engine step (n: steps)", "one engine step's wall time (schedule, forward, sample)"),
)


class Hist(NamedTuple):
    bounds: tuple[float, ...]  # finite upper bounds (le)
    counts: tuple[int, ...]  # per bucket (not cumulative); the last is +Inf
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, Hist]:
    """Every histogram family of a Prometheus text exposition (series of one family summed
    over their labels other than ``le``)."""
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        if name.endswith("_bucket"):
            le = dict(_LABEL.findall(labels or "")).get("le")
            if le is not None:
                b = buckets.setdefault(name[:-7], {})
                b[float(le)] = b.get(float(le), 0.0) + v
        elif name.endswith("_sum"):
            sums[name[:-4]] = sums.get(name[:-4], 0.0) + v
    out = {}
    for fam, b in buckets.items():
        les = sorted(b)
        if not les or not math.isinf(les[-1]) or fam not in sums:
            continue
        cum = [int(b[le]) for le in les]
        out[fam] = Hist(tuple(les[:-1]), tuple(c - p for c, p in zip(cum, [0, *cum[:-1]])),
                        sums[fam])
    return out


def delta(before: Optional[Hist], after: Optional[Hist]) -> Optional[Hist]:
    """``after`` less ``before`` (None where either is missing, their buckets differ or a count
    went back: another server, or one restarted)."""
    if before is None or after is None or before.bounds != after.bounds:
        return None
    counts = tuple(a - b for a, b in zip(after.counts, before.counts))
    return None if min(counts, default=0) < 0 else Hist(after.bounds, counts,
                                                        after.sum - before.sum)


def quantile(h: Hist, q: float) -> Optional[float]:
    """The ``q`` quantile (0..1), linear within its bucket (from 0 in the first); in the +Inf
    bucket, the last finite bound."""
    n = h.count
    if n <= 0:
        return None
    rank, seen = q * n, 0
    for i, c in enumerate(h.counts):
        if c and seen + c >= rank:
            if i >= len(h.bounds):
                return h.bounds[-1] if h.bounds else None
            lo = h.bounds[i - 1] if i else 0.0
            return lo + (h.bounds[i] - lo) * max(0.0, rank - seen) / c
        seen += c
    return h.bounds[-1] if h.bounds else None


def hist_stats(h: Optional[Hist]) -> Optional[dict[str, Any]]:
    """n, mean and p50 / p90 / p99 (ms) of a histogram delta; None when there is none."""
    if h is None or h.count <= 0:
        return None
    return {"n": h.count, "mean_ms": 1e3 * h.sum / h.count, "source": "histogram",
            **{f"p{p}_ms": 1e3 * quantile(h, p / 100) for p in (50, 90, 99)}}


def sample_stats(xs: Sequence[float]) -> Optional[dict[str, Any]]:
    """The same figures from exact samples (seconds)."""
    if not xs:
        return None
    return {"n": len(xs), "mean_ms": 1e3 * statistics.fmean(xs), "source": "samples",
            **{f"p{p}_ms": 1e3 * percentile(xs, p) for p in (50, 90, 99)}}


def _derived(hops: dict, key: str, minus: Sequence[str], minuend: str,
             optional: Sequence[str] = ()) -> None:
    """``hops[key]``: the mean of ``minuend`` less those of ``minus`` (and of ``optional``, those
    the run has; the ones it lacks are named)."""
    parts = [hops.get(k) for k in (minuend, *minus)]
    if any(p is None for p in parts):
        hops[key] = None
        return
    have = [k for k in optional if hops.get(k) is not None]
    mean = parts[0]["mean_ms"] - sum(p["mean_ms"] for p in parts[1:])
    hops[key] = {"mean_ms": mean - sum(hops[k]["mean_ms"] for k in have), "source": "derived"}
    if len(have) < len(optional):
        hops[key]["includes"] = [k for k in optional if k not in have]


def http_hops(results: Sequence, before: Optional[str], after: Optional[str],
              t0: Optional[float] = None) -> dict[str, Any]:
    """One HTTP point's hops: from its clients' ``Result`` records (``t0``: their common start)
    and two ``/metrics`` texts (None: that scrape failed)."""
    ok = [r for r in results if r.error is None and r.first is not None]
    heads = [r for r in ok if getattr(r, "head", None) is not None]
    hops: dict[str, Any] = {
        "client_send_offset": (sample_stats([r.submit - t0 for r in results if r.submit])
                               if t0 is not None else None),
        "client_ttft": sample_stats([r.first - r.submit for r in ok]),
        "client_head": sample_stats([r.head - r.submit for r in heads]),
        "client_head_to_first": sample_stats([r.first - r.head for r in heads]),
        "client_e2e": sample_stats([r.end - r.submit for r in ok])}
    m0, m1 = parse(before or ""), parse(after or "")
    for key, names in FAMILIES.items():
        name = next((n for n in names if n in m1), None)
        hops[key] = hist_stats(delta(m0.get(name), m1.get(name))) if name else None
        if hops[key] is not None:
            hops[key]["family"] = name
    _derived(hops, "client_minus_server", ("server_ttft",), "client_ttft")
    _derived(hops, "api_engine_residual", ("queue", "prefill"), "server_ttft", ("submit",))
    hops["scraped"] = before is not None and after is not None
    return hops


def scrape(base_url: str, timeout: float = 30.0) -> Optional[str]:
    """``GET /metrics`` (None if it fails: the point's server rows are then "-")."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as resp:
            return resp.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


def engine_hists(health: Any, max_model_len: int = 0) -> dict[str, Hist]:
    """The engine's histograms of ``ENGINE_KEYS`` from a ``Health`` (those it carries)."""
    from engine.core.stats import histogram_bounds

    bounds = histogram_bounds(max_model_len)
    out = {}
    for hop, key in ENGINE_KEYS.items():
        counts = list(getattr(health, f"{key}_counts", None) or [])
        if key in bounds and len(counts) == len(bounds[key]) + 1:
            out[hop] = Hist(tuple(bounds[key]), tuple(counts),
                            float(getattr(health, f"{key}_sum", 0.0)))
    return out


def inproc_hops(submit: Sequence[Optional[float]], first: Sequence[Optional[float]],
                h0: Any, h1: Any) -> dict[str, Any]:
    """The in-process run's hops: its callers' submit / first-output times, the engine's
    ``Health`` before and after."""
    ttft = [f - s for f, s in zip(first, submit) if f is not None and s is not None]
    hops: dict[str, Any] = {"inproc_ttft": sample_stats(ttft)}
    e0, e1 = engine_hists(h0), engine_hists(h1)
    for hop in ENGINE_KEYS:
        hops[hop] = hist_stats(delta(e0.get(hop), e1.get(hop)))
    _derived(hops, "inproc_residual", ("queue", "prefill"), "inproc_ttft")
    return hops


COLUMNS = [("hop", "hop", ""), ("run", "run", ""), ("n", "n", ""), ("mean_ms", "mean", ",.1f"),
           ("p50_ms", "p50", ",.1f"), ("p90_ms", "p90", ",.1f"), ("p99_ms", "p99", ",.1f"),
           ("what", "from -> to", "")]


def rows(hops: Optional[dict], run: str) -> list[dict]:
    """The table's rows of one run's hops (a hop it lacks: "-")."""
    if not hops:
        return []
    out = []
    for key, label, what in ROWS:
        if key not in hops:
            continue
        st = hops[key] or {}
        if st.get("includes"):  # a part the server does not measure stays in the difference
            what += f" (and {', '.join(st['includes'])}: not served)"
        out.append({"hop": label, "run": run, "what": what,
                    **{k: st.get(k) for k in ("n", "mean_ms", "p50_ms", "p90_ms", "p99_ms")}})
    return out


def _mean(hops: dict, key: str) -> str:
    st = hops.get(key)
    return "-" if not st or st.get("mean_ms") is None else f"{st['mean_ms']:,.1f}"


def means_line(hops: dict) -> str:
    """The means side by side (ms): client TTFT, server TTFT, its parts, the arrival offset."""
    ttft = (f"client TTFT {_mean(hops, 'client_ttft')} | server TTFT {_mean(hops, 'server_ttft')}"
            f" | submit {_mean(hops, 'submit')}" if "client_ttft" in hops
            else f"TTFT {_mean(hops, 'inproc_ttft')}")
    rest = "api_engine_residual" if "client_ttft" in hops else "inproc_residual"
    off = hops.get("arrival_offset") or {}
    p99 = "-" if off.get("p99_ms") is None else f"{off['p99_ms']:,.1f}"
    return (f"means (ms): {ttft} | engine queue {_mean(hops, 'queue')} | prefill "
            f"{_mean(hops, 'prefill')} | rest {_mean(hops, rest)}; engine arrival offset mean "
            f"{_mean(hops, 'arrival_offset')}, p99 {p99}")


def report(result: dict) -> None:
    """The hop table of every round: its HTTP points, then its in-process run."""
    for r, rnd in enumerate(result.get("rounds", [])):
        table = []
        for p in rnd.get("points", []):
            table += rows(p.get("hops"), f"HTTP c={p.get('concurrency')}")
        table += rows((rnd.get("inproc") or {}).get("hops"), "in-process")
        if not table:
            continue
        tag = f", round {r + 1}" if len(result["rounds"]) > 1 else ""
        print()
        print_table(f"TTFT by hop{tag} (ms; client and in-process TTFT: every request; server "
                    "and engine: /metrics or Health deltas over the run, quantiles within "
                    "buckets; '=' rows: differences of means)", COLUMNS, table)
        for p in rnd.get("points", []):
            if p.get("hops"):
                print(f"HTTP c={p.get('concurrency')}: " + means_line(p["hops"]))
        if (rnd.get("inproc") or {}).get("hops"):
            print("in-process: " + means_line(rnd["inproc"]["hops"]))
        if any(p.get("hops") and not p["hops"].get("scraped") for p in rnd.get("points", [])):
            print("note: /metrics could not be scraped around a point: its server rows are '-'")


__all__ = ["Hist", "scrape", "parse", "delta", "quantile", "hist_stats", "sample_stats", "http_hops",
           "engine_hists", "inproc_hops", "rows", "means_line", "report", "FAMILIES", "ROWS"]

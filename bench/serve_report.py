"""``bench.serve``'s figures: one point's client results into a row (out tok/s, TTFT / ITL / e2e
p50 / p90 / p99, errors), the table, the ratios against the in-process run, and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from .common import percentile, print_table

COLUMNS = [
    ("label", "run", ""), ("concurrency", "conc", ""), ("requests", "req", ""),
    ("errors", "err", ""), ("output_tokens", "out tok", ""), ("wall_s", "wall s", ".2f"),
    ("output_tok_s", "out tok/s", ",.1f"), ("ttft_p50_ms", "TTFT p50", ",.1f"),
    ("ttft_p90_ms", "p90", ",.1f"), ("ttft_p99_ms", "p99", ",.1f"), ("itl_p50_ms", "ITL p50", ".2f"),
    ("itl_p90_ms", "p90", ".2f"), ("itl_p99_ms", "p99", ".2f"), ("e2e_p50_ms", "e2e p50", ",.0f"),
    ("e2e_p99_ms", "p99", ",.0f"), ("engine_cpu_s", "engine cpu s", ".1f"),
    ("frontend_cpu_s", "API cpu s", ".1f"), ("frontend_us_per_token", "API µs/tok", ".0f"),
    ("client_cpu_s", "client cpu s", ".1f"),
]


def _ms(x: Optional[float]) -> Optional[float]:
    return None if x is None else x * 1e3


def _pcts(name: str, xs: Sequence[float]) -> dict[str, Optional[float]]:
    return {f"{name}_p{p}_ms": _ms(percentile(xs, p)) for p in (50, 90, 99)}


def summarize(results: list, t0: float, expected_tokens: int, **extra) -> dict[str, Any]:
    """One point's row from its clients' ``serve_client.Result`` records (``t0``: the common
    start). Wall time: ``t0`` to the last response's end. An error is a request that failed, or
    that ended other than by its length (the workload ignores EOS)."""
    ok = [r for r in results if r.error is None]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            key = r.error.split(":", 1)[0]
        elif r.finish != "length":
            key = f"finish_reason {r.finish}"
        else:
            continue
        errors[key] = errors.get(key, 0) + 1
    wall = max((r.end for r in results), default=t0) - t0
    out = sum(r.tokens for r in results)
    ttft = [r.first - r.submit for r in ok if r.first is not None]
    e2e = [r.end - r.submit for r in ok]
    itl = [g for r in ok for g in r.itl]
    usage_off = sum(1 for r in ok if r.usage_tokens is not None and r.usage_tokens != r.tokens)
    row = {"requests": len(results), "errors": sum(errors.values()), "error_kinds": errors or None,
           "output_tokens": out, "expected_output_tokens": expected_tokens, "wall_s": wall,
           "output_tok_s": out / wall if wall > 0 else None,
           "usage_disagrees": usage_off,  # requests whose usage differs from the tokens counted
           **_pcts("ttft", ttft), **_pcts("itl", itl), **_pcts("e2e", e2e),
           "ttft_mean_ms": _ms(statistics.fmean(ttft)) if ttft else None,
           "itl_mean_ms": _ms(statistics.fmean(itl)) if itl else None}
    row.update(extra)
    if out and row.get("frontend_cpu_s") is not None:  # the API servers' CPU per output token
        row["frontend_us_per_token"] = 1e6 * row["frontend_cpu_s"] / out
    return row


def burst_ratios(http: dict, inproc: Optional[dict]) -> Optional[dict[str, float]]:
    """HTTP against in-process on the same workload: out tok/s ratio (HTTP / in-process: 1 is
    as fast) and TTFT p50 ratio (HTTP / in-process: 1 is as quick)."""
    if not inproc or not inproc.get("output_tok_s") or not http.get("output_tok_s"):
        return None
    out = {"out_tok_s": http["output_tok_s"] / inproc["output_tok_s"]}
    if http.get("ttft_p50_ms") and inproc.get("ttft_p50_ms"):
        out["ttft_p50"] = http["ttft_p50_ms"] / inproc["ttft_p50_ms"]
    if http.get("ttft_p99_ms") and inproc.get("ttft_p99_ms"):
        out["ttft_p99"] = http["ttft_p99_ms"] / inproc["ttft_p99_ms"]
    return out


def inproc_row(row: dict) -> dict:
    """``bench.throughput``'s in-process row in this table's terms."""
    return {"label": "in-process", "concurrency": row.get("requests"), "errors": 0
            if not row.get("not_finished_by_length") else sum(row["not_finished_by_length"].values()),
            **{k: row.get(k) for k in ("requests", "output_tokens", "wall_s", "output_tok_s",
                                        "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}}


def report(result: dict) -> None:
    rows = []
    for r, rnd in enumerate(result["rounds"]):
        tag = f" r{r + 1}" if len(result["rounds"]) > 1 else ""
        if rnd.get("inproc"):
            rows.append({**inproc_row(rnd["inproc"]), "label": "in-process" + tag})
        rows += [{**p, "label": "HTTP" + tag} for p in rnd["points"]]
    w = result["workload"]
    print_table(f"{w['kind']} workload over HTTP ({result['server']['api_servers_label']}), "
                f"{w['model']} {w['dtype']} on {w['device']}; {w['num_requests']} requests, rate "
                f"{w['request_rate']}/s; latencies in ms", COLUMNS, rows)
    for r, rnd in enumerate(result["rounds"]):
        if rnd.get("ratios"):
            print(f"round {r + 1}: HTTP / in-process at the burst: out tok/s "
                  f"{rnd['ratios']['out_tok_s']:.3f}, TTFT p50 {rnd['ratios'].get('ttft_p50', 0):.2f}x"
                  f", TTFT p99 {rnd['ratios'].get('ttft_p99', 0):.2f}x")
        for p in rnd["points"]:
            if p.get("error_kinds"):
                print(f"round {r + 1}, concurrency {p['concurrency']}: errors {p['error_kinds']}")
    if result.get("ratios_median"):
        m = result["ratios_median"]
        print("median over rounds: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
    for note in result.get("notes", []):
        print("note: " + note)


def plot(result: dict, path: Path) -> Optional[str]:
    """TTFT and ITL (p50, p99) against concurrency, per round; a note instead when matplotlib is
    not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r, rnd in enumerate(result["rounds"]):
        pts = sorted(rnd["points"], key=lambda p: p["concurrency"])
        xs = [p["concurrency"] for p in pts]
        for ax, name in zip(axes, ("ttft", "itl")):
            for q, style in (("p50", "-o"), ("p99", "--o")):
                ax.plot(xs, [p.get(f"{name}_{q}_ms") for p in pts], style,
                        label=f"HTTP {q}" + (f" r{r + 1}" if len(result["rounds"]) > 1 else ""))
            ip = rnd.get("inproc")
            if ip:
                ax.axhline(ip.get(f"{name}_p50_ms") or 0, color="gray", lw=0.8,
                           label="in-process p50 (burst)")
    for ax, title in zip(axes, ("TTFT", "inter-token latency")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def median_ratios(rounds: list[dict]) -> Optional[dict[str, float]]:
    got = [r["ratios"] for r in rounds if r.get("ratios")]
    if not got:
        return None
    return {k: statistics.median(g[k] for g in got if k in g) for k in got[0]}


__all__ = ["summarize", "burst_ratios", "report", "plot", "median_ratios", "COLUMNS"]

"""Prometheus metrics of the HTTP frontends, one view across every API server process.

Two sources:

* Per-request figures measured in the frontend (finished requests by finish reason, refusals,
  prompt / generation tokens, time to submit and to first token, inter-token and end-to-end
  latency, tokens and parameters per request, requests in flight). With
  ``PROMETHEUS_MULTIPROC_DIR`` set (``enginecore serve --http`` sets it for its frontends:
  entrypoints/http/frontend.py) they are prometheus-client multiprocess values, and a scrape sums
  every frontend's files (:class:`MultiProcessCollector`), so counters count all requests and never
  go back, whichever process answers. Without it (one in-process app) they are this process's own.
* The engine's figures (running / waiting, KV-cache usage, state, preemptions, steps, prefix
  cache, its histograms: step time, queue / prefill / decode time per request ...), read from
  the engine's Health snapshot at each scrape (entrypoints/http/engine_metrics.py); they are the
  engine's own, never summed over frontends.

Each scrape also serves vLLM's names for the same figures (entrypoints/http/vllm_names.py),
renamed from what was just collected. Metric names and their vLLM counterparts: docs/metrics.md.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from typing import Any, Mapping, Optional, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest

from engine.core.stats import REQUEST_TIME_BUCKETS, token_count_buckets

from .engine_metrics import STATES, EngineCollector, cache_info
from .vllm_names import VLLM_N_BUCKETS, VLLM_TTFT_BUCKETS, vllm_view

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Our bounds contain vLLM's (vllm_names.py serves vLLM's histogram from the same counts); the
#: TTFT's are finer between 0.1 and 2.5 s, where a burst's fall (quantiles read from buckets).
TTFT_BUCKETS = tuple(sorted({*VLLM_TTFT_BUCKETS, 0.15, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8, 0.9, 1.25,
                             1.5, 1.75, 2.0}))
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = REQUEST_TIME_BUCKETS
#: arrival in an API server -> submitted to the engine (body read, parsed, checked): from 0.5 ms
SUBMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                  0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)

FINISH_REASONS = ("stop", "length", "abort", "error")


def multiprocess_dir() -> Optional[str]:
    return os.environ.get(MULTIPROC_ENV) or None


class _Exposition:
    """What a scrape exposes: the frontends' values (this process's, or every process's files),
    the engine's, and vLLM's names for all of them -- each source collected once."""

    def __init__(self, metrics: "Metrics", path: Optional[str]) -> None:
        self.m = metrics
        if path is None:
            self.source = metrics.registry
        else:  # this process's values are files in `path`; expose every process's files
            from prometheus_client.multiprocess import MultiProcessCollector

            self.source = MultiProcessCollector(None, path=path)

    def describe(self):
        return []

    def collect(self):
        fams = [*self.source.collect(), *self.m.engine.collect()]
        yield from fams
        yield from vllm_view(fams, self.m.model_name)


class Metrics:
    """``model_name``: the served name (vLLM's ``model_name`` label); ``info``: the
    cache_config_info labels (read from an in-process engine when not given)."""

    def __init__(self, engine: Any = None, info: Optional[Mapping[str, str]] = None,
                 model_name: Optional[str] = None) -> None:
        if info is None and engine is not None:  # an in-process engine: read from its runner
            info = cache_info(engine)
        self._engine = engine
        self.model_name = model_name or str(getattr(engine, "model", "") or "")
        self.engine = EngineCollector(info, self._max_model_len)
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("enginecore_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("enginecore_requests_rejected",
                                "Requests refused before generation, by reason", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("enginecore_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("enginecore_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram("enginecore_time_to_first_token_seconds",
                              "Time from request arrival to its first output token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("enginecore_inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("enginecore_request_time_per_output_token_seconds",
                              "A request's time from its first token to its last, per token "
                              "after the first (requests with 2 tokens or more)",
                              buckets=ITL_BUCKETS, registry=r)
        self.submit_time = Histogram("enginecore_request_time_to_submit_seconds",
                                     "Time from request arrival to its submission to the engine "
                                     "(body read, parsed and checked), per choice",
                                     buckets=SUBMIT_BUCKETS, registry=r)
        self.e2e = Histogram("enginecore_e2e_request_latency_seconds",
                             "Time from request arrival to its last output", buckets=E2E_BUCKETS,
                             registry=r)
        self.params_n = Histogram("enginecore_request_params_n", "The n parameter, once per prompt "
                                  "of a request", buckets=VLLM_N_BUCKETS, registry=r)
        self.in_flight = Gauge("enginecore_frontend_requests_in_flight",
                               "Generation requests open in the frontend processes", registry=r,
                               multiprocess_mode="livesum")
        self._token_hists: Optional[tuple[Histogram, Histogram, Histogram, Histogram]] = None
        self.token_histograms()  # now if the context limit is known (their bounds depend on it)
        for reason in FINISH_REASONS:  # expose zeros from the start
            self.requests.labels(reason)
        for reason in ("bad_request", "draining", "overloaded", "unavailable"):
            self.rejected.labels(reason)
        self._exposed = CollectorRegistry(auto_describe=False)
        self._exposed.register(_Exposition(self, multiprocess_dir()))

    def _max_model_len(self) -> int:
        return int(getattr(self._engine, "max_model_len", 0) or 0)

    def token_histograms(self) -> Optional[tuple[Histogram, Histogram, Histogram, Histogram]]:
        """(prompt tokens, generation tokens, max generation tokens of a prompt's choices,
        max_tokens) per request, over vLLM's 1-2-5 bounds up to the context limit: made once
        that limit is known (None before)."""
        if self._token_hists is None and (n := self._max_model_len()):
            b, r = token_count_buckets(n), self.registry
            self._token_hists = (
                Histogram("enginecore_request_prompt_tokens", "Prompt tokens of a request",
                          buckets=b, registry=r),
                Histogram("enginecore_request_generation_tokens", "Tokens a request generated",
                          buckets=b, registry=r),
                Histogram("enginecore_request_max_num_generation_tokens", "The most tokens one "
                          "choice of a prompt generated (once per prompt of a request)",
                          buckets=b, registry=r),
                Histogram("enginecore_request_params_max_tokens", "The max_tokens a request "
                          "ran with (the default where it gave none)", buckets=b, registry=r))
        return self._token_hists

    def set_health(self, h) -> None:
        self.engine.update(h)

    def set_unreachable(self) -> None:
        self.engine.unreachable()

    def render(self) -> tuple[bytes, str]:
        self.token_histograms()
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST

    def tracker(self, arrival: float, max_tokens: int = 0,
                group: Optional["_PromptGroup"] = None) -> "RequestTracker":
        return RequestTracker(self, arrival, max_tokens, group)

    def trackers(self, arrival: float, jobs: Sequence[Any]) -> list["RequestTracker"]:
        """One tracker per job (``.prompt_index``, ``.params``) of one HTTP request; the jobs of
        one prompt (its ``n`` choices) share a group, observed once when all have ended."""
        groups: dict[int, _PromptGroup] = {}
        for j in jobs:
            g = groups.get(j.prompt_index)
            if g is None:
                g = groups[j.prompt_index] = _PromptGroup(self)
            g.n += 1
        return [RequestTracker(self, arrival, j.params.max_tokens, groups[j.prompt_index])
                for j in jobs]


class _PromptGroup:
    """The choices of one prompt: ``n``, and the most tokens one of them generated."""

    __slots__ = ("m", "n", "open", "max_tokens", "finished")

    def __init__(self, m: Metrics) -> None:
        self.m, self.n, self.open, self.max_tokens, self.finished = m, 0, 0, 0, False

    def ended(self, tokens: Optional[int]) -> None:
        """A choice ended (``tokens`` generated; None: refused before it started)."""
        self.open += 1
        if tokens is not None:
            self.finished = True
            self.max_tokens = max(self.max_tokens, tokens)
        if self.open == self.n and self.finished:
            self.m.params_n.observe(self.n)
            hists = self.m.token_histograms()
            if hists is not None:
                hists[2].observe(self.max_tokens)


#: A request's generated tokens and inter-token gaps are added to the metrics in batches: at
#: this many tokens, after FLUSH_S seconds, and when it ends (so a scrape lags by at most that).
FLUSH_TOKENS = 32
FLUSH_S = 1.0


def observe_many(hist: Histogram, values: Sequence[float]) -> None:
    """``hist.observe(v)`` for every ``v`` of ``values``, with one write per bucket touched.

    Why by hand: prometheus-client observes one value at a time, and in multiprocess mode each
    observation writes two values into the process's memory-mapped file under a lock; once per
    streamed token that was a tenth of a frontend's CPU per token (bench.serve). This reads the
    histogram's own buckets (the same objects ``observe`` updates); a histogram without them
    (another prometheus-client) is observed one value at a time."""
    buckets = getattr(hist, "_buckets", None)
    bounds = getattr(hist, "_upper_bounds", None)
    total = getattr(hist, "_sum", None)
    if buckets is None or bounds is None or total is None or len(buckets) != len(bounds):
        for v in values:
            hist.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:  # observe's rule: the first bucket whose bound is >= v (+Inf is last)
        i = bisect_left(bounds, v)
        counts[i] = counts.get(i, 0) + 1
    for i, c in counts.items():
        buckets[i].inc(c)
    total.inc(sum(values))


class RequestTracker:
    """Feeds one request's outputs into the metrics; ``finish`` exactly once."""

    __slots__ = ("m", "arrival", "first", "last", "tokens", "prompt_seen", "done", "max_tokens",
                 "group", "gaps", "unflushed", "flushed_at")

    def __init__(self, m: Metrics, arrival: float, max_tokens: int = 0,
                 group: Optional[_PromptGroup] = None) -> None:
        self.m = m
        self.arrival = arrival
        self.first: Optional[float] = None
        self.last: Optional[float] = None
        self.tokens = 0
        self.prompt_seen = False
        self.done = False
        self.max_tokens = max_tokens
        if group is None:
            group = _PromptGroup(m)
            group.n = 1
        self.group = group
        self.gaps: list[float] = []  # inter-token gaps not yet observed
        self.unflushed = 0  # generated tokens not yet counted
        self.flushed_at = arrival
        m.in_flight.inc()

    def submitted(self) -> None:
        """The request (this choice) goes to the engine now."""
        self.m.submit_time.observe(time.monotonic() - self.arrival)

    def output(self, out) -> None:
        t = time.monotonic()
        m = self.m
        if not self.prompt_seen and out.num_prompt_tokens:
            self.prompt_seen = True
            m.prompt_tokens.inc(out.num_prompt_tokens)
            hists = m.token_histograms()
            if hists is not None:
                hists[0].observe(out.num_prompt_tokens)
        k = len(out.token_ids)
        if k:
            self.tokens += k
            self.unflushed += k
            if self.last is None:
                m.ttft.observe(t - self.arrival)
                self.first = t
            else:  # k tokens arrived together (speculation): spread the gap over them
                gap = (t - self.last) / k
                self.gaps.extend([gap] * k)
            self.last = t
            if self.unflushed >= FLUSH_TOKENS or t - self.flushed_at >= FLUSH_S:
                self.flush(t)
        if out.finished:
            self.finish(out.finish_reason or "stop")

    def flush(self, t: float) -> None:
        """Count the tokens and observe the gaps seen since the last flush."""
        self.flushed_at = t
        if self.unflushed:
            self.m.generation_tokens.inc(self.unflushed)
            self.unflushed = 0
        if self.gaps:
            observe_many(self.m.itl, self.gaps)
            self.gaps = []

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.m
        self.flush(time.monotonic())
        m.in_flight.dec()
        m.requests.labels(reason if reason in FINISH_REASONS else "error").inc()
        m.e2e.observe(time.monotonic() - self.arrival)
        if self.tokens >= 2:
            m.tpot.observe((self.last - self.first) / (self.tokens - 1))
        hists = m.token_histograms()
        if hists is not None:
            hists[1].observe(self.tokens)
            if self.max_tokens:
                hists[3].observe(self.max_tokens)
        self.group.ended(self.tokens)

    def discard(self) -> None:
        """The request never started (refused): only the in-flight gauge is undone."""
        if not self.done:
            self.done = True
            self.m.in_flight.dec()
            self.group.ended(None)


__all__ = ["Metrics", "RequestTracker", "observe_many", "EngineCollector", "CONTENT_TYPE_LATEST",
           "cache_info", "MULTIPROC_ENV", "STATES", "FINISH_REASONS"]

"""The engine's statistics: :class:`EngineStats` (``AsyncEngine.statistics()``), the figures its
:class:`~engine.interface.Health` carries for /metrics, and ``EngineTimings``, the engine core's
own histograms (step time; per request: arrival in its busy period, queue, prefill, decode and
running time, prompt tokens computed; tokens per step), kept as fixed-bucket counts so a
snapshot is a few integers (they travel in the ``Health`` frame and become Prometheus histograms
in the HTTP frontends).

The bounds contain vLLM's for the same figures (``entrypoints/http/vllm_names.py`` serves
them under vLLM's names too, from the same counts: a bucket of vLLM's is the cumulative count
at its bound), with finer ones below where this engine's figures usually fall.
"""

from __future__ import annotations

from bisect import bisect_left
import time
from typing import Any, NamedTuple, Optional, Sequence

from states import State

#: Upper bounds (seconds, ``le``) of the step-time buckets; a last, implicit bucket is +Inf.
STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0)
#: Upper bounds of a request's times in the engine (queue: arrival -> first scheduled; prefill:
#: -> first token; decode: first token -> end; running: first scheduled -> end): vLLM's
#: request-latency bounds (0.3 .. 7680) with finer ones from 1 ms (and up to 2.5 s, where a
#: burst's queue and prefill times fall: their quantiles are read from these buckets).
REQUEST_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4,
                        0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 5.0, 10.0, 15.0,
                        20.0, 30.0, 40.0, 50.0, 60.0, 80.0, 120.0, 160.0, 240.0, 480.0, 640.0,
                        960.0, 1920.0, 2560.0, 7680.0)
QUEUE_TIME_BUCKETS = REQUEST_TIME_BUCKETS
#: Prefill time per prompt token (vLLM's 1 ms .. 1 s, and finer from 10 us).
PREFILL_TOKEN_TIME_BUCKETS = (1e-05, 2e-05, 5e-05, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005,
                              0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: A request's arrival in the engine after the start of the engine's busy period (the arrival of
#: a request while it held none): in a burst, how late each request reached the engine.
ARRIVAL_OFFSET_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25,
                          0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0,
                          1800.0, 7680.0)
#: Tokens a step produced or consumed (vLLM's bounds).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_count_buckets(max_value: int) -> tuple[int, ...]:
    """Bounds for a per-request token count: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` (the
    context limit), as vLLM builds them."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def histogram_bounds(max_model_len: int) -> dict[str, tuple]:
    """Every ``EngineTimings`` histogram's bounds by its key (``Health`` carries ``<key>_counts``
    and ``<key>_sum``); the frontends read the counts back with the same bounds."""
    return {"step_time": STEP_TIME_BUCKETS, "queue_time": REQUEST_TIME_BUCKETS,
            "prefill_time": REQUEST_TIME_BUCKETS, "decode_time": REQUEST_TIME_BUCKETS,
            "inference_time": REQUEST_TIME_BUCKETS,
            "prefill_token_time": PREFILL_TOKEN_TIME_BUCKETS,
            "prefill_computed": token_count_buckets(max_model_len),
            "iteration_tokens": ITERATION_TOKEN_BUCKETS,
            "arrival_offset": ARRIVAL_OFFSET_BUCKETS}


class CoreStats(NamedTuple):
    steps: int
    prompt_tokens: int
    generation_tokens: int
    finished: dict
    preemptions: int
    spec_proposed: int
    spec_accepted: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens whose K/V came from the cache


class HistogramSnapshot(NamedTuple):
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bucket (not cumulative); len(bounds) + 1, the last is +Inf
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        value = max(0.0, value)
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bound >= value (le)
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum)


class EngineTimings:
    """Fed by ``EngineCore``: each step's wall time and tokens; each request's arrival after the
    start of the busy period it arrived in, its time in the queue (arrival to its first
    scheduling; a preempted request is not counted again) and, when it ends, its prefill, decode
    and running times and the prompt tokens it computed. The per-step and per-request work is a
    clock read and a few bisections."""

    def __init__(self, max_model_len: int = 0) -> None:
        for key, bounds in histogram_bounds(max_model_len).items():
            setattr(self, key, Histogram(bounds))
        self.keys = tuple(histogram_bounds(max_model_len))
        #: the prompts of the requests whose first token came in the step under way (a step's
        #: tokens are those and the tokens generated: vLLM counts them so)
        self.iter_tokens = 0
        self._generated = 0  # the engine's count of generated tokens at the last step's end
        self._busy_since: Optional[float] = None  # the first arrival of the busy period

    def arrived(self, t: float, idle: bool) -> None:
        """A request reached the core at ``t`` (its ``arrival``); ``idle``: the core held no
        request until then, so a busy period starts with this one."""
        if idle or self._busy_since is None:
            self._busy_since = t
        self.arrival_offset.observe(t - self._busy_since)

    def scheduled(self, batch) -> None:
        now = time.monotonic()
        for req, _ in batch:
            if req.first_scheduled is None:
                req.first_scheduled = now
                self.queue_time.observe(now - req.arrival)

    def end_iteration(self, generated: int) -> None:
        """A step's outputs are out (``generated``: the engine's count of tokens generated so
        far): its token count, if it produced any."""
        n = generated - self._generated + self.iter_tokens
        if n:
            self.iteration_tokens.observe(n)
            self._generated, self.iter_tokens = generated, 0

    def finished(self, req) -> None:
        """``req`` ends (finished or aborted): its phases, if it was ever scheduled. A request
        that produced no token has no prefill or decode time (only its running time)."""
        start = req.first_scheduled
        if start is None:
            return
        now = time.monotonic()
        self.inference_time.observe(now - start)
        first = req.first_token_time
        if first is not None:
            self.prefill_time.observe(first - start)
            self.decode_time.observe(now - first)
            if req.num_prompt_tokens:
                self.prefill_token_time.observe((first - start) / req.num_prompt_tokens)
            self.prefill_computed.observe(req.num_prompt_tokens - req.num_cached_tokens)

    def snapshot(self) -> tuple[HistogramSnapshot, HistogramSnapshot]:
        return self.step_time.snapshot(), self.queue_time.snapshot()

    def figures(self) -> dict:
        """Every histogram as ``Health`` fields."""
        out: dict = {}
        for key in self.keys:
            h = getattr(self, key)
            out[f"{key}_counts"] = list(h.counts)
            out[f"{key}_sum"] = max(0.0, h.sum)
        return out


class EngineStats(NamedTuple):
    state: State
    steps: int
    prompt_tokens: int
    generation_tokens: int
    finished: dict
    preemptions: int
    spec_proposed: int
    spec_accepted: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens whose K/V came from the cache
    running: int
    waiting: int
    kv_usage: float
    uptime_s: float
    step_time: Optional[HistogramSnapshot] = None  # None without a core (before serving, after)
    queue_time: Optional[HistogramSnapshot] = None
    deterministic: bool = False  # EngineConfig.deterministic (batch-invariant forward)


def engine_stats(state: State, core: Any, health: Any, uptime_s: float) -> EngineStats:
    """``EngineStats`` from the engine core (``None`` when there is none) and its ``Health``."""
    cs = core.statistics() if core is not None else None
    h = health
    det = bool(getattr(h, "deterministic", False))
    if cs is None:
        return EngineStats(state, 0, 0, 0, {}, 0, 0, 0, 0, 0, h.running, h.waiting, h.kv_usage,
                           uptime_s, deterministic=det)
    return EngineStats(state, cs.steps, cs.prompt_tokens, cs.generation_tokens, cs.finished,
                       cs.preemptions, cs.spec_proposed, cs.spec_accepted, cs.prefix_cache_queries,
                       cs.prefix_cache_hits, h.running, h.waiting, h.kv_usage, uptime_s,
                       *core.timings.snapshot(), deterministic=det)


def health_figures(core: Any) -> dict:
    """The engine core's counters and histograms as ``Health`` fields (none without a core)."""
    if core is None:
        return {}
    cs = core.statistics()
    spec = core.spec_stats
    return {"steps": cs.steps, "preemptions": cs.preemptions,
            "prefix_cache_queries": cs.prefix_cache_queries,
            "prefix_cache_hits": cs.prefix_cache_hits,
            "spec_drafts": spec.verifications, "spec_draft_tokens": spec.proposed,
            "spec_accepted_tokens": spec.accepted,
            "spec_accepted_per_pos": list(spec.accepted_per_pos),
            **core.timings.figures()}


__all__ = ["CoreStats", "EngineStats", "EngineTimings", "Histogram", "HistogramSnapshot", "engine_stats",
           "health_figures", "histogram_bounds", "token_count_buckets", "STEP_TIME_BUCKETS",
           "QUEUE_TIME_BUCKETS", "REQUEST_TIME_BUCKETS", "PREFILL_TOKEN_TIME_BUCKETS",
           "ITERATION_TOKEN_BUCKETS", "ARRIVAL_OFFSET_BUCKETS"]

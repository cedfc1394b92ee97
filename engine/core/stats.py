"""The engine's statistics: :class:`EngineStats` (``AsyncEngine.statistics()``), the figures
its :class:`~engine.interface.Health` carries for /metrics, and ``EngineTimings``, the engine
core's own latency histograms (step time, queue time), kept as fixed-bucket counts so a snapshot
is a few integers (they travel in the ``Health`` frame and become Prometheus histograms in the
HTTP frontends)."""

from __future__ import annotations

from bisect import bisect_left
import time
from typing import Any, NamedTuple, Optional, Sequence

from states import State

#: Upper bounds (seconds, ``le``) of the step-time buckets; a last, implicit bucket is +Inf.
STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
                     5.0, 10.0)
#: Upper bounds of the queue-time buckets (arrival -> first scheduled), as vLLM's.
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                      40.0, 80.0, 160.0, 640.0, 2560.0)


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
    """Fed by ``EngineCore.step()``: the step's wall time, and each request's time in the queue
    (arrival to its first scheduling; a preempted request is not counted again)."""

    def __init__(self) -> None:
        self.step_time = Histogram(STEP_TIME_BUCKETS)
        self.queue_time = Histogram(QUEUE_TIME_BUCKETS)

    def scheduled(self, batch) -> None:
        now = time.monotonic()
        for req, _ in batch:
            if req.first_scheduled is None:
                req.first_scheduled = now
                self.queue_time.observe(now - req.arrival)

    def snapshot(self) -> tuple[HistogramSnapshot, HistogramSnapshot]:
        return self.step_time.snapshot(), self.queue_time.snapshot()


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


def engine_stats(state: State, core: Any, health: Any, uptime_s: float) -> EngineStats:
    """``EngineStats`` from the engine core (``None`` when there is none) and its ``Health``."""
    cs = core.statistics() if core is not None else None
    h = health
    if cs is None:
        return EngineStats(state, 0, 0, 0, {}, 0, 0, 0, 0, 0, h.running, h.waiting, h.kv_usage,
                           uptime_s)
    return EngineStats(state, cs.steps, cs.prompt_tokens, cs.generation_tokens, cs.finished,
                       cs.preemptions, cs.spec_proposed, cs.spec_accepted, cs.prefix_cache_queries,
                       cs.prefix_cache_hits, h.running, h.waiting, h.kv_usage, uptime_s,
                       *core.timings.snapshot())


def health_figures(core: Any) -> dict:
    """The engine core's counters and histograms as ``Health`` fields (none without a core)."""
    if core is None:
        return {}
    cs = core.statistics()
    step, queue = core.timings.snapshot()
    return {"steps": cs.steps, "preemptions": cs.preemptions,
            "prefix_cache_queries": cs.prefix_cache_queries,
            "prefix_cache_hits": cs.prefix_cache_hits,
            "step_time_counts": list(step.counts), "step_time_sum": max(0.0, step.sum),
            "queue_time_counts": list(queue.counts), "queue_time_sum": max(0.0, queue.sum)}


__all__ = ["CoreStats", "EngineStats", "EngineTimings", "Histogram", "HistogramSnapshot", "engine_stats",
           "health_figures", "STEP_TIME_BUCKETS", "QUEUE_TIME_BUCKETS"]

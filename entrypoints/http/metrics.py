"""Prometheus metrics of the HTTP frontends, one view across every API server process.

Two sources:

* Per-request figures measured in the frontend (finished requests by finish reason, refusals,
  prompt / generation tokens, time to first token, inter-token and end-to-end latency, requests
  in flight). With ``PROMETHEUS_MULTIPROC_DIR`` set (``enginecore serve --http`` sets it for its
  frontends: entrypoints/http/frontend.py) they are prometheus-client multiprocess values, and a
  scrape sums every frontend's files (:class:`MultiProcessCollector`), so counters count all
  requests and never go back, whichever process answers. Without it (one in-process app) they
  are this process's own.
* The engine's figures (running / waiting, KV-cache usage, state, preemptions, steps, prefix
  cache, step-time and queue-time histograms), read from the engine's Health snapshot at each
  scrape (:class:`EngineCollector`); they are the engine's own, never summed over frontends.

Metric names and their vLLM counterparts: docs/metrics.md.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Optional

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.core.stats import QUEUE_TIME_BUCKETS, STEP_TIME_BUCKETS
from states import State

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

FINISH_REASONS = ("stop", "length", "abort", "error")
STATES = tuple(s.value for s in State)

# engine counter -> (Health / EngineStats field, help)
_ENGINE_COUNTERS = {
    "enginecore_engine_steps": ("steps", "Engine steps run"),
    "enginecore_preemptions": ("preemptions", "Requests preempted (recomputed later)"),
    "enginecore_prefix_cache_queries": ("prefix_cache_queries",
                                        "Prompt tokens looked up in the prefix cache"),
    "enginecore_prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
}
_ENGINE_HISTOGRAMS = {
    "enginecore_step_time_seconds": ("step_time", STEP_TIME_BUCKETS,
                                     "Wall time of one engine step (schedule, forward, sample)"),
    "enginecore_request_queue_time_seconds": ("queue_time", QUEUE_TIME_BUCKETS,
                                              "Time from arrival in the engine to first scheduling"),
}


def multiprocess_dir() -> Optional[str]:
    return os.environ.get(MULTIPROC_ENV) or None


def cache_info(engine: Any) -> dict[str, str]:
    """The ``enginecore_cache_config_info`` labels of an in-process engine (``{}`` if unknown)."""
    runner = getattr(engine, "runner", None)
    if runner is None or not getattr(runner, "num_blocks", 0):
        return {}
    return {"block_size": str(runner.block_size), "num_gpu_blocks": str(runner.num_blocks),
            "cache_dtype": str(runner.dtype).removeprefix("torch."),
            "device": str(runner.device), "enable_prefix_caching": str(
                bool(getattr(runner.config, "enable_prefix_caching", False)))}


class EngineCollector:
    """The engine's figures at the last :meth:`update`; engine counters never go back (a
    high-water mark per counter: the engine reports zeros once it has released its core)."""

    def __init__(self, info: Optional[Mapping[str, str]] = None) -> None:
        self.info = dict(info or {})
        self.state = State.INIT.value
        self.gauges = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
        self.counters = {name: 0 for name in _ENGINE_COUNTERS}
        self.histograms: dict[str, tuple[list[int], float]] = {}

    def update(self, health: Any) -> None:
        """From an :class:`engine.interface.Health` (or anything with its fields)."""
        state = health.state.value if isinstance(health.state, State) else str(health.state)
        self.state = state if state in STATES else State.FAILED.value
        for key in self.gauges:
            self.gauges[key] = float(getattr(health, key, 0.0) or 0.0)
        for name, (key, _) in _ENGINE_COUNTERS.items():
            self.counters[name] = max(self.counters[name], int(getattr(health, key, 0) or 0))
        for name, (key, bounds, _) in _ENGINE_HISTOGRAMS.items():
            counts = list(getattr(health, f"{key}_counts", None) or [])
            old = self.histograms.get(name)
            if len(counts) == len(bounds) + 1 and (old is None or sum(counts) >= sum(old[0])):
                self.histograms[name] = (counts, float(getattr(health, f"{key}_sum", 0.0) or 0.0))

    def unreachable(self) -> None:
        self.state = State.FAILED.value
        self.gauges = dict.fromkeys(self.gauges, 0.0)

    def describe(self):
        return []  # no duplicate checks against the frontend's own metrics

    def collect(self):
        g = self.gauges
        for name, value, doc in (
                ("enginecore_requests_running", g["running"], "Requests running in the engine"),
                ("enginecore_requests_waiting", g["waiting"], "Requests waiting in the engine"),
                ("enginecore_kv_cache_usage_ratio", g["kv_usage"],
                 "Fraction of the engine's KV cache blocks in use (0..1)")):
            yield GaugeMetricFamily(name, doc, value=value)
        state = GaugeMetricFamily("enginecore_engine_state",
                                  "The engine's lifecycle state (1 for the current one)",
                                  labels=["state"])
        for s in STATES:
            state.add_metric([s], 1.0 if s == self.state else 0.0)
        yield state
        for name, (_, doc) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=self.counters[name])
        for name, (key, bounds, doc) in _ENGINE_HISTOGRAMS.items():
            counts, total = self.histograms.get(name, ([0] * (len(bounds) + 1), 0.0))
            cumulative, running = [], 0
            for le, c in zip([*(repr(float(b)) for b in bounds), "+Inf"], counts):
                running += c
                cumulative.append((le, running))
            yield HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)
        info = GaugeMetricFamily("enginecore_cache_config_info",
                                 "The KV cache's configuration (labels; value 1)",
                                 labels=list(self.info))
        info.add_metric(list(self.info.values()), 1.0)
        yield info


class Metrics:
    def __init__(self, engine: Any = None, info: Optional[Mapping[str, str]] = None) -> None:
        if info is None and engine is not None:  # an in-process engine: read from its runner
            info = cache_info(engine)
        self.engine = EngineCollector(info)
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
        self.e2e = Histogram("enginecore_e2e_request_latency_seconds",
                             "Time from request arrival to its last output", buckets=E2E_BUCKETS,
                             registry=r)
        self.in_flight = Gauge("enginecore_frontend_requests_in_flight",
                               "Generation requests open in the frontend processes", registry=r,
                               multiprocess_mode="livesum")
        for reason in FINISH_REASONS:  # expose zeros from the start
            self.requests.labels(reason)
        for reason in ("bad_request", "draining", "overloaded", "unavailable"):
            self.rejected.labels(reason)
        path = multiprocess_dir()
        if path is None:
            self._exposed = r
        else:  # this process's values are files in `path`; expose every process's files
            from prometheus_client.multiprocess import MultiProcessCollector

            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed, path=path)
        self._exposed.register(self.engine)

    def set_health(self, h) -> None:
        self.engine.update(h)

    def set_unreachable(self) -> None:
        self.engine.unreachable()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST

    def tracker(self, arrival: float) -> "RequestTracker":
        return RequestTracker(self, arrival)


class RequestTracker:
    """Feeds one request's outputs into the metrics; ``finish`` exactly once."""

    __slots__ = ("m", "arrival", "last", "prompt_seen", "done")

    def __init__(self, m: Metrics, arrival: float) -> None:
        self.m = m
        self.arrival = arrival
        self.last: Optional[float] = None
        self.prompt_seen = False
        self.done = False
        m.in_flight.inc()

    def output(self, out) -> None:
        t = time.monotonic()
        m = self.m
        if not self.prompt_seen and out.num_prompt_tokens:
            self.prompt_seen = True
            m.prompt_tokens.inc(out.num_prompt_tokens)
        k = len(out.token_ids)
        if k:
            m.generation_tokens.inc(k)
            if self.last is None:
                m.ttft.observe(t - self.arrival)
            else:  # k tokens arrived together (speculation): spread the gap over them
                gap = (t - self.last) / k
                for _ in range(k):
                    m.itl.observe(gap)
            self.last = t
        if out.finished:
            self.finish(out.finish_reason or "stop")

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        m = self.m
        m.in_flight.dec()
        m.requests.labels(reason if reason in FINISH_REASONS else "error").inc()
        m.e2e.observe(time.monotonic() - self.arrival)

    def discard(self) -> None:
        """The request never started (refused): only the in-flight gauge is undone."""
        if not self.done:
            self.done = True
            self.m.in_flight.dec()


__all__ = ["Metrics", "RequestTracker", "EngineCollector", "CONTENT_TYPE_LATEST", "cache_info",
           "MULTIPROC_ENV"]

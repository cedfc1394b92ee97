"""Prometheus metrics of one frontend process (its own registry: counters and histograms count
the requests *this* process served; the gauges are the engine's, from its health snapshot)."""

from __future__ import annotations

import time
from typing import Optional

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Enum, Gauge,
                               Histogram, generate_latest)

from states import State

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

FINISH_REASONS = ("stop", "length", "abort", "error")
STATES = tuple(s.value for s in State)


class Metrics:
    def __init__(self) -> None:
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
                               "Generation requests open in this frontend process", registry=r)
        self.running = Gauge("enginecore_requests_running", "Requests running in the engine",
                             registry=r)
        self.waiting = Gauge("enginecore_requests_waiting", "Requests waiting in the engine",
                             registry=r)
        self.kv_usage = Gauge("enginecore_kv_cache_usage_ratio",
                              "Fraction of the engine's KV cache blocks in use (0..1)", registry=r)
        self.state = Enum("enginecore_engine_state", "The engine's lifecycle state",
                          states=list(STATES), registry=r)
        for reason in FINISH_REASONS:  # expose zeros from the start
            self.requests.labels(reason)
        for reason in ("bad_request", "draining", "overloaded", "unavailable"):
            self.rejected.labels(reason)

    def set_health(self, h) -> None:
        state = h.state.value if isinstance(h.state, State) else str(h.state)
        self.state.state(state if state in STATES else State.FAILED.value)
        self.running.set(h.running)
        self.waiting.set(h.waiting)
        self.kv_usage.set(h.kv_usage)

    def set_unreachable(self) -> None:
        self.state.state(State.FAILED.value)
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(0)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

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


__all__ = ["Metrics", "RequestTracker", "CONTENT_TYPE_LATEST"]

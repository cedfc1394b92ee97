"""The engine's figures for /metrics: :class:`EngineCollector` turns the engine's ``Health``
snapshot (running / waiting, KV-cache usage, state and sleep level, engine counters, the
engine's histograms over ``engine/core/stats.py``'s bounds) into Prometheus families at each
scrape. They are the engine's own, never summed over frontends; counters never go back (a
high-water mark each: the engine reports zeros once it has released its core)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from engine.core.stats import histogram_bounds
from states import State

STATES = tuple(s.value for s in State)

#: engine counter -> (Health field, help)
COUNTERS = {
    "enginecore_engine_steps": ("steps", "Engine steps run"),
    "enginecore_preemptions": ("preemptions", "Requests preempted (recomputed later)"),
    "enginecore_prefix_cache_queries": ("prefix_cache_queries",
                                        "Prompt tokens looked up in the prefix cache"),
    "enginecore_prefix_cache_hits": ("prefix_cache_hits",
                                     "Prompt tokens found in the prefix cache"),
}
#: only with a speculator (the engine then reports one count per draft position)
SPEC_COUNTERS = {
    "enginecore_spec_decode_drafts": ("spec_drafts",
                                      "Drafts verified (one per request and step with a draft)"),
    "enginecore_spec_decode_draft_tokens": ("spec_draft_tokens", "Draft tokens verified"),
    "enginecore_spec_decode_accepted_tokens": ("spec_accepted_tokens", "Draft tokens accepted"),
}
SPEC_PER_POS = "enginecore_spec_decode_accepted_tokens_per_pos"
#: engine histogram -> (Health field prefix: engine/core/stats.py's histogram_bounds key, help)
HISTOGRAMS = {
    "enginecore_step_time_seconds": ("step_time",
                                     "Wall time of one engine step (schedule, forward, sample)"),
    "enginecore_request_queue_time_seconds": (
        "queue_time", "Time from arrival in the engine to first scheduling"),
    "enginecore_request_prefill_time_seconds": (
        "prefill_time", "Time from a request's first scheduling to its first token"),
    "enginecore_request_decode_time_seconds": (
        "decode_time", "Time from a request's first token to its end"),
    "enginecore_request_inference_time_seconds": (
        "inference_time", "Time from a request's first scheduling to its end (prefill + decode)"),
    "enginecore_request_prefill_time_per_token_seconds": (
        "prefill_token_time", "A request's prefill time divided by its prompt tokens"),
    "enginecore_request_prefill_computed_tokens": (
        "prefill_computed", "Prompt tokens a request computed (those not in the prefix cache)"),
    "enginecore_request_arrival_offset_seconds": (
        "arrival_offset", "Time from the start of the engine's busy period (a request's arrival "
        "while it held none) to a request's arrival in the engine"),
    "enginecore_iteration_tokens": (
        "iteration_tokens", "Tokens of an engine step's outputs: those generated, and a "
        "request's prompt with its first token"),
}
_GAUGES = (("enginecore_requests_running", "running", "Requests running in the engine"),
           ("enginecore_requests_waiting", "waiting", "Requests waiting in the engine"),
           ("enginecore_kv_cache_usage_ratio", "kv_usage",
            "Fraction of the engine's KV cache blocks in use (0..1)"))


class EngineCollector:
    """The engine's figures at the last :meth:`update`. ``max_model_len()``: the context limit
    (the bounds of the per-request token-count histogram depend on it; 0 = unknown)."""

    def __init__(self, info: Optional[Mapping[str, str]] = None,
                 max_model_len: Callable[[], int] = lambda: 0) -> None:
        self.info = dict(info or {})
        self._max_model_len = max_model_len
        self.state = State.INIT.value
        self.sleep_level = 0
        self.deterministic = False
        self.gauges = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
        self.counters = {name: 0 for name in (*COUNTERS, *SPEC_COUNTERS)}
        self.per_pos: Optional[list[int]] = None  # None: no speculator seen
        self.histograms: dict[str, tuple[list[int], float]] = {}

    def bounds(self) -> dict[str, tuple]:
        return histogram_bounds(self._max_model_len() or 0)

    def update(self, health: Any) -> None:
        """From an :class:`engine.interface.Health` (or anything with its fields)."""
        state = health.state.value if isinstance(health.state, State) else str(health.state)
        self.state = state if state in STATES else State.FAILED.value
        self.sleep_level = int(getattr(health, "sleep_level", 0) or 0)
        self.deterministic = bool(getattr(health, "deterministic", False))
        for key in self.gauges:
            self.gauges[key] = float(getattr(health, key, 0.0) or 0.0)
        for name, (key, _) in (*COUNTERS.items(), *SPEC_COUNTERS.items()):
            self.counters[name] = max(self.counters[name], int(getattr(health, key, 0) or 0))
        per_pos = list(getattr(health, "spec_accepted_per_pos", None) or [])
        if per_pos:
            old = self.per_pos or []
            self.per_pos = [max(v, old[i] if i < len(old) else 0) for i, v in enumerate(per_pos)]
        bounds = self.bounds()
        for name, (key, _) in HISTOGRAMS.items():
            counts = list(getattr(health, f"{key}_counts", None) or [])
            old = self.histograms.get(name)
            if len(counts) == len(bounds[key]) + 1 and (old is None or sum(counts) >= sum(old[0])):
                self.histograms[name] = (counts, float(getattr(health, f"{key}_sum", 0.0) or 0.0))

    def unreachable(self) -> None:
        self.state = State.FAILED.value
        self.sleep_level = 0
        self.gauges = dict.fromkeys(self.gauges, 0.0)

    def describe(self):
        return []  # no duplicate checks against the frontend's own metrics

    def collect(self):
        for name, key, doc in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=self.gauges[key])
        state = GaugeMetricFamily("enginecore_engine_state",
                                  "The engine's lifecycle state (1 for the current one)",
                                  labels=["state"])
        for s in STATES:
            state.add_metric([s], 1.0 if s == self.state else 0.0)
        yield state
        yield GaugeMetricFamily("enginecore_engine_sleep_level",
                                "0 while awake; while asleep the sleep level (1: weights kept in "
                                "host memory, 2: weights dropped)", value=self.sleep_level)
        yield GaugeMetricFamily("enginecore_deterministic", "1 if the engine runs in deterministic "
                                "mode (batch-invariant forward), else 0", value=int(self.deterministic))
        for name, (_, doc) in COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=self.counters[name])
        if self.per_pos is not None:
            for name, (_, doc) in SPEC_COUNTERS.items():
                yield CounterMetricFamily(name, doc, value=self.counters[name])
            pos = CounterMetricFamily(SPEC_PER_POS, "Drafts whose token at this position (0: the "
                                      "first drafted) was accepted", labels=["position"])
            for i, v in enumerate(self.per_pos):
                pos.add_metric([str(i)], v)
            yield pos
        bounds = self.bounds()
        for name, (key, doc) in HISTOGRAMS.items():
            b = bounds[key]
            counts, total = self.histograms.get(name, ([0] * (len(b) + 1), 0.0))
            cumulative, running = [], 0
            for le, c in zip([*map(floatToGoString, b), "+Inf"], counts):
                running += c
                cumulative.append((le, running))
            yield HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=total)
        info = GaugeMetricFamily("enginecore_cache_config_info",
                                 "The KV cache's configuration (labels; value 1)",
                                 labels=list(self.info))
        info.add_metric(list(self.info.values()), 1.0)
        yield info


def cache_info(engine: Any) -> dict[str, str]:
    """The ``enginecore_cache_config_info`` labels of an in-process engine (``{}`` if unknown)."""
    runner = getattr(engine, "runner", None)
    if runner is None or not getattr(runner, "num_blocks", 0):
        return {}
    return {"block_size": str(runner.block_size), "num_gpu_blocks": str(runner.num_blocks),
            "cache_dtype": str(runner.dtype).removeprefix("torch."),
            "device": str(runner.device), "enable_prefix_caching": str(
                bool(getattr(runner.config, "enable_prefix_caching", False)))}


__all__ = ["EngineCollector", "cache_info", "COUNTERS", "SPEC_COUNTERS", "SPEC_PER_POS",
           "HISTOGRAMS", "STATES"]

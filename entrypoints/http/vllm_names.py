"""vLLM's metric names (``vllm:*``) beside ours, so that vLLM's Grafana dashboards and alerting
rules read this server unchanged (docs/metrics.md has the table and what is not served).

Nothing here is measured or counted: :func:`vllm_view` renames, at each scrape, the families
just collected (the frontends' multiprocess values summed over every API server, and the
engine's from its ``Health``), adding vLLM's labels (``model_name``: the served model name;
``engine``: ``"0"``). One observation therefore feeds both names and they cannot drift apart. Where
vLLM's histogram bounds differ from ours, ours contain vLLM's (engine/core/stats.py, metrics.py),
so vLLM's buckets are our cumulative counts at its bounds; ``_sum`` and ``_count`` are ours.

Written here (not a library) because no Prometheus client renames a collected family.
"""

from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple, Optional

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

#: vLLM's histogram bounds where ours differ (vllm/v1/metrics/loggers.py)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                             50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_PREFILL_TOKEN_TIME_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)

ENGINE_LABEL = "0"  # one engine core per server


class Alias(NamedTuple):
    name: str  # vLLM's family name (counters without ``_total``)
    doc: str
    bounds: Optional[tuple] = None  # a histogram's bounds in vLLM, a subset of ours
    labels: tuple[tuple[str, str], ...] = ()  # (our label, vLLM's) renamed
    model_label: bool = True  # cache_config_info has no model_name in vLLM


#: our family -> its vLLM names
ALIASES: dict[str, tuple[Alias, ...]] = {
    # frontends (per request, summed over the API servers)
    "enginecore_prompt_tokens": (
        Alias("vllm:prompt_tokens", "Number of prefill tokens processed."),),
    "enginecore_generation_tokens": (
        Alias("vllm:generation_tokens", "Number of generation tokens processed."),),
    "enginecore_requests": (Alias("vllm:request_success", "Count of processed requests by finish "
                                  "reason.", labels=(("finish_reason", "finished_reason"),)),),
    "enginecore_request_prompt_tokens": (
        Alias("vllm:request_prompt_tokens", "Number of prefill tokens processed."),),
    "enginecore_request_generation_tokens": (
        Alias("vllm:request_generation_tokens", "Number of generation tokens processed."),),
    "enginecore_request_max_num_generation_tokens": (
        Alias("vllm:request_max_num_generation_tokens",
              "Histogram of maximum number of requested generation tokens."),),
    "enginecore_request_params_n": (
        Alias("vllm:request_params_n", "Histogram of the n request parameter.", VLLM_N_BUCKETS),),
    "enginecore_request_params_max_tokens": (
        Alias("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."),),
    "enginecore_time_to_first_token_seconds": (
        Alias("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
              VLLM_TTFT_BUCKETS),),
    "enginecore_inter_token_latency_seconds": (
        Alias("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
              VLLM_ITL_BUCKETS),
        Alias("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
              "seconds. DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
              VLLM_ITL_BUCKETS)),
    "enginecore_request_time_per_output_token_seconds": (
        Alias("vllm:request_time_per_output_token_seconds",
              "Histogram of time_per_output_token_seconds per request.", VLLM_ITL_BUCKETS),),
    "enginecore_e2e_request_latency_seconds": (
        Alias("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
              VLLM_REQUEST_TIME_BUCKETS),),
    # the engine (from its Health)
    "enginecore_requests_running": (
        Alias("vllm:num_requests_running", "Number of requests in model execution batches."),),
    "enginecore_requests_waiting": (
        Alias("vllm:num_requests_waiting", "Number of requests waiting to be processed."),),
    "enginecore_kv_cache_usage_ratio": (
        Alias("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
        Alias("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage. "
              "DEPRECATED: Use vllm:kv_cache_usage_perc instead.")),
    "enginecore_preemptions": (
        Alias("vllm:num_preemptions", "Cumulative number of preemption from the engine."),),
    "enginecore_prefix_cache_queries": (
        Alias("vllm:prefix_cache_queries",
              "Prefix cache queries, in terms of number of queried tokens."),
        Alias("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of number of "
              "queried tokens. DEPRECATED: Use vllm:prefix_cache_queries instead.")),
    "enginecore_prefix_cache_hits": (
        Alias("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
        Alias("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of cached "
              "tokens. DEPRECATED: Use vllm:prefix_cache_hits instead."),
        Alias("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")),
    "enginecore_request_queue_time_seconds": (
        Alias("vllm:request_queue_time_seconds",
              "Histogram of time spent in WAITING phase for request.", VLLM_REQUEST_TIME_BUCKETS),),
    "enginecore_request_prefill_time_seconds": (
        Alias("vllm:request_prefill_time_seconds",
              "Histogram of time spent in PREFILL phase for request.", VLLM_REQUEST_TIME_BUCKETS),),
    "enginecore_request_decode_time_seconds": (
        Alias("vllm:request_decode_time_seconds",
              "Histogram of time spent in DECODE phase for request.", VLLM_REQUEST_TIME_BUCKETS),),
    "enginecore_request_inference_time_seconds": (
        Alias("vllm:request_inference_time_seconds",
              "Histogram of time spent in RUNNING phase for request.", VLLM_REQUEST_TIME_BUCKETS),),
    "enginecore_request_prefill_time_per_token_seconds": (
        Alias("vllm:time_per_prefill_token_request_seconds",
              "Time spent per token during prefill phase in seconds",
              VLLM_PREFILL_TOKEN_TIME_BUCKETS),),
    "enginecore_request_prefill_computed_tokens": (
        Alias("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed "
              "during prefill (excluding cached tokens)."),),
    "enginecore_iteration_tokens": (
        Alias("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step."),),
    "enginecore_spec_decode_drafts": (
        Alias("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),),
    "enginecore_spec_decode_draft_tokens": (
        Alias("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),),
    "enginecore_spec_decode_accepted_tokens": (
        Alias("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),),
    "enginecore_spec_decode_accepted_tokens_per_pos": (
        Alias("vllm:spec_decode_num_accepted_tokens_per_pos",
              "Accepted tokens per draft position."),),
    "enginecore_cache_config_info": (
        Alias("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              model_label=False),),
}


def _renamed(fam: Metric, alias: Alias, model_name: str) -> Metric:
    out = Metric(alias.name, alias.doc, fam.type)
    keep = (None if alias.bounds is None
            else {*map(floatToGoString, alias.bounds), "+Inf"})
    extra = {"model_name": model_name, "engine": ENGINE_LABEL} if alias.model_label else {
        "engine": ENGINE_LABEL}
    renames = dict(alias.labels)
    cut = len(fam.name)
    for s in fam.samples:
        if keep is not None and "le" in s.labels and s.labels["le"] not in keep:
            continue
        labels = {renames.get(k, k): v for k, v in s.labels.items()}
        labels.update(extra)
        out.samples.append(Sample(alias.name + s.name[cut:], labels, s.value, s.timestamp,
                                  s.exemplar))
    return out


def _gauge(name: str, doc: str, values: Iterable[tuple[dict, float]], model_name: str) -> Metric:
    out = Metric(name, doc, "gauge")
    for labels, value in values:
        out.samples.append(Sample(name, {"model_name": model_name, "engine": ENGINE_LABEL,
                                         **labels}, value))
    return out


def vllm_view(families: Iterable[Metric], model_name: str) -> Iterator[Metric]:
    """vLLM's families from ours (collected at this scrape): renamed, relabelled, and the few
    that vLLM derives differently (sleep state, waiting by reason, swapped)."""
    by_name = {}
    for fam in families:
        by_name[fam.name] = fam
        for alias in ALIASES.get(fam.name, ()):
            yield _renamed(fam, alias, model_name)
    level = _value(by_name.get("enginecore_engine_sleep_level"))
    if level is not None:
        yield _gauge("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is "
                     "sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means "
                     "sleep level 1; discard_all = 1 means sleep level 2.",
                     [({"sleep_state": "awake"}, float(level == 0)),
                      ({"sleep_state": "weights_offloaded"}, float(level == 1)),
                      ({"sleep_state": "discard_all"}, float(level == 2))], model_name)
    waiting = _value(by_name.get("enginecore_requests_waiting"))
    if waiting is not None:
        # every waiting request waits for room (no LoRA budget or KV transfer defers one here)
        yield _gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by "
                     "reason: capacity = waiting for scheduling capacity; deferred = deferred "
                     "by transient constraints (none in this engine).",
                     [({"reason": "capacity"}, waiting), ({"reason": "deferred"}, 0.0)],
                     model_name)
        # preemption recomputes; nothing is ever swapped out to host memory
        yield _gauge("vllm:num_requests_swapped", "Number of requests swapped to CPU (always 0: "
                     "a preempted request is recomputed, never swapped).", [({}, 0.0)],
                     model_name)


def _value(fam: Optional[Metric]) -> Optional[float]:
    return fam.samples[0].value if fam is not None and fam.samples else None


__all__ = ["vllm_view", "ALIASES", "Alias", "VLLM_TTFT_BUCKETS", "VLLM_ITL_BUCKETS",
           "VLLM_REQUEST_TIME_BUCKETS", "VLLM_PREFILL_TOKEN_TIME_BUCKETS", "VLLM_N_BUCKETS"]

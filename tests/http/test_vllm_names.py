"""vLLM's metric names (``vllm:*``) beside ours on /metrics: every series that vLLM's own
metrics tests and its public Grafana dashboard read, with vLLM's labels and bucket bounds, and
each equal to the ``enginecore_*`` figure it is renamed from."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import anyio
from http_helpers import ROOT, TINY, served
from prometheus_client.parser import text_string_to_metric_families
import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.core.stats import EngineTimings
from engine.interface import Health
from entrypoints.http.metrics import Metrics
from entrypoints.http.vllm_names import ALIASES
from states import State

#: the sample names vLLM's metrics test (tests/entrypoints/openai/test_metrics.py) requires
VLLM_TEST_SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:iteration_tokens_total",
    "vllm:cache_config_info", "vllm:request_success_total",
    *(f"vllm:{h}_{s}" for h in (
        "request_prompt_tokens", "request_generation_tokens", "request_params_n",
        "request_params_max_tokens", "time_per_output_token_seconds",
        "time_to_first_token_seconds", "inter_token_latency_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds") for s in ("sum", "bucket", "count")),
]
#: what vLLM's Grafana dashboard (examples/observability/prometheus_grafana/grafana.json, and its
#: earlier versions) queries beyond those
VLLM_DASHBOARD_SERIES = [
    "vllm:num_requests_swapped", "vllm:request_max_num_generation_tokens_sum",
    "vllm:request_success_total", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
]
#: vLLM's bounds (vllm/v1/metrics/loggers.py), by family
LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
       20.0, 40.0, 80.0)
VLLM_BOUNDS = {
    "vllm:time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
                                         0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                                         160.0, 640.0, 2560.0),
    "vllm:inter_token_latency_seconds": ITL, "vllm:time_per_output_token_seconds": ITL,
    "vllm:request_time_per_output_token_seconds": ITL,
    **{f"vllm:{h}_seconds": LATENCY for h in ("e2e_request_latency", "request_queue_time",
                                              "request_inference_time", "request_prefill_time",
                                              "request_decode_time")},
    "vllm:time_per_prefill_token_request_seconds": (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                                                    0.2, 0.5, 1.0),
    "vllm:request_params_n": (1, 2, 5, 10, 20),
    "vllm:iteration_tokens_total": (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                    16384),
}
TOKEN_COUNT_FAMILIES = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                        "vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens",
                        "vllm:request_prefill_kv_computed_tokens")


def dashboard_queries() -> set[str]:
    """The metric names the deploy dashboard's queries read."""
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    return {m for e in exprs for m in re.findall(r"\b(?:enginecore_|vllm:)[a-z0-9_:]+", e)}


def one_two_five(limit: int) -> list[float]:
    return sorted(float(m * 10 ** e) for e in range(12) for m in (1, 2, 5) if m * 10 ** e <= limit)


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def values(text: str) -> dict:
    """sample name + sorted labels -> value"""
    return {s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def check_names_labels_buckets(text: str, model: str, max_model_len: int) -> None:
    fams = families(text)
    names = {s.name for f in fams.values() for s in f.samples}
    # (vLLM's test looks for each as a substring: a counter's _total, a histogram's _bucket)
    missing = [n for n in (*VLLM_TEST_SERIES, *VLLM_DASHBOARD_SERIES)
               if not any(x == n or x.startswith(n + "_") for x in names)]
    assert not missing, missing
    for f in fams.values():
        if not f.name.startswith("vllm:"):
            continue
        for s in f.samples:
            want = {"engine": "0"} if f.name == "vllm:cache_config_info" else {
                "engine": "0", "model_name": model}
            assert {k: s.labels.get(k) for k in want} == want, s
            if f.name == "vllm:cache_config_info":
                assert "model_name" not in s.labels and "block_size" in s.labels
        bounds = VLLM_BOUNDS.get(f.name)
        if f.name in TOKEN_COUNT_FAMILIES:
            bounds = one_two_five(max_model_len)
        if f.type == "histogram":
            les = [s.labels["le"] for s in f.samples if s.name.endswith("_bucket")]
            assert bounds is not None, f.name
            assert [float(x) for x in les] == [*map(float, bounds), float("inf")], f.name


def check_equal_to_ours(text: str) -> None:
    """Every vLLM sample equals the enginecore sample it is renamed from."""
    ours = {s.name: f.name for f in text_string_to_metric_families(text) for s in f.samples}
    vals = values(text)
    checked = 0
    for our_family, aliases in ALIASES.items():
        for alias in aliases:
            renames = dict(alias.labels)
            for key, value in vals.items():
                name, _, labels = key.partition(",")
                if ours.get(name) != our_family or name.endswith("_created"):
                    continue
                pairs = dict(p.split("=", 1) for p in labels.split(",")) if labels else {}
                if "le" in pairs and alias.bounds is not None and float(pairs["le"]) not in {
                        *map(float, alias.bounds), float("inf")}:
                    continue
                pairs = {renames.get(k, k): v for k, v in pairs.items()}
                pairs["engine"] = "0"
                if alias.model_label:
                    pairs["model_name"] = MODEL
                vname = alias.name + name[len(our_family):]
                vkey = vname + "".join(f",{k}={v}" for k, v in sorted(pairs.items()))
                assert vals[vkey] == value, (vkey, vals[vkey], key, value)
                checked += 1
    assert checked > 100


MODEL = TINY.model


@pytest.mark.asyncio
async def test_vllm_series_after_requests_as_vllm_counts_them():
    """vLLM's own count test (10 requests, token-id prompts, 10 tokens each), then more kinds of
    requests; every vLLM series present with its labels and bounds, equal to ours; the deploy
    dashboard's queries all served."""
    n_req, p_len, m_tok = 10, 9, 10
    prompt = list(range(5, 5 + p_len))
    async with served() as s:
        oc = s.openai()
        for _ in range(n_req):
            r = await oc.completions.create(model=MODEL, prompt=prompt, max_tokens=m_tok,
                                            extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == m_tok
        async with s.http() as c:
            text = (await c.get("/metrics")).text
        max_len = s.engine.max_model_len
        check_names_labels_buckets(text, MODEL, max_len)
        check_equal_to_ours(text)
        v = values(text)
        lab = ",engine=0,model_name=" + MODEL

        def get(name: str) -> float:
            return v[name + lab]

        for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                  "request_queue_time_seconds", "request_inference_time_seconds",
                  "request_prefill_time_seconds", "request_decode_time_seconds",
                  "request_params_n", "request_prompt_tokens", "request_generation_tokens"):
            assert get(f"vllm:{h}_count") == n_req, h
        assert get("vllm:time_per_output_token_seconds_count") == n_req * (m_tok - 1)
        assert get("vllm:inter_token_latency_seconds_count") == n_req * (m_tok - 1)
        assert get("vllm:request_prompt_tokens_sum") == n_req * p_len
        assert get("vllm:request_generation_tokens_sum") == n_req * m_tok
        assert get("vllm:request_params_max_tokens_sum") == n_req * m_tok
        assert get("vllm:iteration_tokens_total_sum") == n_req * (p_len + m_tok)
        assert get("vllm:iteration_tokens_total_count") == n_req * m_tok
        assert get("vllm:prompt_tokens_total") == n_req * p_len
        assert get("vllm:generation_tokens_total") == n_req * m_tok
        success = f"vllm:request_success_total,engine=0,finished_reason=length,model_name={MODEL}"
        assert v[success] == n_req
        # the prompt's one full block (16 tokens a block: none here) is all the cache can hold
        assert get("vllm:prefix_cache_queries_total") == n_req * p_len
        assert get("vllm:request_prefill_kv_computed_tokens_sum") == n_req * p_len
        assert v[f"vllm:engine_sleep_state,engine=0,model_name={MODEL},sleep_state=awake"] == 1
        assert get("vllm:num_requests_swapped") == 0
        # time to submit (API server) and arrival offset (engine): no vLLM name, one per request;
        # one request after the other: each reaches an idle engine, the start of a busy period
        assert v["enginecore_request_time_to_submit_seconds_count"] == n_req
        assert 0 < v["enginecore_request_time_to_submit_seconds_sum"] <= \
            v["enginecore_time_to_first_token_seconds_sum"]
        assert v["enginecore_request_arrival_offset_seconds_count"] == n_req
        assert v["enginecore_request_arrival_offset_seconds_sum"] == 0

        # n > 1 over two prompts, a chat stream, a stream left after 2 chunks (abort)
        r = await oc.completions.create(model=MODEL, prompt=["one two", "three four"], n=2,
                                        max_tokens=3, extra_body={"ignore_eos": True})
        assert len(r.choices) == 4
        stream = await oc.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
            extra_body={"ignore_eos": True})
        assert [c.choices[0].finish_reason async for c in stream if c.choices][-1] == "length"
        long = await oc.completions.create(model=MODEL, prompt="x", max_tokens=500, stream=True,
                                           extra_body={"ignore_eos": True})
        for _ in range(2):
            await long.__anext__()
        await long.close()
        async with s.http() as c:
            with anyio.fail_after(20):
                while True:
                    text = (await c.get("/metrics")).text
                    if f'finished_reason="abort",model_name="{MODEL}"}} 1.0' in text and \
                            "vllm:num_requests_running{" in text and re.search(
                                r"vllm:num_requests_running\{[^}]*\} 0\.0", text):
                        break
                    await anyio.sleep(0.05)
            ours = (await c.get("/metrics")).text
        await oc.close()
        check_names_labels_buckets(text, MODEL, max_len)
        check_equal_to_ours(ours)
        v = values(ours)
        assert get("vllm:request_params_n_count") == n_req + 2 + 1 + 1
        assert get("vllm:request_params_n_sum") == n_req + 4 + 1 + 1
        aborted = v["enginecore_request_generation_tokens_sum"] - (n_req * m_tok + 4 * 3 + 4)
        assert aborted >= 2  # the tokens the left stream got before it was left
        # per prompt, the most tokens one of its choices generated
        assert get("vllm:request_max_num_generation_tokens_sum") == (
            n_req * m_tok + 3 + 3 + 4 + aborted)
        assert get("vllm:generation_tokens_total") == v["enginecore_generation_tokens_total"] == \
            get("vllm:request_generation_tokens_sum")
        assert get("vllm:prompt_tokens_total") == get("vllm:request_prompt_tokens_sum")
        assert sum(val for k, val in v.items() if k.startswith("vllm:request_success_total,")) == \
            get("vllm:e2e_request_latency_seconds_count") == n_req + 4 + 1 + 1
        # the deploy dashboard: every metric its queries name is served (those of speculative
        # decoding with a speculator: test_speculative_counters_from_the_engine)
        queried = dashboard_queries()
        served_names = {k.split(",")[0] for k in v}
        missing = queried - served_names
        assert queried and missing == {m for m in queried if "spec_decode" in m}, sorted(missing)


def test_engine_figures_under_vllm_names_sleep_spec_and_buckets():
    """From a Health alone: sleep state, waiting by reason, speculative decoding by position,
    and an engine histogram's vLLM buckets read at vLLM's bounds from ours."""
    timings = EngineTimings(2048)
    for q in (0.002, 0.2, 0.4, 0.9, 3.0, 9000.0):
        timings.queue_time.observe(q)
    m = Metrics(SimpleNamespace(max_model_len=2048, model="x"), {"block_size": "16"}, "served")
    m.set_health(Health(state=State.SLEEPING, live=True, ready=False, waiting=3, sleep_level=2,
                        spec_drafts=10, spec_draft_tokens=30, spec_accepted_tokens=12,
                        spec_accepted_per_pos=[7, 4, 1], **timings.figures()))
    v = values(m.render()[0].decode())
    lab = "engine=0,model_name=served"
    assert v[f"vllm:engine_sleep_state,{lab},sleep_state=awake"] == 0
    assert v[f"vllm:engine_sleep_state,{lab},sleep_state=discard_all"] == 1
    assert v[f"vllm:engine_sleep_state,{lab},sleep_state=weights_offloaded"] == 0
    assert v[f"vllm:num_requests_waiting_by_reason,{lab},reason=capacity"] == 3
    assert v[f"vllm:num_requests_waiting_by_reason,{lab},reason=deferred"] == 0
    assert v[f"vllm:spec_decode_num_drafts_total,{lab}"] == 10
    assert v[f"vllm:spec_decode_num_draft_tokens_total,{lab}"] == 30
    assert v[f"vllm:spec_decode_num_accepted_tokens_total,{lab}"] == 12
    assert [v[f"vllm:spec_decode_num_accepted_tokens_per_pos_total,{lab},position={i}"]
            for i in range(3)] == [7, 4, 1]
    buckets = {float(k.split("le=")[1].split(",")[0]): val for k, val in v.items()
               if k.startswith("vllm:request_queue_time_seconds_bucket")}
    assert buckets[0.3] == 2 and buckets[0.5] == 3 and buckets[1.0] == 4 and buckets[5.0] == 5
    assert buckets[7680.0] == 5 and buckets[float("inf")] == 6
    assert v[f"vllm:request_queue_time_seconds_count,{lab}"] == 6
    # no speculator: no spec series; awake
    m2 = Metrics(SimpleNamespace(max_model_len=2048, model="x"), {}, "served")
    m2.set_health(Health(state=State.SERVING, live=True, ready=True))
    text = m2.render()[0].decode()
    assert "spec_decode" not in text
    assert values(text)[f"vllm:engine_sleep_state,{lab},sleep_state=awake"] == 1


def test_request_phases_in_the_engine():
    """A request's prefill is first scheduled -> first token, decode first token -> end; one that
    never produced a token has only its running time."""
    t = EngineTimings(100)
    req = SimpleNamespace(first_scheduled=None, first_token_time=None, num_prompt_tokens=20,
                          num_cached_tokens=16)
    t.finished(req)  # never scheduled: nothing
    assert t.inference_time.snapshot().count == 0
    import time as _time
    now = _time.monotonic()
    req.first_scheduled, req.first_token_time = now - 3.0, now - 1.0
    t.finished(req)
    assert t.prefill_time.sum == pytest.approx(2.0, abs=0.05)
    assert t.decode_time.sum == pytest.approx(1.0, abs=0.05)
    assert t.inference_time.sum == pytest.approx(3.0, abs=0.05)
    assert t.prefill_token_time.sum == pytest.approx(0.1, abs=0.005)
    assert t.prefill_computed.sum == 4
    req.first_token_time = None
    t.finished(req)
    assert t.inference_time.snapshot().count == 2 and t.prefill_time.snapshot().count == 1
    # arrivals: each after the start of its busy period (an arrival at an idle core)
    for at, idle in ((100.0, True), (100.125, False), (100.5, False), (200.0, True),
                     (200.03125, False)):  # (binary fractions: exact differences)
        t.arrived(at, idle)
    offsets = t.arrival_offset.snapshot()
    assert offsets.count == 5 and offsets.sum == 0.125 + 0.5 + 0.03125
    bounds = offsets.bounds
    assert offsets.counts[0] == 2  # the two starts: 0
    assert [bounds[i] for i, c in enumerate(offsets.counts) if c and i] == [0.05, 0.15, 0.5]
    t.end_iteration(0)
    assert t.iteration_tokens.snapshot().count == 0  # a step without outputs is not a step here
    t.iter_tokens = 20  # a prompt whose first token came in this step
    t.end_iteration(1)
    t.end_iteration(1)
    t.end_iteration(4)
    assert t.iteration_tokens.snapshot().counts[:3] == (0, 1, 0)  # 3 tokens: le 8
    assert t.iteration_tokens.sum == 24 and t.iteration_tokens.snapshot().count == 2


@pytest.mark.asyncio
async def test_speculative_counters_from_the_engine():
    """n-gram speculation on a repetitive prompt: drafts, draft tokens, accepted ones and the
    accepted count by position, as the engine verified them."""
    cfg = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=256,
                       speculator="ngram", num_speculative_tokens=3)
    async with AsyncEngine.open(cfg) as eng:
        prompt = [7, 8, 9, 10] * 12
        async for _ in eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True)):
            pass
        h = eng.health_nowait()
        m = Metrics(eng, None, "spec")
        m.set_health(h)
        v = values(m.render()[0].decode())
        spec = eng.core.spec_stats
    lab = "engine=0,model_name=spec"
    per_pos = [v[f"vllm:spec_decode_num_accepted_tokens_per_pos_total,{lab},position={i}"]
               for i in range(3)]
    assert v[f"vllm:spec_decode_num_drafts_total,{lab}"] == spec.verifications > 0
    assert v[f"vllm:spec_decode_num_draft_tokens_total,{lab}"] == spec.proposed
    assert v[f"vllm:spec_decode_num_accepted_tokens_total,{lab}"] == spec.accepted == sum(per_pos)
    assert spec.verifications >= per_pos[0] >= per_pos[1] >= per_pos[2]
    assert v["enginecore_spec_decode_accepted_tokens_total"] == spec.accepted
    spec_queries = {m for m in dashboard_queries() if "spec_decode" in m}
    assert spec_queries and spec_queries <= {k.split(",")[0] for k in v}

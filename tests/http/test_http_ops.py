"""Operating ``enginecore serve --http``: /metrics as one view over every API server
process, the Grafana dashboard's queries against it, served model names, and the logs (INFO by
default, one line per transition, JSON lines)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import anyio
import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from http_helpers import ServeProcess
from test_vllm_names import check_names_labels_buckets

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]
MODEL = "random:tiny-llama"
ROOT = Path(__file__).resolve().parents[2]
TRANSITIONS = ("init -> loaded", "loaded -> serving", "serving -> draining", "draining -> shutdown")


def scrape(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def total(m: dict, name: str) -> float:
    return sum(v for k, v in m.items() if k == name or k.startswith(name + ","))


def dashboard_metrics() -> set[str]:
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    return {m for e in exprs for m in re.findall(r"\b(?:enginecore_|vllm:)[a-z0-9_:]+", e)}


def per_process_requests(metrics_dir: str) -> dict[int, float]:
    """``enginecore_requests_total`` of each frontend process, from its own file in the shared
    multiprocess directory (read alone: a copy in a directory of its own)."""
    out = {}
    for f in Path(metrics_dir).glob("counter_*.db"):
        with tempfile.TemporaryDirectory() as d:
            shutil.copy(f, d)
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=d)
            value = sum(s.value for fam in registry.collect() for s in fam.samples
                        if s.name == "enginecore_requests_total")
        if value:
            out[int(f.stem.rpartition("_")[2])] = value
    return out


async def scrape_fresh(base_url: str) -> dict:
    """One scrape over a new connection (the kernel picks the answering frontend)."""
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(base_url + "/metrics")
    assert r.status_code == 200
    return scrape(r.text)


async def test_two_api_servers_one_metrics_view_dashboard_names_and_logs():
    sp = ServeProcess(MODEL, api_servers=2, capture_stderr=True,
                      extra=("--served-model-name", "tiny", "tiny-alias",
                             "--log-stats-interval", "0.5"))
    try:
        await sp.wait_ready(2)
        async with sp.http() as c:
            models = (await c.get("/v1/models")).json()
            max_model_len = models["data"][0]["max_model_len"]
            assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
            r = await c.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

        metrics_dir = re.search(r"metrics in (\S+?)\)", sp.log).group(1)
        n, done, totals = 0, [], []
        before = await scrape_fresh(sp.base_url)
        assert total(before, "enginecore_requests_total") == 0
        # rounds of concurrent requests (new connections each round, so the kernel spreads them
        # over both processes), under every accepted name; a scraper runs meanwhile, and 4
        # scrapes follow each round: until both processes served some (3 rounds at least)
        for round_ in range(12):
            if round_ >= 3 and len(per_process_requests(metrics_dir)) == 2:
                break
            oc = sp.openai()
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                async def scraper() -> None:
                    while not stop.is_set():
                        totals.append(total(await scrape_fresh(sp.base_url),
                                            "enginecore_requests_total"))

                tg.start_soon(scraper)
                async with anyio.create_task_group() as reqs:
                    for i, name in enumerate(("tiny", "tiny-alias", "default", MODEL)):
                        async def one(name=name, i=i) -> None:
                            r = await oc.completions.create(
                                model=name, prompt=f"req {round_} {i}", max_tokens=4,
                                extra_body={"ignore_eos": True})
                            assert r.model == "tiny" and r.usage.completion_tokens == 4
                            done.append(r)

                        reqs.start_soon(one)
                        n += 1
                stop.set()
            await oc.close()
            for _ in range(4):  # every process answers with every request so far
                totals.append(total(await scrape_fresh(sp.base_url), "enginecore_requests_total"))
                assert totals[-1] == n
        assert len(done) == n >= 12
        assert totals == sorted(totals) and max(totals) == n  # monotonic, whoever answered
        by_pid = per_process_requests(metrics_dir)
        assert len(by_pid) == 2 and all(by_pid.values()) and sum(by_pid.values()) == n, by_pid

        scrapes = [await scrape_fresh(sp.base_url) for _ in range(6)]
        last = scrapes[-1]
        async with httpx.AsyncClient(timeout=30) as c:
            last_text = (await c.get(sp.base_url + "/metrics")).text
        for m in scrapes:
            assert m["enginecore_requests_total,finish_reason=length"] == n
            assert m["enginecore_e2e_request_latency_seconds_count"] == n
            assert m["enginecore_time_to_first_token_seconds_count"] == n
            assert m["enginecore_inter_token_latency_seconds_count"] == n * 3
            assert m["enginecore_generation_tokens_total"] == n * 4
            assert m["enginecore_request_queue_time_seconds_count"] == n  # the engine's own
            assert m["enginecore_step_time_seconds_count"] == m["enginecore_engine_steps_total"] > 0
            assert m["enginecore_frontend_requests_in_flight"] == 0
            assert m["enginecore_engine_state,state=serving"] == 1
            # vLLM's names: the same figures, labelled with the served name
            v = {k.replace(",engine=0", "").replace(",model_name=tiny", ""): x
                 for k, x in m.items() if k.startswith("vllm:")}
            assert v["vllm:request_success_total,finished_reason=length"] == n
            assert v["vllm:generation_tokens_total"] == m["enginecore_generation_tokens_total"]
            assert v["vllm:request_generation_tokens_sum"] == n * 4
            assert v["vllm:prompt_tokens_total"] == v["vllm:request_prompt_tokens_sum"] == \
                m["enginecore_prompt_tokens_total"]
            for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_inference_time_seconds",
                      "request_params_n", "request_params_max_tokens"):
                assert v[f"vllm:{h}_count"] == n, h
            assert v["vllm:inter_token_latency_seconds_count"] == n * 3
            assert v["vllm:iteration_tokens_total_sum"] == m["enginecore_iteration_tokens_sum"] \
                == m["enginecore_prompt_tokens_total"] + n * 4
            assert v["vllm:num_requests_running"] == 0 and v["vllm:num_requests_swapped"] == 0
        assert last["enginecore_step_time_seconds_bucket,le=+Inf"] == last["enginecore_engine_steps_total"]
        check_names_labels_buckets(last_text, "tiny", max_model_len)
        info = [k for k in last if k.startswith("enginecore_cache_config_info,")]
        assert len(info) == 1 and "block_size=16" in info[0] and "num_gpu_blocks=" in info[0]

        # every metric the Grafana dashboard queries is in the output
        names = {k.split(",")[0] for k in last}
        # sample names: *_bucket, *_count, *_total ... (speculative decoding's: only with a
        # speculator, tests/http/test_vllm_names.py)
        missing = {m for m in dashboard_metrics() - names if "spec_decode" not in m}
        assert not missing, f"dashboard queries metrics /metrics lacks: {sorted(missing)}"

        await anyio.sleep(0.6)  # one stats line with traffic in it
        sp.signal_group(signal.SIGTERM)
        assert await sp.wait(60) == 0
        log = sp.log
    finally:
        sp.cleanup()
    # INFO by default: one line per transition, with the time and what was in flight
    for t in TRANSITIONS:
        assert re.search(rf" INFO enginecore\.states: engine: {t} after [\d,]+\.\d{{3}} s; "
                         rf"\d+ running, \d+ waiting", log), (t, log)
    assert "INFO enginecore.serve: signal SIGTERM in state serving" in log
    assert re.search(r"INFO enginecore\.stats: prompt [\d.,]+ tok/s, generation [\d.,]+ tok/s", log)
    assert re.search(r"loading weights onto cpu: done, \d+/\d+ tensors", log)
    assert re.search(r"released kv_cache: [\d.,]+ MiB on cpu", log)
    assert "WARNING" not in log and "ERROR" not in log, log
    assert not os.path.exists(metrics_dir)  # removed at exit


async def test_json_log_lines():
    sp = ServeProcess(MODEL, api_servers=1, capture_stderr=True,
                      extra=("--log-format", "json", "--disable-log-stats"))
    try:
        await sp.wait_ready(1)
        async with sp.http() as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
        sp.signal_group(signal.SIGTERM)
        assert await sp.wait(60) == 0
        log = sp.log
    finally:
        sp.cleanup()
    records = [json.loads(line) for line in log.splitlines() if line.strip()]
    assert records and all({"timestamp", "level", "logger", "message"} <= r.keys() for r in records)
    moves = [(r["previous"], r["state"]) for r in records if r["logger"] == "enginecore.states"]
    assert moves == [tuple(t.split(" -> ")) for t in TRANSITIONS]
    drain = next(r for r in records if r.get("state") == "draining")
    assert drain["level"] == "info" and drain["running"] == 0 and drain["after_s"] > 0
    assert not any(r["logger"] == "enginecore.stats" for r in records)  # --disable-log-stats

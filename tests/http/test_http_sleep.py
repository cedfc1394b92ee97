"""Sleep mode over HTTP: the admin endpoints (absent unless enabled, bounded,
token-guarded when asked), 503 + Retry-After and /health while asleep, weight updates that
equal a fresh engine, refused checkpoints that change nothing, and ``enginecore serve
--enable-sleep-mode`` through a frontend process (SIGTERM while asleep: exit 0)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import anyio
import pytest

from http_helpers import ROOT, TINY, ServeProcess, served
from states import State

BODY = {"model": TINY.model, "prompt": [1, 2, 3], "max_tokens": 4}
JSON = {"Content-Type": "application/json"}


@pytest.mark.asyncio
async def test_endpoints_are_absent_unless_enabled() -> None:
    async with served() as s, s.http() as c:
        for path in ("/sleep", "/wake_up", "/update_weights"):
            assert (await c.post(path, json={})).status_code == 404
        assert (await c.get("/is_sleeping")).status_code == 404


@pytest.mark.parametrize("via", ["engine", "client"])
@pytest.mark.asyncio
async def test_asleep_requests_get_503_retry_after_and_health_says_sleeping(via) -> None:
    async with served(via=via, sleep_mode=True) as s, s.http() as c:
        assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        r = await c.post("/wake_up", json={})  # not asleep: not possible in this state
        assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_state"
        r = await c.post("/sleep", json={"level": 2})
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "ok", "state": "sleeping", "is_sleeping": True,
                            "is_paused": False}
        assert s.engine.state is State.SLEEPING
        assert (await c.get("/is_sleeping")).json() == {"is_sleeping": True}
        for path, body in (("/v1/completions", BODY),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2})):
            r = await c.post(path, json=body)
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
            assert r.json()["error"]["code"] == "engine_sleeping"
            assert r.json()["error"]["type"] == "service_unavailable"
        h = await c.get("/health")
        assert h.status_code == 200
        assert {k: h.json()[k] for k in ("state", "live", "ready")} == {
            "state": "sleeping", "live": True, "ready": False}
        assert (await c.get("/ready")).status_code == 503
        metrics = (await c.get("/metrics")).text
        assert 'enginecore_requests_rejected_total{reason="sleeping"} 2.0' in metrics
        assert 'enginecore_engine_state{state="sleeping"} 1.0' in metrics
        assert "enginecore_engine_sleep_level 2.0" in metrics
        for state, value in (("awake", 0), ("weights_offloaded", 0), ("discard_all", 1)):
            assert re.search(rf'vllm:engine_sleep_state{{[^}}]*sleep_state="{state}"}} {value}\.0',
                             metrics), state
        r = await c.post("/sleep", json={})  # already asleep
        assert r.status_code == 409 and "SLEEPING" in r.json()["error"]["message"]
        r = await c.post("/wake_up", json={"tags": ["weights"]})
        assert r.status_code == 200 and r.json()["state"] == "sleeping"  # half awake
        r = await c.post("/wake_up", json={"tags": ["kv_cache"]})
        assert r.status_code == 200 and r.json()["state"] == "serving"
        assert (await c.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert (await c.post("/v1/completions", json=BODY)).status_code == 200
        assert (await c.get("/health")).json()["ready"] is True
        metrics = (await c.get("/metrics")).text
        assert re.search(r'vllm:engine_sleep_state{[^}]*sleep_state="awake"} 1\.0', metrics)


BAD_SLEEPS = [  # query parameters: none is taken, not even a valid one
    ("query", "level=2"), ("query", "level=7"), ("query", "mode=wait"), ("query", "timeout=nan"),
    ("query", "=2"), ("query", "x"), ("json", {"level": "2"}),
    ("json", {"level": True}), ("json", {"level": 3}), ("json", {"timeout": 2e9}),
    ("json", {"levle": 2}), ("content", b"[1]"), ("content", b"{"), ("content", b"[" * 100_000),
]


@pytest.mark.asyncio
async def test_bad_sleep_parameters_are_400_and_change_nothing() -> None:
    async with served(sleep_mode=True) as s, s.http() as c:
        for how, data in BAD_SLEEPS:
            if how == "query":
                r = await c.post(f"/sleep?{data}", json={})
            elif how == "json":
                r = await c.post("/sleep", json=data)
            else:
                r = await c.post("/sleep", content=data, headers=JSON)
            assert r.status_code == 400, (data, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert s.engine.state is State.SERVING
        assert (await c.post("/v1/completions", json=BODY)).status_code == 200


@pytest.mark.asyncio
async def test_bad_wake_and_update_parameters_are_400() -> None:
    async with served(sleep_mode=True) as s, s.http() as c:
        r = await c.post("/sleep", json={"level": 1, "mode": "wait", "timeout": 5})
        assert r.status_code == 200, r.text
        for body in ({"tags": ["gpu"]}, {"tags": []}, {"tags": "weights"},
                     {"tags": ["weights", "kv_cache", "weights"]}, {"tags": [1]}):
            r = await c.post("/wake_up", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"].startswith("tags"), (body, r.text)
        r = await c.post("/wake_up?tags=weights", json={})  # a query parameter: refused
        assert r.status_code == 400 and r.json()["error"]["param"] == "tags", r.text
        for body in ({}, {"path": ""}, {"path": 5}, {"path": "x" * 4097}, {"path": "/a\x00b"}):
            r = await c.post("/update_weights", json=body)
            assert r.status_code == 400, (body, r.text)
        r = await c.post("/update_weights", content=b'{"path": "/ckpt/\\ud800"}', headers=JSON)  # a lone surrogate
        assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
        r = await c.post("/update_weights", json={"path": "random:tiny-llama"})
        assert r.status_code == 400 and "random presets" in r.json()["error"]["message"]
        r = await c.post("/update_weights", json={"path": "/nonexistent/ckpt"})
        assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
        r = await c.post("/update_weights", json={"path": "/" + "x" * 300})  # a name too long
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_checkpoint", r.text
        assert s.engine.state is State.SLEEPING
        assert (await c.post("/wake_up", json={"tags": ["weights", "kv_cache"]})).json()["state"] == "serving"


@pytest.mark.asyncio
async def test_update_weights_over_http_equals_a_fresh_engine(hf_checkpoint) -> None:
    from engine import EngineConfig

    a, _ = hf_checkpoint("sleep-a", seed=0)
    b, _ = hf_checkpoint("sleep-b", seed=1)
    wide, _ = hf_checkpoint("sleep-wide", seed=1, intermediate_size=96)
    prompts = [[5, 9, 13, 2, 7], list(range(20, 50))]

    async def texts(c) -> list[str]:
        out = []
        for p in prompts:
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 10,
                                                      "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
        return out

    def cfg(path) -> EngineConfig:
        return EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, max_num_seqs=8)

    async with served(cfg(b)) as s, s.http() as c:
        want = await texts(c)
    async with served(cfg(a), via="client", sleep_mode=True) as s, s.http() as c:
        old = await texts(c)
        assert old != want
        r = await c.post("/update_weights", json={"path": str(b)})
        assert r.status_code == 409  # only while asleep
        assert (await c.post("/sleep", json={})).status_code == 200
        r = await c.post("/update_weights", json={"path": str(wide)})
        assert r.status_code == 400 and "intermediate_size" in r.json()["error"]["message"]
        assert (await c.post("/wake_up", json={})).status_code == 200
        assert await texts(c) == old  # refused: the old weights serve
        for level in (1, 2):
            assert (await c.post("/sleep", json={"level": level})).status_code == 200
            r = await c.post("/update_weights", json={"path": str(b)})
            assert r.status_code == 200 and r.json()["state"] == "sleeping", r.text
            assert (await c.post("/wake_up", json={})).status_code == 200
            assert await texts(c) == want, level


@pytest.mark.asyncio
async def test_sleep_during_http_streams_each_ends_once() -> None:
    async with served(sleep_mode=True) as s, s.http() as c:
        finishes: list[list] = [[] for _ in range(8)]
        started = anyio.Event()

        async def stream(i: int) -> None:
            body = {"prompt": [1 + i, 2, 3], "max_tokens": s.engine.max_model_len - 3,
                    "stream": True, "ignore_eos": True}  # (the whole context: runs until slept)
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        reason = json.loads(line[6:])["choices"][0]["finish_reason"]
                        if reason is not None:
                            finishes[i].append(reason)
                        if chunks == 3 and all(finishes[j] == [] for j in range(8)):
                            started.set()
                    elif line == "data: [DONE]":
                        finishes[i].append("[DONE]")

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(stream, i)
                await started.wait()
                await anyio.sleep(0.2)
                assert (await c.post("/sleep", json={"mode": "abort"})).status_code == 200
        assert finishes == [["abort", "[DONE]"]] * 8


@pytest.mark.asyncio
async def test_admin_token_required_when_set() -> None:
    async with served(sleep_mode=True, admin_token="s3cret") as s, s.http() as c:
        r = await c.post("/sleep", json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert (await c.get("/is_sleeping")).status_code == 401
        for bad in ("Bearer wrong", "Basic s3cret", "s3cret", "Bearer s3cret2"):
            assert (await c.post("/sleep", json={}, headers={"Authorization": bad})).status_code == 401
        assert s.engine.state is State.SERVING
        good = {"Authorization": "Bearer s3cret"}
        assert (await c.post("/sleep", json={}, headers=good)).status_code == 200
        assert (await c.get("/is_sleeping", headers=good)).json() == {"is_sleeping": True}
        assert (await c.post("/wake_up", json={}, headers=good)).status_code == 200
        assert (await c.post("/v1/completions", json=BODY)).status_code == 200  # not guarded


def test_non_loopback_http_with_sleep_mode_needs_a_token() -> None:
    p = subprocess.run([sys.executable, "-m", "entrypoints.cli", "serve", "--model", TINY.model,
                        "--device", "cpu", "--http", "0.0.0.0:0", "--enable-sleep-mode"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "ENGINECORE_TOKEN"})
    assert p.returncode == 2 and "needs a token" in p.stderr, p.stderr


@pytest.mark.slow
@pytest.mark.asyncio
async def test_serve_enable_sleep_mode_through_a_frontend_process() -> None:
    origin = "http://localhost:3000"
    sp = ServeProcess(extra=("--enable-sleep-mode", "--token", "s3cret",
                             "--allowed-origins", f'["{origin}"]'))
    try:
        await sp.wait_ready(1)
        async with sp.http() as c:
            assert (await c.post("/sleep", json={})).status_code == 401  # the server has a token
            r = await c.post("/sleep", content=b'{"level": 2}', headers={
                "Authorization": "Bearer s3cret", "Content-Type": "text/plain"})
            assert r.status_code == 415 and (await c.get("/is_sleeping", headers={
                "Authorization": "Bearer s3cret"})).json() == {"is_sleeping": False}
            for who, granted in ((origin, True), ("https://evil.example", False)):
                r = await c.options("/sleep", headers={
                    "Origin": who, "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization,content-type"})
                assert (r.headers.get("access-control-allow-origin") == who) is granted, r.headers
            c.headers["Authorization"] = "Bearer s3cret"
            r = await c.post("/sleep", json={"level": 1, "mode": "wait"})
            assert r.status_code == 200 and r.json()["is_sleeping"] is True, r.text
            r = await c.post("/v1/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
            assert int(r.headers["Retry-After"]) >= 1
            h = (await c.get("/health")).json()
            assert (h["state"], h["live"], h["ready"]) == ("sleeping", True, False)
            assert (await c.post("/wake_up", json={})).status_code == 200
            assert (await c.post("/v1/completions", json=BODY)).status_code == 200
            assert (await c.post("/sleep", json={"level": 2})).status_code == 200
        sp.signal_group(signal.SIGTERM)  # Kubernetes' stop while asleep: a clean exit
        assert await sp.wait(60) == 0
    finally:
        sp.cleanup()

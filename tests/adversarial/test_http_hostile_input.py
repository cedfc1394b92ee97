"""Hostile request bodies against the HTTP frontend (findings 1, 6, 9): every bad value
gets a typed, OpenAI-shaped 4xx before the engine sees it, and the engine serves on. In process,
over an AsyncEngine and (``via="client"``) over an EngineClient as a frontend process runs it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))
from http_helpers import TINY, served  # noqa: E402

from engine.errors import EngineOverloadedError  # noqa: E402
from states import State  # noqa: E402

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("torch_one_thread")]
MODEL = TINY.model


def assert_openai_error(r: httpx.Response, status: int, param=None, type_=None, code=None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if type_ is not None:
        assert err["type"] == type_, err
    if code is not None:
        assert err["code"] == code, err
    return err


async def ok_completion(c: httpx.AsyncClient) -> None:
    r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


# Finding 1: numbers no schema bounded (top_k 2**63 killed the engine), stop lists, stop ids.
HOSTILE = [
    ("top_k", 2**63), ("top_k", 2**31), ("top_k", -2), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("max_tokens", 2**63), ("max_tokens", -(2**63)), ("min_tokens", 2**63), ("min_tokens", -1),
    ("n", 2**63), ("temperature", 1e308), ("temperature", -0.5), ("top_p", 0), ("top_p", 1.5),
    ("logprobs", 2**63), ("best_of", 2**40), ("presence_penalty", 1e9),
    ("stop", ["x"] * 17), ("stop", "s" * 513), ("stop", [""]), ("stop", ["ok", "s" * 10_000]),
    ("stop_token_ids", [2**31]), ("stop_token_ids", [-1]), ("stop_token_ids", [1] * 1025),
    ("stop_token_ids", [2**63]), ("stop_token_ids", list(range(200_000))),  # refused from its size
    ("bad_words", ["ab"] * 100_000),
]


@pytest.mark.parametrize("via", ["engine", "client"])
async def test_finding1_huge_numbers_and_lists_get_400_and_the_engine_serves_on(via):
    async with served(via=via) as s, s.http() as c:
        for field, value in HOSTILE:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
            r = await c.post("/v1/completions", json=body)
            err = assert_openai_error(r, 400, type_="invalid_request_error")
            assert err["param"].split(".")[0] == field, (field, err)
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value}
            if field not in ("logprobs", "best_of"):  # completion-only fields
                r = await c.post("/v1/chat/completions", json=chat)
                assert assert_openai_error(r, 400)["param"].split(".")[0] == field
        assert s.engine.state is State.SERVING
        await ok_completion(c)
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 2**40]})
        assert assert_openai_error(r, 400)["param"].startswith("prompt")
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}] * 5000})
        assert assert_openai_error(r, 400)["param"] == "messages"
        assert s.engine.state is State.SERVING


# Finding 9: lax types. true is not 1, "5" is not 5, "yes" is not true.
LAX = [
    ("max_tokens", True), ("max_tokens", "5"), ("max_tokens", 5.0), ("stream", "yes"),
    ("stream", 1), ("ignore_eos", "true"), ("echo", 0), ("temperature", True),
    ("temperature", "0.5"), ("top_k", 2.5), ("seed", "1"), ("n", True),
    ("stop_token_ids", [True]), ("stream_options", {"include_usage": "yes"}), ("prompt", 7),
    ("prompt", [1.5]), ("prompt", None), ("model", 3),
]


async def test_finding9_strict_types():
    async with served() as s, s.http() as c:
        for field, value in LAX:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value})
            err = assert_openai_error(r, 400, type_="invalid_request_error")
            assert err["param"].split(".")[0] == field, (field, err)
        # numbers accept integers; booleans accept booleans
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 1,
                                                 "top_p": 1, "stream": False, "ignore_eos": True})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
        assert assert_openai_error(r, 400)["param"].startswith("messages.[0].content")


async def test_finding9_every_status_is_openai_shaped(monkeypatch):
    async with served() as s, s.http() as c:
        r = await c.get("/v1/nothing-here")
        assert_openai_error(r, 404, code="not_found")
        r = await c.get("/v1/completions")
        assert_openai_error(r, 405, code="method_not_allowed")
        assert "POST" in r.headers["allow"]
        r = await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert_openai_error(r, 400, type_="invalid_request_error")
        r = await c.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
        assert_openai_error(r, 400)
        r = await c.post("/v1/completions", json={"max_tokens": 2})  # FastAPI would say 422
        assert_openai_error(r, 400, param="prompt")
        r = await c.post("/v1/completions", json={"model": "gpt-nope", "prompt": "x"})
        assert_openai_error(r, 404, param="model", code="model_not_found")
        r = await c.post("/v1/completions", content=b"x" * (8 * 2**20 + 1), headers={"content-type": "application/json"})
        assert_openai_error(r, 413, code="request_too_large")
        r = await c.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
        assert_openai_error(r, 415, code="unsupported_media_type")

        def overloaded(*args, **kw):
            raise EngineOverloadedError("engine is overloaded; retry later", retry_after=2.5)

        monkeypatch.setattr(s.engine, "generate", overloaded)  # the engine's admission limits
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert_openai_error(r, 429, type_="rate_limit_error", code="engine_overloaded")
        assert r.headers["retry-after"] == "3"
        monkeypatch.undo()
        await ok_completion(c)


# Finding 6: a 4M-character prompt was tokenized on the event loop (5.7 s stalls, /health 503).
BIG = 4_000_000


@pytest.mark.alone  # asserts wall-clock bounds
async def test_finding6_giant_prompts_are_refused_fast_and_health_stays_200():
    async with served() as s, s.http() as c:
        completion = json.dumps({"model": MODEL, "prompt": "a" * BIG}).encode()
        chat = json.dumps({"messages": [{"role": "user", "content": "a" * (BIG // 4)}] * 4}).encode()
        t0 = time.monotonic()
        r = await c.post("/v1/completions", content=completion, headers={"content-type": "application/json"})
        assert_openai_error(r, 400, param="prompt", code="prompt_too_long")
        r = await c.post("/v1/chat/completions", content=chat, headers={"content-type": "application/json"})
        assert_openai_error(r, 400, param="messages", code="prompt_too_long")
        assert time.monotonic() - t0 < 3.0

        health: list[tuple[int, float]] = []
        stop = anyio.Event()

        async def probe() -> None:
            async with s.http() as h:
                while not stop.is_set():
                    t = time.monotonic()
                    r = await h.get("/health")
                    health.append((r.status_code, time.monotonic() - t))
                    await anyio.sleep(0.05)

        async def hostile(body: bytes, path: str) -> None:
            async with s.http() as h:
                r = await h.post(path, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400

        async with anyio.create_task_group() as tg:
            tg.start_soon(probe)
            async with anyio.create_task_group() as burst:
                for i in range(8):
                    burst.start_soon(hostile, chat if i % 2 else completion,
                                     "/v1/chat/completions" if i % 2 else "/v1/completions")
            await ok_completion(c)
            stop.set()
        assert health and all(code == 200 for code, _ in health), health
        assert max(t for _, t in health) < 2.0, health
        assert s.engine.state is State.SERVING


@pytest.mark.alone  # asserts wall-clock bounds
async def test_finding6_health_answers_from_the_last_known_state_when_the_probe_is_slow(monkeypatch):
    """A probe that does not answer in time is not death (it was 503 'dead' after 2 s)."""
    async with served() as s, s.http() as c:
        async def slow_health():
            await anyio.sleep(30)

        monkeypatch.setattr(s.engine, "health", slow_health)
        t0 = time.monotonic()
        r = await c.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "state": "serving",
                                                     "live": True, "ready": True,
                                                     "probe": "timeout"}
        assert time.monotonic() - t0 < 5.0
        monkeypatch.undo()
        r = await c.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "state": "serving",
                                                     "live": True, "ready": True}

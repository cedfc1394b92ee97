"""The OpenAI-compatible app on an in-process AsyncEngine, served by uvicorn on a loopback port
and called with the real ``openai`` client (and httpx for raw checks)."""

from __future__ import annotations

import anyio
from http_helpers import TINY, served
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families
import pytest

from engine import EngineConfig, SamplingParams

pytestmark = pytest.mark.asyncio
TINY_NAME = TINY.model


async def engine_run(engine, prompt, max_tokens: int, **kw):
    text, last = [], None
    async for out in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, **kw)):
        text.append(out.text)
        last = out
    return "".join(text), last


async def test_default_model_matches_the_engine():
    """Greedy completions and chat completions, plain and streamed, equal the engine's text."""
    async with served(EngineConfig(model="default")) as s:
        eng, oc = s.engine, s.openai()
        prompt = "The capital of France is"
        ref, ref_out = await engine_run(eng, prompt, 12)
        assert ref.strip()

        r = await oc.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
        assert r.object == "text_completion" and r.model == "SmolLM2-135M-Instruct" and r.id.startswith("cmpl-")
        assert r.choices[0].text == ref
        assert r.choices[0].finish_reason == ref_out.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            ref_out.num_prompt_tokens, 12, ref_out.num_prompt_tokens + 12)

        stream = await oc.completions.create(model="default", prompt=prompt, max_tokens=12,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12
        assert all(c.usage is None for c in chunks[:-1])

        # stop: a string that greedy decoding produces ends the text before it
        cut = ref.index(".") if "." in ref else None
        if cut is not None:
            r = await oc.completions.create(model="default", prompt=prompt, max_tokens=12,
                                            temperature=0, stop=["\n\n", "."])
            assert r.choices[0].text == ref[:cut] and r.choices[0].finish_reason == "stop"

        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat_ref, chat_out = await engine_run(eng, eng.tokenizer.apply_chat_template(messages), 8)
        r = await oc.chat.completions.create(model="default", messages=messages, max_tokens=8,
                                             temperature=0)
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == chat_ref
        assert r.choices[0].finish_reason == chat_out.finish_reason
        assert r.usage.prompt_tokens == chat_out.num_prompt_tokens
        assert r.usage.completion_tokens == chat_out.num_output_tokens

        stream = await oc.chat.completions.create(model="default", messages=messages,
                                                  max_tokens=8, temperature=0, stream=True)
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_ref
        assert chunks[-1].choices[0].finish_reason == chat_out.finish_reason
        assert all(c.object == "chat.completion.chunk" for c in chunks)

        # seeded sampling is reproducible
        texts = set()
        for _ in range(2):
            r = await oc.completions.create(model="default", prompt=prompt, max_tokens=4,
                                            temperature=1.0, top_p=0.9, seed=1234)
            texts.add(r.choices[0].text)
        assert len(texts) == 1
        await oc.close()


@pytest.mark.parametrize("via", ["engine", "client"])
async def test_invalid_requests_get_openai_errors(via):
    async with served(via=via) as s:
        oc = s.openai()
        models = await oc.models.list()
        assert [m.id for m in models.data] == [TINY_NAME]

        async def bad(status: int, param, **kw):
            exc_type = openai.NotFoundError if status == 404 else openai.BadRequestError
            with pytest.raises(exc_type) as info:
                await oc.completions.create(**{"model": TINY_NAME, "prompt": "hi", **kw})
            err = info.value.body
            assert info.value.status_code == status
            assert err["type"] == "invalid_request_error" and err["message"]
            assert err["param"] == param
            return err

        await bad(400, "temperature", temperature=3.0)
        await bad(400, "max_tokens", max_tokens=0)
        await bad(400, "logprobs", logprobs=21)  # past --max-logprobs (20)
        await bad(400, "logit_bias", logit_bias={"999999": 1})
        await bad(400, "stop_token_ids", extra_body={"stop_token_ids": [10**6]})
        assert (await bad(404, "model", model="gpt-nope"))["code"] == "model_not_found"
        err = await bad(400, None, prompt="x" * 3000)  # the engine's BadRequestError
        assert "context" in err["message"]

        with pytest.raises(openai.BadRequestError) as info:
            await oc.chat.completions.create(model=TINY_NAME, messages=[], max_tokens=2)
        assert info.value.body["param"] == "messages"
        with pytest.raises(openai.BadRequestError) as info:
            await oc.chat.completions.create(model=TINY_NAME, n=3, max_tokens=2, top_logprobs=2,
                                             messages=[{"role": "user", "content": "x"}])
        assert info.value.body["param"] == "top_logprobs"  # needs logprobs=true

        async with s.http() as c:
            r = await c.post("/v1/completions", content=b"{not json",
                             headers={"content-type": "application/json"})
            assert r.status_code == 400
            assert r.json()["error"]["type"] == "invalid_request_error"
            r = await c.post("/v1/completions", json={"prompt": 7})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            r = await c.post("/v1/chat/completions",
                             json={"messages": [{"role": "", "content": "x"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages.[0].role"
        await oc.close()
        assert s.engine.health_nowait().running == 0


async def wait_idle(engine, timeout: float = 20.0) -> None:
    with anyio.fail_after(timeout):
        while True:
            h = engine.health_nowait()
            if h.running == 0 and h.waiting == 0:
                return
            await anyio.sleep(0.02)


@pytest.mark.parametrize("via", ["engine", "client"])
async def test_client_disconnect_aborts_the_request(via):
    async with served(via=via) as s:
        body = {"model": TINY_NAME, "prompt": "hello", "max_tokens": 1800, "ignore_eos": True}
        async with s.http() as c:
            # streaming: leave after a few chunks
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n == 3:
                        break
            await wait_idle(s.engine)

            # not streaming: the client gives up while the engine generates
            async with anyio.create_task_group() as tg:
                async def post() -> None:
                    await c.post("/v1/completions", json=body)

                tg.start_soon(post)
                with anyio.fail_after(20):
                    while s.engine.health_nowait().running == 0:
                        await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
            await wait_idle(s.engine)
        m = s.frontend.metrics
        assert m.requests.labels("abort")._value.get() == 2
        assert m.in_flight._value.get() == 0


def scrape(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()))
            out[key] = sample.value
    return out


async def test_metrics_after_a_few_requests():
    async with served() as s:
        oc = s.openai()
        usage = []
        for i in range(3):
            r = await oc.completions.create(model=TINY_NAME, prompt=f"request {i}", max_tokens=5,
                                            extra_body={"ignore_eos": True})
            usage.append(r.usage)
        stream = await oc.chat.completions.create(
            model=TINY_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage.append([c async for c in stream][-1].usage)
        with pytest.raises(openai.BadRequestError):
            await oc.completions.create(model=TINY_NAME, prompt="x", n=2, best_of=1)
        async with s.http() as c:
            r = await c.get("/metrics")
        await oc.close()
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        m = scrape(r.text)
        gen = sum(u.completion_tokens for u in usage)
        assert gen == 19
        assert m["enginecore_requests_total,finish_reason=length"] == 4
        assert m["enginecore_requests_total,finish_reason=abort"] == 0
        assert m["enginecore_requests_rejected_total,reason=bad_request"] == 1
        assert m["enginecore_prompt_tokens_total"] == sum(u.prompt_tokens for u in usage)
        assert m["enginecore_generation_tokens_total"] == gen
        assert m["enginecore_time_to_first_token_seconds_count"] == 4
        assert 0 < m["enginecore_time_to_first_token_seconds_sum"] < 60
        assert m["enginecore_inter_token_latency_seconds_count"] == gen - 4
        assert m["enginecore_e2e_request_latency_seconds_count"] == 4
        assert m["enginecore_requests_running"] == 0 and m["enginecore_requests_waiting"] == 0
        assert 0 <= m["enginecore_kv_cache_usage_ratio"] <= 1
        assert m["enginecore_frontend_requests_in_flight"] == 0
        states = {k.split("=")[-1]: v for k, v in m.items() if k.startswith("enginecore_engine_state,")}
        assert states["serving"] == 1 and sum(states.values()) == 1


@pytest.mark.parametrize("via", ["engine", "client"])
async def test_drain_in_process(via):
    """While the engine drains: /ready 503, /health 200, new requests 503 + Retry-After; open
    streams end (here with "abort" at the drain deadline); then the server stops by itself."""
    async with served(via=via) as s:
        oc = s.openai()
        body = dict(model=TINY_NAME, prompt="hello", max_tokens=1800, stream=True,
                    extra_body={"ignore_eos": True})
        streams = [await oc.completions.create(**body) for _ in range(4)]
        firsts = [await st.__anext__() for st in streams]
        assert all(f.choices[0].finish_reason is None for f in firsts)
        results: list = []

        async def finish(st) -> None:
            reasons = [c.choices[0].finish_reason async for c in st]
            results.append(reasons[-1])

        async with anyio.create_task_group() as tg:
            for st in streams:
                tg.start_soon(finish, st)
            tg.start_soon(s.engine.drain, 1.5)
            async with s.http() as c:
                with anyio.fail_after(5):
                    while (await c.get("/ready")).status_code != 503:
                        await anyio.sleep(0.01)
                assert (await c.get("/health")).status_code == 200
                r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "engine_draining"
                r = await c.post("/v1/chat/completions",
                                 json={"messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 503 and "retry-after" in r.headers
        assert results == ["abort"] * 4
        await oc.close()
        with anyio.fail_after(10):  # the engine is SHUTDOWN: the server stops by itself
            while not s.frontend.state.value == "shutdown":
                await anyio.sleep(0.01)


@pytest.mark.parametrize("via", ["engine", "client"])
async def test_engine_failure_mid_stream(via, inject_fault):
    """The engine fails: the open stream ends with an error event, new requests and /health get
    503, and the server stops by itself (a frontend process then exits 3)."""
    inject_fault(6)
    async with served(TINY, via=via) as s:
        oc = s.openai()
        stream = await oc.completions.create(model=TINY_NAME, prompt="hi", max_tokens=100,
                                             stream=True, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError) as info:
            async for _ in stream:
                pass
        assert "dead" in str(info.value.message) or "fail" in str(info.value.message)
        async with s.http() as c:
            r = await c.get("/health")
            assert r.status_code == 503
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert (await c.get("/ready")).status_code == 503
        await oc.close()
        assert s.frontend.metrics.requests.labels("error")._value.get() == 1
        with anyio.fail_after(10):
            while s.frontend.dead is None:
                await anyio.sleep(0.01)

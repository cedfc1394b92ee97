"""``enginecore serve --http``: the engine process and its HTTP frontend processes (real
processes, the real ``openai`` client)."""

from __future__ import annotations

import ctypes
import os
import signal

import anyio
import httpx
import openai
import pytest

from engine import AsyncEngine, SamplingParams
from http_helpers import TINY, ServeProcess, alive, children, wait_gone

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]
MODEL = "random:tiny-llama"
PR_SET_CHILD_SUBREAPER = 36


async def stream_completion(oc: openai.AsyncOpenAI, i: int, max_tokens: int, started=None):
    """One streamed completion; returns (text, finish_reason, usage)."""
    stream = await oc.completions.create(model=MODEL, prompt=f"stream number {i}",
                                         max_tokens=max_tokens, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    text, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
            if started is not None:
                started.add(i)
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(text), finish, usage


async def test_two_api_servers_32_concurrent_streams():
    sp = ServeProcess(MODEL, api_servers=2)
    try:
        await sp.wait_ready(2)
        oc = sp.openai()
        results: dict = {}

        async def one(i: int) -> None:
            results[i] = await stream_completion(oc, i, 24)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(32):
                    tg.start_soon(one, i)
        assert len(results) == 32
        for text, finish, usage in results.values():
            assert finish == "length" and usage.completion_tokens == 24

        # greedy over the two processes and the IPC channel == the in-process engine
        r = await oc.completions.create(model=MODEL, prompt="hello there", max_tokens=16,
                                        temperature=0, extra_body={"ignore_eos": True})
        messages = [{"role": "user", "content": "hi"}]
        c = await oc.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})
        await oc.close()
        async with AsyncEngine.open(TINY) as eng:
            texts = []
            for prompt, n in (("hello there", 16), (eng.tokenizer.apply_chat_template(messages), 8)):
                texts.append("".join([o.text async for o in eng.generate(
                    prompt, SamplingParams(max_tokens=n, ignore_eos=True))]))
        assert r.choices[0].text == texts[0]
        assert c.choices[0].message.content == texts[1]

        # a client that leaves mid-stream: its request is aborted in the engine (over IPC)
        oc = sp.openai()
        stream = await oc.completions.create(model=MODEL, prompt="long", max_tokens=1800,
                                             stream=True, extra_body={"ignore_eos": True})
        await stream.__anext__()
        await stream.close()
        await oc.close()
        async with sp.http() as client:
            with anyio.fail_after(20):
                while "enginecore_requests_running 0.0" not in (await client.get("/metrics")).text:
                    await anyio.sleep(0.05)

        frontends = list(sp.frontends)
        sp.signal(signal.SIGTERM)
        assert await sp.wait(60) == 0
        assert wait_gone(frontends, 5) == []
    finally:
        sp.cleanup()


@pytest.mark.parametrize("to_group", [False, True], ids=["engine", "process-group"])
async def test_sigterm_drains_open_streams(to_group: bool):
    """SIGTERM to the engine process -- or to the whole process group, as Kubernetes does: the
    frontends ignore it and keep serving the drain."""
    sp = ServeProcess(MODEL, api_servers=2, drain_timeout=120)
    oc = None
    try:
        await sp.wait_ready(2)
        oc = sp.openai()
        started: set = set()
        results: dict = {}
        n_tokens = 900  # (300 drained in 0.8 s on a loaded 2-core box: before the checks below)

        async def one(i: int) -> None:
            results[i] = await stream_completion(oc, i, n_tokens, started)

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(one, i)
            with anyio.fail_after(60):
                while len(started) < 16:
                    await anyio.sleep(0.005)
            frontends = list(sp.frontends)
            if to_group:
                sp.signal_group(signal.SIGTERM)
            else:
                sp.signal(signal.SIGTERM)
            async with sp.http() as c:
                with anyio.fail_after(10):
                    while (await c.get("/ready")).status_code != 503:
                        await anyio.sleep(0.01)
                assert (await c.get("/health")).status_code == 200
                for _ in range(4):  # whichever frontend answers
                    r = await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                    assert r.status_code == 503, r.text
                    assert int(r.headers["retry-after"]) >= 1
                    assert r.json()["error"]["code"] == "engine_draining"
                with pytest.raises(openai.APIStatusError) as info:
                    await oc.chat.completions.create(model=MODEL, max_tokens=2,
                                                     messages=[{"role": "user", "content": "x"}])
                assert info.value.status_code == 503
                assert info.value.response.headers.get("retry-after")
            assert len(results) < 16, "the streams ended before the drain was checked"
        assert len(results) == 16
        for text, finish, usage in results.values():
            assert finish == "length" and usage.completion_tokens == n_tokens
        await oc.close()
        assert await sp.wait(60) == 0
        assert wait_gone(frontends, 5) == []
        assert children(sp.pid) == []
    finally:
        if oc is not None:  # (a failed check above leaves no socket open for the next test)
            await oc.close()
        sp.cleanup()


async def test_engine_killed_frontends_exit_nonzero():
    libc = ctypes.CDLL(None, use_errno=True)
    # Become the subreaper: the orphaned frontends are re-parented to us, so we can reap them
    # and read their exit codes.
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    sp = ServeProcess(MODEL, api_servers=2)
    try:
        await sp.wait_ready(2)
        frontends = list(sp.frontends)
        oc = sp.openai()
        stream = await oc.completions.create(model=MODEL, prompt="x", max_tokens=1800,
                                             stream=True, extra_body={"ignore_eos": True})
        await stream.__anext__()
        sp.signal(signal.SIGKILL)
        assert sp.proc.wait(10) == -signal.SIGKILL

        # the open stream ends with an error, not silently
        with pytest.raises((openai.APIError, httpx.TransportError)):
            with anyio.fail_after(10):
                async for _ in stream:
                    pass
        await oc.close()

        seen_503 = False
        async with sp.http() as c:
            with anyio.fail_after(10):
                while not seen_503:
                    try:
                        r = await c.get("/health")
                    except httpx.TransportError:
                        break  # every frontend is gone already
                    seen_503 = r.status_code == 503
                    if not seen_503:
                        assert r.status_code == 200
                        await anyio.sleep(0.01)
        assert seen_503, "/health never answered 503 after the engine died"

        codes = {}
        with anyio.fail_after(15):
            while len(codes) < len(frontends):
                for pid in frontends:
                    if pid not in codes:
                        got, status = os.waitpid(pid, os.WNOHANG)
                        if got == pid:
                            codes[pid] = os.waitstatus_to_exitcode(status)
                await anyio.sleep(0.02)
        assert set(codes.values()) == {3}, codes  # 3: the engine died
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        sp.cleanup()
        for pid in sp.frontends:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        assert not any(alive(p) for p in sp.frontends)


async def test_a_frontend_dying_stops_the_engine():
    """No half-served port: a frontend that dies while the engine serves makes the engine drain
    and exit 1; the other frontend exits with it."""
    sp = ServeProcess(MODEL, api_servers=2, drain_timeout=5)
    try:
        await sp.wait_ready(2)
        frontends = list(sp.frontends)
        os.kill(frontends[0], signal.SIGKILL)
        assert await sp.wait(60) == 1
        assert wait_gone(frontends, 5) == []
    finally:
        sp.cleanup()

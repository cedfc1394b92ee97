"""SIGTERM behaviour of a real ``enginecore serve`` process with IPC clients."""

from __future__ import annotations

import signal
import time

import anyio
import pytest
from serve_helpers import ServeProcess, pid_alive

from engine import AsyncEngine, EngineConfig, EngineDeadError, EngineDrainingError, SamplingParams
from states import State

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

TINY = EngineConfig(model="random:tiny-llama", max_model_len=2048)


def prompt(i: int) -> list[int]:
    return [(13 * i + 5 * j) % 250 + 1 for j in range(4 + i % 20)]


async def stream_all(client, p, params, sink: dict, key) -> None:
    toks, last = [], None
    async for out in client.generate(p, params):
        toks += out.token_ids
        last = out
    sink[key] = (toks, last)


async def start_streams(tg, client, n: int, params, results: dict) -> None:
    """Start ``n`` streams on ``client`` and return once the engine runs all of them."""
    for i in range(n):
        tg.start_soon(stream_all, client, prompt(i), params, results, i)
    with anyio.fail_after(30):
        while (await client.health()).running < n:
            await anyio.sleep(0.01)


async def wait_state(client, state: State, timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while client.state is not state:
            await anyio.sleep(0.01)


async def reference(params, prompts) -> list[list[int]]:
    out = []
    async with AsyncEngine.open(TINY) as eng:
        for p in prompts:
            toks = []
            async for o in eng.generate(p, params):
                toks += o.token_ids
            out.append(toks)
    return out


@pytest.mark.alone  # its refusals are bounded at 1 s each
async def test_drain_under_load(tmp_path, alone_from_here) -> None:
    with anyio.fail_after(150):  # a hang fails here, naming this test, not at the run's timeout
        await _drain_under_load(tmp_path, alone_from_here)


async def _drain_under_load(tmp_path, alone_from_here) -> None:
    from ipc import EngineClient

    params = SamplingParams(max_tokens=400, ignore_eos=True)
    prompts = [prompt(i) for i in range(24)]
    ref = await reference(params, prompts)
    sp = ServeProcess(tmp_path, TINY, drain_timeout=120)
    try:
        sp.wait_serving()
        # (the reference outputs and the server's start: beside other tests)
        await anyio.to_thread.run_sync(alone_from_here)
        results: dict = {}
        rejected: list = []
        async with EngineClient.connect(sp.address) as c1, EngineClient.connect(sp.address) as c2:
            async with anyio.create_task_group() as tg:
                for i, p in enumerate(prompts):
                    tg.start_soon(stream_all, (c1, c2)[i % 2], p, params, results, i)
                with anyio.fail_after(30):
                    while (await c1.health()).running < 24:
                        await anyio.sleep(0.01)
                sp.signal(signal.SIGTERM)
                await wait_state(c1, State.DRAINING)
                await wait_state(c2, State.DRAINING)
                for i in range(10):
                    with anyio.fail_after(1):
                        with pytest.raises(EngineDrainingError):
                            async for _ in (c1, c2)[i % 2].generate(prompt(100 + i), params):
                                pass
                    rejected.append(i)
        code = sp.wait(60)
    finally:
        sp.kill()
    assert len(rejected) == 10
    assert code == 0, sp.log
    assert sorted(results) == list(range(24))
    for i in range(24):
        toks, last = results[i]
        assert last.finish_reason == "length" and toks == ref[i]
    assert not sp.sock.exists()
    assert not pid_alive(sp.proc.pid)


@pytest.mark.alone  # asserts wall-clock bounds
async def test_drain_deadline_aborts_in_flight(tmp_path, alone_from_here) -> None:
    from ipc import EngineClient

    params = SamplingParams(max_tokens=2000, ignore_eos=True)
    sp = ServeProcess(tmp_path, TINY, drain_timeout=1)
    try:
        sp.wait_serving()
        await anyio.to_thread.run_sync(alone_from_here)  # (the server's start: beside others)
        results: dict = {}
        async with EngineClient.connect(sp.address) as c:
            async with anyio.create_task_group() as tg:
                await start_streams(tg, c, 8, params, results)
                t = sp.signal(signal.SIGTERM)
        code = sp.wait(30)
        elapsed = time.monotonic() - t
    finally:
        sp.kill()
    assert code == 0, sp.log
    assert elapsed < 1 + 2, f"exit took {elapsed:.2f}s after SIGTERM"
    assert len(results) == 8
    for toks, last in results.values():
        assert last.finished and last.finish_reason == "abort" and last.reason == "shutdown"
        assert 0 < len(toks) < 2000


@pytest.mark.alone  # asserts wall-clock bounds
async def test_second_signal_exits_fast_with_terminal_outputs(tmp_path, alone_from_here) -> None:
    from ipc import EngineClient

    params = SamplingParams(max_tokens=2000, ignore_eos=True)
    sp = ServeProcess(tmp_path, TINY, drain_timeout=120)
    try:
        sp.wait_serving()
        await anyio.to_thread.run_sync(alone_from_here)  # (the server's start: beside others)
        results: dict = {}
        async with EngineClient.connect(sp.address) as c:
            async with anyio.create_task_group() as tg:
                await start_streams(tg, c, 6, params, results)
                sp.signal(signal.SIGTERM)
                await wait_state(c, State.DRAINING)
                await anyio.sleep(0.3)
                t = sp.signal(signal.SIGTERM)
        code = sp.wait(30)
        elapsed = time.monotonic() - t
    finally:
        sp.kill()
    assert code == 0, sp.log
    assert elapsed < 2.0, f"exit took {elapsed:.2f}s after the second signal"
    assert len(results) == 6
    assert all(last.finish_reason == "abort" and last.reason == "shutdown" for _, last in results.values())


async def test_forward_error_kills_engine_and_tells_clients(tmp_path) -> None:
    from ipc import EngineClient

    cfg = EngineConfig(model="random:tiny-llama")
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    sp = ServeProcess(tmp_path, cfg, fault_at_step=5)
    errors: list = []
    try:
        sp.wait_serving()
        async with EngineClient.connect(sp.address) as c:

            async def one(i):
                with pytest.raises(EngineDeadError) as ei:
                    async for _ in c.generate(prompt(i), params):
                        pass
                errors.append(ei.value)

            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    for i in range(4):
                        tg.start_soon(one, i)
            with pytest.raises(EngineDeadError):
                async for _ in c.generate(prompt(9), params):
                    pass
        code = sp.wait(30)
    finally:
        sp.kill()
    assert len(errors) == 4 and any("injected fault" in str(e) for e in errors), errors
    assert code == 1, sp.log
    assert not sp.sock.exists()

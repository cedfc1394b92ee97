"""Sleep mode of a real ``enginecore serve`` process over IPC: sleep / update_weights /
wake through the Sleep, WakeUp and UpdateWeights messages, typed refusals and health while
asleep, 64 remote streams when a sleep comes, and SIGTERM while asleep at either level (exit 0,
at the end of each test)."""

from __future__ import annotations

import signal

import anyio
import pytest

from engine import (AsyncEngine, BadRequestError, EngineConfig, EngineSleepingError,
                    InvalidTransitionError, SamplingParams)
from ipc import EngineClient
from serve_helpers import ServeProcess
from states import State

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2, 7], list(range(20, 50))]


def config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", **{"num_kv_blocks": 64, "max_num_seqs": 8, **kw})


async def greedy(eng) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        toks = []
        async for o in eng.generate(p, PARAMS):
            toks += o.token_ids
        out.append(toks)
    return out


async def test_update_weights_over_ipc_equals_a_fresh_engine(tmp_path, hf_checkpoint) -> None:
    a, _ = hf_checkpoint("sleep-a", seed=0)
    b, _ = hf_checkpoint("sleep-b", seed=1)
    wide, _ = hf_checkpoint("sleep-wide", seed=1, intermediate_size=96)
    async with AsyncEngine.open(config(str(b))) as fresh:
        want = await greedy(fresh)
    proc = ServeProcess(tmp_path, config(str(a)))
    try:
        proc.wait_serving()
        async with EngineClient.connect(proc.address) as client:
            old = await greedy(client)
            assert old != want  # the two checkpoints really differ
            with pytest.raises(InvalidTransitionError, match="SERVING"):
                await client.update_weights(str(b))  # not while serving
            with anyio.fail_after(30):
                await client.sleep(level=1)
            assert client.is_sleeping
            h = await client.health()
            assert (h.state, h.live, h.ready) == (State.SLEEPING, True, False)
            with pytest.raises(EngineSleepingError):  # the client knows: refused at once
                client.generate(PROMPTS[0], PARAMS)
            client._state = State.SERVING  # the engine's own refusal, over the wire
            with anyio.fail_after(5), pytest.raises(EngineSleepingError) as ei:
                await client.generate(PROMPTS[0], PARAMS).__anext__()
            assert ei.value.retry_after > 0
            client._state = State.SLEEPING
            # refused (another architecture; no such path): the old weights keep serving
            with pytest.raises(BadRequestError, match="intermediate_size"):
                await client.update_weights(str(wide))
            with pytest.raises(BadRequestError, match="does not exist"):
                await client.update_weights(str(tmp_path / "nowhere"))
            await client.wake_up()
            assert client.state is State.SERVING and await greedy(client) == old
            for level in (1, 2):
                await client.sleep(level=level)
                await client.update_weights(str(b))
                await client.wake_up()
                assert await greedy(client) == want, level
                await client.sleep(level=level)
                await client.update_weights(str(a))
                await client.wake_up(["weights"])
                assert client.is_sleeping  # the KV cache is still out
                await client.wake_up(["kv_cache"])
                assert await greedy(client) == old, level
            await sigterm_while_asleep(proc, client, level=2)
    finally:
        proc.kill()


async def test_sleep_during_64_remote_streams_one_terminal_output_each(tmp_path) -> None:
    proc = ServeProcess(tmp_path, config("random:tiny-llama", num_kv_blocks=400, max_num_seqs=64,
                                         max_num_batched_tokens=512))
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i % 20)] for i in range(64)]
    try:
        proc.wait_serving()
        async with EngineClient.connect(proc.address) as client:
            for mode, max_tokens in (("abort", 400), ("wait", 24)):
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                finals: list[list] = [[] for _ in prompts]
                counts = [0] * 64
                started = anyio.Event()

                async def one(i: int) -> None:
                    async for out in client.generate(prompts[i], params):
                        counts[i] += len(out.token_ids)
                        if out.finished:
                            finals[i].append(out)
                        if sum(c > 1 for c in counts) == 64:
                            started.set()

                with anyio.fail_after(120):
                    async with anyio.create_task_group() as tg:
                        for i in range(64):
                            tg.start_soon(one, i)
                        await started.wait()
                        await client.sleep(level=1, mode=mode)
                        assert client.is_sleeping
                        with pytest.raises(EngineSleepingError):
                            client.generate([1, 2, 3], params)
                assert all(len(f) == 1 for f in finals), [len(f) for f in finals]
                if mode == "abort":
                    assert all((f[0].finish_reason, f[0].reason) == ("abort", "sleep") for f in finals)
                    assert all(1 < c < max_tokens for c in counts)
                else:
                    assert all(f[0].finish_reason == "length" for f in finals)
                    assert counts == [max_tokens] * 64
                await client.wake_up()
            assert len((await greedy(client))[0]) == PARAMS.max_tokens
            await sigterm_while_asleep(proc, client, level=1)
    finally:
        proc.kill()


async def sigterm_while_asleep(proc: ServeProcess, client: EngineClient, level: int) -> None:
    """SIGTERM to the engine process while asleep at ``level``: it releases what is left (level
    1: the host copy of the weights) and exits 0; the client sees a clean shutdown."""
    with anyio.fail_after(30):
        await client.sleep(level=level)
    assert client.is_sleeping
    proc.signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.log
    with anyio.fail_after(5):
        await client.wait_stopped()
    assert client.state is State.SHUTDOWN  # a clean end, not a death
    assert "signal SIGTERM in state sleeping" in proc.log
    assert not proc.sock.exists()

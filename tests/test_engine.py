"""The async engine: continuous batching, preemption, drain, abort, failure."""

from __future__ import annotations

import anyio
import pytest

from engine import (AsyncEngine, BadRequestError, EngineConfig, EngineDeadError,
                    EngineDrainingError, EngineShutdownError, InvalidTransitionError,
                    SamplingParams)
from engine.memory.owner import reachable_tensors
from states import State

TINY = "random:tiny-llama"
pytestmark = pytest.mark.asyncio


def prompts(n: int) -> list[list[int]]:
    # varied lengths (3..70 tokens) so prefills and decodes mix in one batch
    return [[(7 * i + 3 * j) % 250 + 1 for j in range(3 + (i * 11) % 68)] for i in range(n)]


async def collect(eng: AsyncEngine, prompt, params, request_id=None):
    toks, text, last = [], "", None
    async for out in eng.generate(prompt, params, request_id):
        toks += out.token_ids
        text += out.text
        last = out
    return toks, text, last


async def run_concurrently(eng, items, params) -> list:
    res: list = [None] * len(items)

    async def one(i, p):
        res[i] = await collect(eng, p, params)

    async with anyio.create_task_group() as tg:
        for i, p in enumerate(items):
            tg.start_soon(one, i, p)
    return res


async def test_64_concurrent_equal_sequential_and_blocks_free() -> None:
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ps = prompts(64)
    async with AsyncEngine.open(EngineConfig(model=TINY, max_num_batched_tokens=256),
                                check_integrity=True) as eng:
        conc = await run_concurrently(eng, ps, params)
        seq = [await collect(eng, p, params) for p in ps[:8]]
        core = eng.core
        assert core.statistics().steps > 30  # really batched over many steps
        assert core.blocks.num_free == core.blocks.num_blocks
        core.scheduler.check_integrity()
    for (t, _, last), (t2, _, _) in zip(conc[:8], seq):
        assert t == t2
    for t, _, last in conc:
        assert len(t) == 24 and last.finished and last.finish_reason == "length"
        assert last.num_output_tokens == 24
    assert eng.state is State.SHUTDOWN and eng.runner.released


async def test_preemption_keeps_outputs() -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ps = prompts(12)
    async with AsyncEngine.open(EngineConfig(model=TINY)) as big:
        ref = await run_concurrently(big, ps, params)
    # 14 blocks of 16 tokens: far less than 12 requests x ~80 tokens need at once
    async with AsyncEngine.open(EngineConfig(model=TINY, num_kv_blocks=14),
                                check_integrity=True) as small:
        got = await run_concurrently(small, ps, params)
        assert small.core.statistics().preemptions > 0
    assert [g[0] for g in got] == [r[0] for r in ref]


async def test_drain_finishes_inflight_and_rejects_new() -> None:
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        results: list = []
        rejected: list = []

        async def one(p):
            results.append(await collect(eng, p, params))

        async with anyio.create_task_group() as tg:
            for p in prompts(16):
                tg.start_soon(one, p)
            await anyio.sleep(0.05)
            assert eng.health_nowait().running + eng.health_nowait().waiting == 16
            tg.start_soon(eng.drain, 60)
            await anyio.sleep(0)
            assert eng.state is State.DRAINING and not eng.health_nowait().ready and eng.health_nowait().live
            for p in prompts(16):
                with anyio.fail_after(0.5):  # at once, never hanging
                    with pytest.raises(EngineDrainingError) as ei:
                        eng.generate(p, params)
                    rejected.append(ei.value)
        assert eng.state is State.SHUTDOWN and eng.runner.released
        assert len(rejected) == 16 and all(e.retryable for e in rejected)
        assert len(results) == 16
        assert all(r[2].finish_reason == "length" and len(r[0]) == 120 for r in results)
        with pytest.raises(EngineShutdownError):
            eng.generate([1, 2, 3], params)


async def test_drain_deadline_aborts_with_reason() -> None:
    params = SamplingParams(max_tokens=1500, ignore_eos=True)
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        results: list = []

        async def one(p):
            results.append(await collect(eng, p, params))

        async with anyio.create_task_group() as tg:
            for p in prompts(8):
                tg.start_soon(one, p)
            await anyio.sleep(0.05)
            with anyio.fail_after(5):
                await eng.drain(0.2)
        assert len(results) == 8
        for toks, _, last in results:
            assert last.finished and last.finish_reason == "abort"
            assert last.reason == "drain timeout"
            assert len(toks) < 1500
    assert eng.state is State.SHUTDOWN


async def test_a_consumer_cancelled_while_waiting_aborts_its_request() -> None:
    """A task reading a stream cancelled (a task group's cancel, a timeout) aborts the request
    at once -- not a request decoding on unread until the stream happens to be collected (the
    cancelled task's traceback kept it alive: the step thread ran on at a full core)."""
    params = SamplingParams(max_tokens=100_000, ignore_eos=True)
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        core = eng.core
        kept = []

        async def reader(rid):
            stream = eng.generate(prompts(1)[0], params, request_id=rid)
            kept.append(stream)  # held elsewhere: only the cancellation can abort it
            async for _ in stream:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader, "tg")
            while "tg" not in core.requests:
                await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
        with anyio.move_on_after(0.05):
            await reader("timeout")
        with anyio.fail_after(2):
            while core.requests or eng._inbox:
                await anyio.sleep(0.001)
        assert core.blocks.num_free == core.blocks.num_blocks and len(kept) == 2


async def test_abort_and_break_free_blocks_within_one_step() -> None:
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        core = eng.core
        stream = eng.generate(prompts(1)[0], params, request_id="a")
        n = 0
        async for out in stream:
            n += 1
            if n == 3:
                break
        steps = core.statistics().steps
        del stream  # dropping the iterator aborts it
        with anyio.fail_after(2):
            while "a" in core.requests or eng._inbox:
                await anyio.sleep(0.001)
        assert core.statistics().steps <= steps + 1
        assert core.blocks.num_free == core.blocks.num_blocks

        other = eng.generate(prompts(2)[1], params, request_id="b")
        await other.__anext__()
        await eng.abort("b", "user said so")
        outs = [o async for o in other]
        assert outs[-1].finish_reason == "abort" and outs[-1].reason == "user said so"
        assert core.blocks.num_free == core.blocks.num_blocks


async def test_failure_in_forward_kills_cleanly(inject_fault) -> None:
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    states: list = []
    inject_fault(5)
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        eng.on_state_change(lambda a, b: states.append(b))
        errors: list = []

        async def one(p):
            with pytest.raises(EngineDeadError) as ei:
                await collect(eng, p, params)
            errors.append(ei.value)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for p in prompts(6):
                    tg.start_soon(one, p)
        assert len(errors) == 6
        assert all("injected fault at step 5" in str(e) for e in errors)
        await eng.wait_stopped()
        assert states == [State.FAILED, State.SHUTDOWN]
        assert eng.runner.released and reachable_tensors(eng.runner) == []
        with pytest.raises(EngineDeadError):
            eng.generate([1, 2], params)
        with pytest.raises(EngineDeadError):
            await eng.drain(1)


async def test_stop_conditions_and_bad_requests() -> None:
    async with AsyncEngine.open(EngineConfig(model=TINY, max_model_len=64)) as eng:
        base, _, _ = await collect(eng, [5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
        # stop token id: ends right at its first occurrence
        stop_at = base[6]
        toks, _, last = await collect(eng, [5, 6, 7], SamplingParams(max_tokens=20, stop_token_ids=[stop_at]))
        assert last.finish_reason == "stop" and toks == base[: base.index(stop_at) + 1]
        # EOS (257) ends a request unless ignore_eos
        _, _, last = await collect(eng, [5, 6, 7], SamplingParams(max_tokens=3))
        assert last.finish_reason in ("length", "stop")
        # context limit
        toks, _, last = await collect(eng, list(range(1, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
        assert last.finish_reason == "length" and last.reason == "context limit" and len(toks) == 5
        # stop string: byte tokenizer, so text is the bytes; the stop string never appears
        _, full, _ = await collect(eng, "hello", SamplingParams(max_tokens=30, ignore_eos=True))
        if len(full) > 6:
            stop = full[3:5]
            _, text, last = await collect(eng, "hello", SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))
            assert last.finish_reason == "stop" and stop not in text and text == full[: full.index(stop)]
        for bad in (SamplingParams(max_tokens=0), SamplingParams(temperature=-1),
                    SamplingParams(top_p=0.0), SamplingParams(top_k=-2)):
            with pytest.raises(BadRequestError):
                eng.generate([1, 2], bad)
        with pytest.raises(BadRequestError, match="context limit"):
            eng.generate(list(range(1, 100)), SamplingParams())
        with pytest.raises(BadRequestError):
            eng.generate([1, 999999], SamplingParams())
        with pytest.raises(BadRequestError):
            eng.generate([], SamplingParams())
        s = eng.generate([1, 2], SamplingParams(max_tokens=5), request_id="dup")
        with pytest.raises(BadRequestError, match="already in flight"):
            eng.generate([1, 2], SamplingParams(), request_id="dup")
        assert [o async for o in s][-1].finished


async def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        alone, _, _ = await collect(eng, [9, 8, 7], p)
        many = await run_concurrently(eng, [[9, 8, 7]] + prompts(7), p)
        unseeded = await run_concurrently(eng, [[9, 8, 7]] * 4, SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
    assert many[0][0] == alone
    assert len({tuple(u[0]) for u in unseeded}) > 1


async def test_calls_checked_against_state() -> None:
    eng = AsyncEngine(EngineConfig(model=TINY))
    assert eng.state is State.INIT
    with pytest.raises(InvalidTransitionError, match="INIT"):
        eng.generate([1], SamplingParams())
    with pytest.raises(InvalidTransitionError):
        await eng.drain(0)
    assert eng.health_nowait().live and not eng.health_nowait().ready

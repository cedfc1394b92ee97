"""Pause and resume in process: ``keep`` freezes streams and continues them with no token lost
or repeated (greedy output identical to an unpaused run), ``abort`` and ``abort_all`` deliver
partial outputs as terminal ones, ``wait`` finishes what is in flight, requests arriving while
paused are queued (or refused with ``reject_while_paused``), and drain, shutdown and sleep work
from PAUSED with exactly one terminal output per request."""

from __future__ import annotations

import anyio
import pytest

from engine import (AsyncEngine, BadRequestError, EngineConfig, InvalidTransitionError,
                    SamplingParams)
from engine.errors import EnginePausedError
from states import State

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("torch_one_thread")]

TINY = "random:tiny-llama"
PROMPTS = [[5, 9, 13, 2, 7], [100, 3, 44, 17, 8, 9, 1, 30], list(range(20, 60))]
LONG = SamplingParams(max_tokens=40, ignore_eos=True)


def cfg(**kw) -> EngineConfig:
    return EngineConfig(model=TINY, device="cpu", **{"num_kv_blocks": 64, "max_num_seqs": 8, **kw})


class Collector:
    """One stream's outputs, gathered by a task; ``first`` is set at its first token."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.tokens: list[int] = []
        self.terminal = None
        self.terminals = 0
        self.first = anyio.Event()
        self.error = None

    async def run(self) -> None:
        try:
            async for out in self.stream:
                self.tokens += out.token_ids
                if self.tokens:
                    self.first.set()
                if out.finished:
                    self.terminal = out
                    self.terminals += 1
        except Exception as exc:  # noqa: BLE001 - recorded for the test to assert
            self.error = exc
            self.terminals += 1
        self.first.set()


async def unpaused(prompts=PROMPTS, params=LONG) -> list[list[int]]:
    async with AsyncEngine.open(cfg()) as eng:
        out = []
        for p in prompts:
            toks: list[int] = []
            async for o in eng.generate(p, params):
                toks += o.token_ids
            out.append(toks)
        return out


async def test_keep_freezes_and_resumes_every_stream_identically() -> None:
    expected = await unpaused()
    async with AsyncEngine.open(cfg()) as eng, anyio.create_task_group() as tg:
        cols = [Collector(eng.generate(p, LONG)) for p in PROMPTS]
        for c in cols:
            tg.start_soon(c.run)
        await cols[0].first.wait()
        await eng.pause("keep")
        assert eng.is_paused() and eng.state is State.PAUSED
        frozen = [len(c.tokens) for c in cols]
        assert any(0 < n < 40 for n in frozen), frozen
        late = Collector(eng.generate(PROMPTS[0], LONG))  # queued, not refused
        tg.start_soon(late.run)
        await anyio.sleep(0.3)
        assert [len(c.tokens) for c in cols] == frozen, "a stream moved while paused"
        assert late.tokens == [] and late.terminal is None
        assert (await eng.health()).ready is False
        await eng.resume()
        assert eng.state is State.SERVING
    for c, want in zip(cols, expected):
        assert c.terminals == 1 and c.terminal.finish_reason == "length"
        assert c.tokens == want  # nothing lost, nothing repeated
    assert late.tokens == expected[0] and late.terminals == 1


async def test_abort_mode_ends_streams_with_partial_output_then_serves() -> None:
    async with AsyncEngine.open(cfg()) as eng, anyio.create_task_group() as tg:
        cols = [Collector(eng.generate(p, LONG)) for p in PROMPTS]
        for c in cols:
            tg.start_soon(c.run)
        await cols[0].first.wait()
        await eng.pause("abort")
        await anyio.sleep(0.05)
        for c in cols:
            assert c.terminals == 1 and c.terminal is not None, c.error
            assert c.terminal.finish_reason == "abort" and c.terminal.reason == "pause"
            assert len(c.tokens) < 40
        await eng.resume()
        toks = [t async for o in eng.generate(PROMPTS[1], SamplingParams(max_tokens=5))
                for t in o.token_ids]
        assert len(toks) == 5


async def test_wait_mode_finishes_in_flight_and_queues_new_requests() -> None:
    async with AsyncEngine.open(cfg()) as eng, anyio.create_task_group() as tg:
        cols = [Collector(eng.generate(p, SamplingParams(max_tokens=16, ignore_eos=True)))
                for p in PROMPTS]
        for c in cols:
            tg.start_soon(c.run)
        await cols[0].first.wait()
        with anyio.fail_after(30):
            await eng.pause("wait")
        assert all(c.terminal is not None and c.terminal.finish_reason == "length"
                   and len(c.tokens) == 16 for c in cols)
        late = Collector(eng.generate(PROMPTS[2], SamplingParams(max_tokens=4)))
        tg.start_soon(late.run)
        await anyio.sleep(0.2)
        assert late.tokens == []
        await eng.resume()
        with anyio.fail_after(30):
            await late.first.wait()
    assert late.terminals == 1 and len(late.tokens) == 4


async def test_wait_mode_timeout_aborts_what_is_left() -> None:
    async with AsyncEngine.open(cfg()) as eng, anyio.create_task_group() as tg:
        c = Collector(eng.generate(PROMPTS[0], SamplingParams(max_tokens=4000, ignore_eos=True)))
        tg.start_soon(c.run)
        await c.first.wait()
        with anyio.fail_after(30):
            await eng.pause("wait", timeout=0.2)
        await anyio.sleep(0.05)
        assert c.terminal.finish_reason == "abort" and c.terminal.reason == "pause"
        await eng.resume()


async def test_abort_of_a_queued_request_and_abort_all_while_paused() -> None:
    async with AsyncEngine.open(cfg()) as eng, anyio.create_task_group() as tg:
        kept = Collector(eng.generate(PROMPTS[0], LONG))
        tg.start_soon(kept.run)
        await kept.first.wait()
        await eng.pause("keep")
        queued = [Collector(eng.generate(p, LONG, request_id=f"q{i}"))
                  for i, p in enumerate(PROMPTS)]
        for c in queued:
            tg.start_soon(c.run)
        await anyio.sleep(0.05)
        await eng.abort("q0", "client left")
        await anyio.sleep(0.05)
        assert queued[0].terminal.finish_reason == "abort"
        assert queued[0].terminal.reason == "client left"
        assert await eng.abort_all("rollout over") == 3  # the kept one and two queued
        await anyio.sleep(0.05)
        for c in [kept] + queued[1:]:
            assert c.terminals == 1 and c.terminal.reason == "rollout over", c.error
        assert 0 < len(kept.tokens) < 40
        await eng.resume()
        assert (await eng.health()).running == 0


async def test_abort_all_while_serving_ends_everything_at_a_step_boundary() -> None:
    async with AsyncEngine.open(cfg()) as eng, anyio.create_task_group() as tg:
        cols = [Collector(eng.generate(p, LONG)) for p in PROMPTS * 3]
        for c in cols:
            tg.start_soon(c.run)
        await cols[0].first.wait()
        assert await eng.abort_all() == len(cols)
        with anyio.fail_after(10):
            while not all(c.terminals for c in cols):
                await anyio.sleep(0.01)
        assert all(c.terminals == 1 and c.terminal.finish_reason == "abort" for c in cols)
        assert await eng.abort_all() == 0


async def test_reject_while_paused_refuses_with_a_retryable_error() -> None:
    async with AsyncEngine.open(cfg(reject_while_paused=True)) as eng:
        await eng.pause()
        with pytest.raises(EnginePausedError) as info:
            eng.generate(PROMPTS[0], LONG)
        assert info.value.retryable
        await eng.resume()
        await eng.resume()  # a no-op while serving


async def test_drain_from_keep_finishes_kept_and_queued_requests() -> None:
    eng = AsyncEngine(cfg())
    async with anyio.create_task_group() as tg:
        await eng.start(tg)
        kept = Collector(eng.generate(PROMPTS[0], LONG))
        tg.start_soon(kept.run)
        await kept.first.wait()
        await eng.pause("keep")
        queued = Collector(eng.generate(PROMPTS[1], SamplingParams(max_tokens=6)))
        tg.start_soon(queued.run)
        await anyio.sleep(0.05)
        with anyio.fail_after(60):
            await eng.drain()
    assert eng.state is State.SHUTDOWN
    assert kept.terminals == 1 and kept.terminal.finish_reason == "length"
    assert queued.terminals == 1 and len(queued.tokens) == 6


async def test_shutdown_and_sleep_from_paused() -> None:
    async with AsyncEngine.open(cfg()) as eng, anyio.create_task_group() as tg:
        kept = Collector(eng.generate(PROMPTS[0], LONG))
        tg.start_soon(kept.run)
        await kept.first.wait()
        await eng.pause("keep")
        queued = Collector(eng.generate(PROMPTS[1], LONG))
        tg.start_soon(queued.run)
        await anyio.sleep(0.05)
        await eng.sleep(1)  # mode abort: the kept and the queued request end
        assert kept.terminal.finish_reason == "abort" and queued.terminal.finish_reason == "abort"
        with pytest.raises(InvalidTransitionError, match="SLEEPING"):
            await eng.resume()
        await eng.wake_up()
        await eng.pause("keep")
        other = Collector(eng.generate(PROMPTS[2], LONG))
        tg.start_soon(other.run)
        await anyio.sleep(0.05)
        await eng.shutdown()
    assert other.terminals == 1 and other.terminal.finish_reason == "abort"


async def test_pause_refuses_bad_arguments_naming_them() -> None:
    async with AsyncEngine.open(cfg()) as eng:
        with pytest.raises(BadRequestError, match="mode"):
            await eng.pause("freeze")
        with pytest.raises(BadRequestError, match="timeout"):
            await eng.pause("wait", timeout=-1)
        assert eng.state is State.SERVING
        await eng.pause("keep")
        await eng.pause("keep")  # already paused: returns at once
        await eng.resume()


# -- weights while paused ---------------------------------------------------------------------
async def greedy_tokens(eng, prompt, n: int = 8) -> tuple[list[int], int]:
    toks, version = [], -1
    async for o in eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)):
        toks += o.token_ids
        version = o.weight_version
    return toks, version


async def test_weight_info_names_shapes_and_dtypes_match_the_model() -> None:
    async with AsyncEngine.open(cfg()) as eng:
        info = eng.weight_info()
        params = dict(eng.runner.resource("weights").named_parameters())
        assert len(info) >= len(params) - 1  # tied embeddings: one name fewer, fused: views
        for name, shape, dtype in info:
            assert isinstance(name, str) and dtype == "float32"
            if name in params:
                assert tuple(params[name].shape) == shape


async def test_subset_update_while_paused_changes_outputs_and_versions_them() -> None:
    import torch
    async with AsyncEngine.open(cfg()) as eng:
        before, v0 = await greedy_tokens(eng, PROMPTS[2])
        assert v0 == 0 and eng.weight_version == 0
        (name, shape, _), *_ = [i for i in eng.weight_info() if i[0].endswith("norm.weight")]
        await eng.pause("keep")
        g = torch.Generator().manual_seed(1)
        await eng.update_weights_from_tensors({name: torch.rand(shape, generator=g) * 3},
                                              version=7)
        assert eng.weight_version == 7
        assert eng.core.blocks.weights_version == 7  # the prefix cache's hashes start anew
        await eng.resume()
        after, v1 = await greedy_tokens(eng, PROMPTS[2])
        assert v1 == 7 and after != before
        await eng.pause()
        await eng.update_weights_from_tensors([(name, torch.ones(shape))])  # version: 7 + 1
        await eng.resume()
        assert (await greedy_tokens(eng, PROMPTS[0]))[1] == 8


async def test_bad_updates_are_refused_before_anything_changes() -> None:
    import torch
    async with AsyncEngine.open(cfg()) as eng:
        before, _ = await greedy_tokens(eng, PROMPTS[1])
        info = eng.weight_info()
        (name, shape, _), (other, oshape, _) = info[1], info[2]
        await eng.pause()
        bad = [
            ({name: torch.zeros(shape), "no.such.weight": torch.zeros(3)}, "unexpected"),
            ({name: torch.zeros(shape), other: torch.zeros(oshape[0] + 1)}, "shape"),
            ({name: torch.zeros(shape), other: torch.zeros(oshape, dtype=torch.float64)}, "dtype"),
            ({}, "no weights"),
        ]
        for tensors, what in bad:
            with pytest.raises(BadRequestError, match=what):
                await eng.update_weights_from_tensors(tensors)
        with pytest.raises(BadRequestError, match="version"):
            await eng.update_weights_from_tensors({name: torch.zeros(shape)}, version=-1)
        assert eng.weight_version == 0
        await eng.resume()
        assert (await greedy_tokens(eng, PROMPTS[1]))[0] == before  # nothing was written
        with pytest.raises(InvalidTransitionError, match="SERVING"):
            await eng.update_weights_from_tensors({name: torch.zeros(shape)})


async def test_sleep_kv_cache_only_keeps_the_weights_on_the_device() -> None:
    async with AsyncEngine.open(cfg()) as eng:
        before, _ = await greedy_tokens(eng, PROMPTS[0])
        weights = eng.runner.resource("weights")
        ptrs = [p.data_ptr() for p in weights.parameters()]
        await eng.sleep(1, tags=["kv_cache"])
        assert eng.runner.asleep == ("kv_cache",)
        assert "kv_cache" not in eng.runner._owner
        assert [p.data_ptr() for p in weights.parameters()] == ptrs
        assert not any(p.is_pinned() for p in weights.parameters())
        await eng.wake_up(["kv_cache"])
        assert eng.state is State.SERVING
        assert (await greedy_tokens(eng, PROMPTS[0]))[0] == before

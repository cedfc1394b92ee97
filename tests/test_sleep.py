"""Sleep mode in process: release on sleep, identical outputs after wake, weight
updates that equal a fresh engine, refused checkpoints that change nothing, and every stream's
one terminal output when a sleep comes in the middle of 64 of them."""

from __future__ import annotations

import gc
import shutil
import weakref

import anyio
import pytest
import torch

from engine import (AsyncEngine, BadRequestError, CheckpointError, EngineConfig,
                    EngineShutdownError, EngineSleepingError, InvalidTransitionError,
                    SamplingParams)
from engine.memory.owner import reachable_tensors
from states import State

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("torch_one_thread")]

TINY = "random:tiny-llama"
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2, 7], [100, 3, 44, 17, 8, 9, 1, 30], list(range(20, 60))]


def cfg(model: str = TINY, **kw) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", **{"num_kv_blocks": 64, "max_num_seqs": 8, **kw})


async def greedy(eng, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    out = []
    for p in prompts:
        toks = []
        async for o in eng.generate(p, params):
            toks += o.token_ids
        out.append(toks)
    return out


def device_refs(runner) -> dict[str, weakref.ref]:
    """Weak references to the weights' parameters, the KV tensor and the step buffers."""
    refs = {f"weights.{n}": weakref.ref(p.data) for n, p in runner.resource("weights").named_parameters()}
    refs["kv_cache.tensor"] = weakref.ref(runner.resource("kv_cache").tensor)
    for n, t in runner.resource("model_state").buffers.items():
        refs[f"model_state.{n}"] = weakref.ref(t)
    return refs


def alive(refs: dict[str, weakref.ref]) -> list[str]:
    gc.collect()
    return [n for n, r in refs.items() if r() is not None]


# -- release -------------------------------------------------------------------------------------
async def test_sleep_level2_leaves_nothing_reachable_and_wakes_identical() -> None:
    async with AsyncEngine.open(cfg()) as eng:
        before = await greedy(eng)
        refs = device_refs(eng.runner)
        await eng.sleep(level=2)
        assert eng.is_sleeping and eng.state is State.SLEEPING
        assert alive(refs) == []
        assert reachable_tensors(eng.runner) == []
        assert eng.runner._owner.names() == []
        await eng.wake_up()
        assert eng.state is State.SERVING and not eng.is_sleeping
        assert await greedy(eng) == before
    assert eng.state is State.SHUTDOWN and reachable_tensors(eng.runner) == []


async def test_sleep_level1_frees_cache_keeps_weights_in_host_memory() -> None:
    async with AsyncEngine.open(cfg()) as eng:
        before = await greedy(eng)
        refs = device_refs(eng.runner)
        await eng.sleep(level=1)
        # the KV cache and the step buffers are gone; the weights' old storage too (swapped
        # for host copies: on this CPU engine a copy, not page-locked)
        assert alive(refs) == []
        left = reachable_tensors(eng.runner)
        assert left and all("weights" in path for path in left), left
        held = sum(p.numel() * p.element_size() for p in eng.runner.resource("weights").parameters())
        assert eng._sleep.host_bytes >= held > 0
        await eng.wake_up()
        assert await greedy(eng) == before
        assert eng.runner._owner.names() == ["weights", "kv_cache", "model_state", "grammar_bitmask"]


async def test_draft_speculator_sleeps_and_wakes_with_the_target() -> None:
    config = cfg(speculator="draft", draft_model="random:tiny-llama@seed=3")
    async with AsyncEngine.open(config) as eng:
        before = await greedy(eng)
        for level in (1, 2):
            await eng.sleep(level=level)
            left = reachable_tensors(eng.runner)
            if level == 2:
                assert left == []
            else:  # the draft's model stays, in host memory; its cache and buffers are gone
                assert all("weights" in p or ".model" in p for p in left), left
                res = eng.runner.resource("speculator")
                assert res.kv is None and res.state is None
            await eng.wake_up()
            assert await greedy(eng) == before
        assert eng.runner._owner.names() == ["weights", "kv_cache", "model_state", "grammar_bitmask", "speculator"]


async def test_default_model_wakes_with_identical_greedy_outputs() -> None:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    async with AsyncEngine.open(EngineConfig(model="default", device="cpu")) as eng:
        prompt = eng.tokenizer.encode("The capital of France is")
        before = await greedy(eng, [prompt], params)
        for level in (1, 2):
            await eng.sleep(level=level)
            await eng.wake_up()
            assert await greedy(eng, [prompt], params) == before, level


async def test_partial_wake_serves_only_when_both_parts_are_back() -> None:
    async with AsyncEngine.open(cfg()) as eng:
        before = await greedy(eng)
        await eng.sleep(level=2)
        await eng.wake_up(["weights"])
        assert eng.is_sleeping and eng.runner.asleep == ("kv_cache",)
        with pytest.raises(EngineSleepingError):
            eng.generate([1, 2, 3])
        await eng.wake_up(["kv_cache"])
        assert eng.state is State.SERVING and await greedy(eng) == before


# -- refusals ------------------------------------------------------------------------------------
async def test_requests_while_asleep_are_refused_at_once_and_calls_checked() -> None:
    async with AsyncEngine.open(cfg()) as eng:
        with pytest.raises(InvalidTransitionError, match="SERVING"):
            await eng.wake_up()
        with pytest.raises(InvalidTransitionError, match="SERVING"):
            await eng.update_weights("/nonexistent")
        for bad in (dict(level=3), dict(mode="later"), dict(timeout=-1)):
            with pytest.raises(BadRequestError):
                await eng.sleep(**bad)
        assert eng.state is State.SERVING
        await eng.sleep()
        with anyio.fail_after(1):
            with pytest.raises(EngineSleepingError) as ei:
                eng.generate([1, 2, 3])
        assert ei.value.retryable and ei.value.retry_after > 0
        h = await eng.health()
        assert (h.state, h.live, h.ready) == (State.SLEEPING, True, False)
        with pytest.raises(InvalidTransitionError, match="SLEEPING"):
            await eng.sleep()
        for tags in ([], ["gpu"], "weights"):
            with pytest.raises(BadRequestError):
                await eng.wake_up(tags)
        await eng.wake_up()
        assert len((await greedy(eng))[0]) == GREEDY.max_tokens


async def test_shutdown_while_asleep_releases_everything() -> None:
    async with AsyncEngine.open(cfg()) as eng:
        await eng.sleep(level=1)
    assert eng.state is State.SHUTDOWN and eng.runner.released
    assert reachable_tensors(eng.runner) == [] and eng.exit_code == 0
    with pytest.raises(EngineShutdownError):
        await eng.wake_up()


async def test_failed_wake_stays_asleep_and_leaks_nothing(tmp_path, hf_checkpoint) -> None:
    src, _ = hf_checkpoint("sleep-a", seed=0)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    async with AsyncEngine.open(cfg(str(path))) as eng:
        before = await greedy(eng)
        await eng.sleep(level=2)
        shutil.move(path, tmp_path / "moved")
        with pytest.raises(CheckpointError, match="does not exist"):
            await eng.wake_up()
        assert eng.state is State.SLEEPING and reachable_tensors(eng.runner) == []
        shutil.move(tmp_path / "moved", path)
        await eng.wake_up()
        assert await greedy(eng) == before


# -- weight updates ------------------------------------------------------------------------------
async def test_update_weights_equals_a_fresh_engine_on_that_checkpoint(hf_checkpoint) -> None:
    a, _ = hf_checkpoint("sleep-a", seed=0)
    b, _ = hf_checkpoint("sleep-b", seed=1)
    async with AsyncEngine.open(cfg(str(b))) as fresh:
        want = await greedy(fresh)
    async with AsyncEngine.open(cfg(str(a))) as eng:
        old = await greedy(eng)
        assert old != want  # the two checkpoints really differ
        for level in (1, 2):
            await eng.sleep(level=level)
            await eng.update_weights(str(b))
            await eng.wake_up()
            assert await greedy(eng) == want, level
            await eng.sleep(level=level)
            await eng.update_weights(str(a))
            await eng.wake_up()
            assert await greedy(eng) == old, level
        # after an update, a level-2 wake reloads the updated checkpoint, not the first one
        await eng.sleep(level=1)
        await eng.update_weights(str(b))
        await eng.wake_up()
        await eng.sleep(level=2)
        await eng.wake_up()
        assert await greedy(eng) == want


async def test_update_weights_from_tensors_equals_a_fresh_engine(hf_checkpoint) -> None:
    from safetensors.torch import load_file

    a, _ = hf_checkpoint("sleep-a", seed=0)
    b, _ = hf_checkpoint("sleep-b", seed=1)
    async with AsyncEngine.open(cfg(str(b))) as fresh:
        want = await greedy(fresh)
        dtype = fresh.runner.dtype  # in-memory tensors come in the engine's dtype (bf16 on an
        # AVX512-BF16 CPU: a checkpoint's dtype auto), a checkpoint's are converted
    tensors = {k: v.to(dtype) for k, v in load_file(str(b / "model.safetensors")).items()}
    async with AsyncEngine.open(cfg(str(a))) as eng:
        await eng.sleep(level=2)
        await eng.update_weights_from_tensors(tensors)
        await eng.wake_up()
        assert await greedy(eng) == want
        await eng.sleep(level=2)  # tensors cannot be reloaded from a checkpoint: say so
        with pytest.raises(BadRequestError, match="update_weights"):
            await eng.wake_up()
        await eng.update_weights_from_tensors(tensors.items())
        await eng.wake_up()
        assert await greedy(eng) == want


async def test_mismatched_weights_are_refused_and_the_old_ones_serve(hf_checkpoint) -> None:
    from safetensors.torch import load_file

    a, _ = hf_checkpoint("sleep-a", seed=0)
    b, _ = hf_checkpoint("sleep-b", seed=1)
    wide, _ = hf_checkpoint("sleep-wide", seed=1, intermediate_size=96)
    async with AsyncEngine.open(cfg(str(a))) as eng:
        old = await greedy(eng)
        await eng.sleep(level=1)
        with pytest.raises(CheckpointError, match="intermediate_size"):
            await eng.update_weights(str(wide))
        good = {k: v.to(eng.runner.dtype) for k, v in load_file(str(b / "model.safetensors")).items()}
        last = sorted(good)[-1]  # every other tensor is valid and would change the weights
        cases = [
            ({**good, last: good[last][:-1]}, f"shape mismatch for {last}"),
            ({**good, last: good[last].double()}, f"dtype mismatch for {last}"),
            ({**good, "model.layers.9.mlp.up_proj.weight": good[last]}, "unexpected weight 'model.layers.9"),
        ]  # (a subset is a valid update: tests/test_pause.py)
        for tensors, message in cases:
            # ordered so the bad tensor comes last: nothing may have been copied before it
            ordered = sorted(tensors.items(), key=lambda kv: kv[0] == last or kv[0].startswith("model.layers.9"))
            with pytest.raises(BadRequestError, match=message):
                await eng.update_weights_from_tensors(ordered)
        assert eng.is_sleeping
        await eng.wake_up()
        assert await greedy(eng) == old


# -- 64 streams ----------------------------------------------------------------------------------
async def _streams_then_sleep(mode: str, timeout=None, max_tokens: int = 64):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i % 20)] for i in range(64)]
    terminal: list[list] = [[] for _ in prompts]
    counts = [0] * 64
    refused: list = []
    async with AsyncEngine.open(cfg(num_kv_blocks=400, max_num_seqs=64,
                                    max_num_batched_tokens=512)) as eng:
        started = anyio.Event()

        async def one(i: int) -> None:
            async for out in eng.generate(prompts[i], params):
                counts[i] += len(out.token_ids)
                if out.finished:
                    terminal[i].append(out)
                if sum(c > 2 for c in counts) == 64:
                    started.set()

        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i)
            with anyio.fail_after(60):
                await started.wait()

                async def late() -> None:
                    await anyio.sleep(0)  # once SLEEPING
                    try:
                        eng.generate([1, 2, 3], params)
                    except EngineSleepingError as exc:
                        refused.append(exc)

                tg.start_soon(late)
                await eng.sleep(level=1, mode=mode, timeout=timeout)
        assert eng.is_sleeping and eng.core.num_running == 0
        assert refused, "a request during the sleep was not refused"
        await eng.wake_up()
        assert len((await greedy(eng))[0]) == GREEDY.max_tokens
    assert all(len(t) == 1 for t in terminal), [len(t) for t in terminal]
    return [t[0] for t in terminal], counts


async def test_sleep_abort_during_64_streams_one_terminal_output_each() -> None:
    finals, counts = await _streams_then_sleep("abort", max_tokens=400)
    assert all(f.finish_reason == "abort" and f.reason == "sleep" for f in finals)
    assert all(2 < c < 400 for c in counts)


async def test_sleep_wait_during_64_streams_lets_them_finish() -> None:
    finals, counts = await _streams_then_sleep("wait", max_tokens=40)
    assert all(f.finish_reason == "length" for f in finals) and counts == [40] * 64


async def test_sleep_wait_aborts_at_its_timeout() -> None:
    finals, counts = await _streams_then_sleep("wait", timeout=0.3, max_tokens=1500)
    assert all(f.finish_reason == "abort" and f.reason == "sleep" for f in finals)
    assert all(c < 1500 for c in counts)

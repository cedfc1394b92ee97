"""Sleep mode, weight updates and pause across tensor-parallel ranks (TP=3, gloo, CPU): every
rank takes its slice of the same update (greedy outputs equal a TP=1 engine updated the same
way), a refused update changes nothing on any rank, sleep and wake reach every rank (what each
rank's owner holds is reported back), and every rank's release leaves 0 tensors.

The tiny checkpoint has 3 heads, 3 KV heads (hidden size 48), an MLP of 192 and a vocabulary of 384, so TP=3
divides it and its shards are slices of TP=1's weights (not per-rank random draws). The default
model's TP=3 run of the same is in the slow test at the end."""

from __future__ import annotations

from anyio import to_thread
import anyio
import pytest
import torch

from engine import AsyncEngine, BadRequestError, EngineConfig, SamplingParams
from engine.memory.weights import module_bytes
from engine.weight_transfer import Sender, metadata
from states import State

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]

TP3_SHAPES = dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3,
                  intermediate_size=192)
PROMPTS = [[5, 9, 13, 2, 7, 40], list(range(100, 130))]
OWNED = ["weights", "kv_cache", "model_state", "grammar_bitmask"]
#: one weight of each kind of slice: column (dim 0), row (dim 1), vocabulary, replicated
SUBSET = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
          "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.conftest import write_hf_checkpoint

    root = tmp_path_factory.mktemp("tp3")
    write_hf_checkpoint(root / "a", seed=0, **TP3_SHAPES)
    write_hf_checkpoint(root / "b", seed=1, **TP3_SHAPES)
    return str(root / "a"), str(root / "b")


def cfg(model: str, tp: int, **kw) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="float32", tensor_parallel_size=tp,
                        num_kv_blocks=64, max_num_seqs=4, **kw)


async def greedy(eng, n: int = 6) -> list[tuple[list[int], int]]:
    """Each prompt's greedy tokens and the weight version they carry (batched)."""
    out: dict[int, tuple[list[int], int]] = {}

    async def one(i, p):
        toks, version = [], -1
        async for o in eng.generate(p, SamplingParams(max_tokens=n, temperature=0,
                                                      ignore_eos=True)):
            toks += o.token_ids
            version = o.weight_version
        out[i] = (toks, version)

    async with anyio.create_task_group() as tg:
        for i, p in enumerate(PROMPTS):
            tg.start_soon(one, i, p)
    return [out[i] for i in range(len(PROMPTS))]


def nudged(info, seed: int, names=None, base=None) -> dict[str, torch.Tensor]:
    """New values for ``names`` (default: every weight): ``base`` (or zeros) plus noise."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, _ in info:
        if names is None or name in names:
            b = base[name] if base is not None else torch.zeros(shape)
            out[name] = (b + 0.2 * torch.randn(shape, generator=g)).contiguous()
    return out


def release_reports(runner) -> dict:
    return dict(getattr(runner._tp, "reports", {}) or {})


def assert_released(reports: dict, world: int) -> None:
    assert sorted(reports) == list(range(world))
    for r in reports.values():  # every rank's weakref check, reported to the driver
        assert r.alive == 0 and r.alive_bytes == 0 and not r.reachable, r
    assert not torch.distributed.is_initialized()


def full_weights(eng) -> dict[str, torch.Tensor]:
    """A TP=1 engine's weights (a TP rank holds only its slices)."""
    return {n: t.detach().clone() for n, t in eng.runner.resource("weights").named_parameters()}


async def update_script(eng, ckpt_b: str, base: dict) -> list:
    """The same updates on any engine: a subset (while paused), a refused one, a full set, a
    checkpoint; greedy outputs after each."""
    info = eng.weight_info()
    seen = [await greedy(eng)]
    await eng.pause()
    await eng.update_weights_from_tensors(nudged(info, 1, SUBSET, base), version=7)
    await eng.resume()
    seen.append(await greedy(eng))
    await eng.pause()
    bad = nudged(info, 2, SUBSET[:2])
    bad[SUBSET[1]] = bad[SUBSET[1]][:, :-1]  # the second tensor's shape is wrong
    with pytest.raises(BadRequestError, match="shape mismatch"):
        await eng.update_weights_from_tensors(bad)
    await eng.resume()
    seen.append(await greedy(eng))  # nothing changed, on any rank
    await eng.pause()
    await eng.update_weights_from_tensors(nudged(info, 3))
    await eng.resume()
    seen.append(await greedy(eng))
    await eng.pause()
    await eng.update_weights(ckpt_b)
    await eng.resume()
    seen.append(await greedy(eng))
    return seen


@pytest.mark.usefixtures("torch_one_thread")
async def test_tp3_updates_equal_tp1(ckpts) -> None:
    a, b = ckpts
    async with AsyncEngine.open(cfg(a, 1)) as eng:
        base = full_weights(eng)
        want = await update_script(eng, b, base)
    async with AsyncEngine.open(cfg(b, 1)) as eng:
        fresh_b = await greedy(eng)
    async with AsyncEngine.open(cfg(a, 3)) as eng:
        got = await update_script(eng, b, base)
        runner = eng.runner
    assert got == want
    base, subset, refused, full, ckpt = got
    assert subset != base and full != subset and ckpt != full  # every update took effect
    assert refused == subset and subset[0][1] == 7 and full[0][1] == 8
    assert [t for t, _ in ckpt] == [t for t, _ in fresh_b]  # the checkpoint's weights, whole
    assert_released(release_reports(runner), 3)


@pytest.mark.usefixtures("torch_one_thread")
async def test_tp3_sleep_and_wake_reach_every_rank(ckpts) -> None:
    a, b = ckpts
    async with AsyncEngine.open(cfg(a, 3)) as eng:
        tp = eng.runner._tp
        base = await greedy(eng)
        shard = module_bytes(eng.runner.resource("weights"))

        await eng.sleep(1)
        assert eng._sleep.host_bytes == 3 * shard  # every rank offloaded its (equal) shard
        assert tp.rank_states == {r: (["weights"], ["weights", "kv_cache"]) for r in (1, 2)}
        await eng.wake_up()
        assert tp.rank_states == {r: (OWNED, []) for r in (1, 2)}
        assert await greedy(eng) == base

        await eng.sleep(1, tags=["kv_cache"])  # the weights stay on every rank's device
        assert eng._sleep.host_bytes == 0
        assert tp.rank_states == {r: (["weights"], ["kv_cache"]) for r in (1, 2)}
        await eng.update_weights(b)  # asleep: written in place on every rank
        await eng.wake_up(tags=["kv_cache"])
        assert eng.state is State.SERVING
        assert tp.rank_states == {r: (OWNED, []) for r in (1, 2)}
        on_b = await greedy(eng)
        assert on_b != base

        await eng.sleep(2)  # discarded on every rank; the wake reloads each rank's slice of b
        assert tp.rank_states == {r: ([], ["weights", "kv_cache"]) for r in (1, 2)}
        await eng.wake_up()
        assert await greedy(eng) == on_b

        await eng.sleep(2)
        await eng.update_weights(a)  # a full set while discarded: allocated on every rank
        await eng.wake_up()
        assert [t for t, _ in await greedy(eng)] == [t for t, _ in base]
        runner = eng.runner
    assert_released(release_reports(runner), 3)


@pytest.mark.usefixtures("torch_one_thread")
async def test_tp3_failed_wake_leaves_every_rank_asleep(ckpts, tmp_path) -> None:
    import shutil

    a, _ = ckpts
    gone = str(tmp_path / "copy")
    shutil.copytree(a, gone)
    async with AsyncEngine.open(cfg(gone, 3)) as eng:
        tp = eng.runner._tp
        base = await greedy(eng, 3)
        await eng.sleep(2)
        shutil.rmtree(gone)  # a level-2 wake reloads from here, on every rank
        with pytest.raises(Exception) as err:
            await eng.wake_up()
        assert "copy" in str(err.value), err.value
        assert eng.state is State.SLEEPING
        assert tp.rank_states == {r: ([], ["weights", "kv_cache"]) for r in (1, 2)}
        await eng.update_weights(a)  # the same weights from elsewhere
        await eng.wake_up()
        assert await greedy(eng, 3) == [(t, 1) for t, _ in base]
        runner = eng.runner
    assert_released(release_reports(runner), 3)


@pytest.mark.usefixtures("torch_one_thread")
async def test_tp3_pause_keep_abort_all_and_a_trainer_transfer(ckpts) -> None:
    a, _ = ckpts
    long = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    async with AsyncEngine.open(cfg(a, 1)) as eng:
        want = [t async for o in eng.generate(PROMPTS[1], long) for t in o.token_ids]
    async with AsyncEngine.open(cfg(a, 3)) as eng, anyio.create_task_group() as tg:
        toks: list[int] = []
        first, done = anyio.Event(), anyio.Event()

        async def stream():
            async for o in eng.generate(PROMPTS[1], long):
                toks.extend(o.token_ids)
                first.set()
            done.set()

        tg.start_soon(stream)
        await first.wait()
        await eng.pause("keep")  # the in-flight step settled on every rank; nothing steps
        frozen = len(toks)
        await anyio.sleep(0.3)
        assert len(toks) == frozen < 24
        await eng.resume()
        with anyio.fail_after(60):
            await done.wait()
        assert toks == want  # nothing lost or repeated across the ranks

        outs = []

        async def one():
            async for o in eng.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)):
                outs.append(o)

        tg.start_soon(one)
        with anyio.fail_after(60):
            while not outs:
                await anyio.sleep(0.02)
            assert await eng.abort_all() == 1
            while not outs[-1].finished:
                await anyio.sleep(0.02)
        assert outs[-1].finish_reason == "abort" and sum(len(o.token_ids) for o in outs) < 200

        # a trainer's update through its own gloo group, forwarded over the ranks' group
        info = eng.weight_info()
        new = nudged(info, 5, SUBSET[:3])
        await eng.pause()
        await eng.update_weights_from_tensors(new)
        await eng.resume()
        by_tensors = await greedy(eng)
        await eng.pause()
        await eng.update_weights(a)
        port = _free_port()
        senders: list = []
        tg.start_soon(to_thread.run_sync, lambda: senders.append(Sender("127.0.0.1", port)))
        await eng.init_weight_transfer("gloo", "127.0.0.1", port, rank=1, world_size=2, timeout=60)
        while not senders:
            await anyio.sleep(0.01)
        async with anyio.create_task_group() as inner:
            inner.start_soon(to_thread.run_sync, senders[0].send, new)
            await eng.update_weights_from_distributed(metadata(new))
        senders[0].close()
        await eng.close_weight_transfer()
        await eng.resume()
        assert [t for t, _ in await greedy(eng)] == [t for t, _ in by_tensors]
        runner = eng.runner
    assert_released(release_reports(runner), 3)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_default_model_tp3_pause_update_sleep_wake() -> None:
    """The embedded model: TP=3 paused, updated (a subset, then a full
    set: greedy outputs equal TP=1's), asleep and woken (level 1, the KV cache alone) on every
    rank, 0 tensors alive on every rank after the release."""
    kw = dict(model="default", dtype="float32", max_model_len=256, kv_cache_bytes=8 << 20,
              cpu_weights="float")
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def gen(eng):
        return [t async for o in eng.generate(prompt, params) for t in o.token_ids]

    async def script(eng, base):
        info = eng.weight_info()
        subset = {n: t + 0.05 * torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
                  for n, t in base.items() if n in SUBSET}
        seen = [await gen(eng)]
        await eng.pause()
        await eng.update_weights_from_tensors(subset)
        await eng.resume()
        seen.append(await gen(eng))
        await eng.pause()
        g = torch.Generator().manual_seed(2)
        await eng.update_weights_from_tensors(
            {n: base[n] + 0.002 * torch.randn(s, generator=g) for n, s, _ in info})
        await eng.resume()
        seen.append(await gen(eng))
        return seen

    async with AsyncEngine.open(EngineConfig(**kw)) as eng:
        base = full_weights(eng)
        want = await script(eng, base)
    async with AsyncEngine.open(EngineConfig(tensor_parallel_size=3, **kw)) as eng:
        tp = eng.runner._tp
        got = await script(eng, base)
        await eng.sleep(1)
        assert tp.rank_states == {r: (["weights"], ["weights", "kv_cache"]) for r in (1, 2)}
        await eng.wake_up()
        await eng.sleep(1, tags=["kv_cache"])
        assert tp.rank_states == {r: (["weights"], ["kv_cache"]) for r in (1, 2)}
        await eng.wake_up(tags=["kv_cache"])
        assert tp.rank_states == {r: (OWNED, []) for r in (1, 2)}
        assert await gen(eng) == got[-1]
        runner = eng.runner
    assert got == want and got[1] != got[0]
    assert_released(release_reports(runner), 3)

"""GPU release: after ``shutdown()`` the CUDA caching allocator is back to its pre-load state,
to the byte (``memory_allocated``) and to the segment (``memory_reserved``), cycle after cycle.

Model: ``random:qwen3-0.6b`` in bf16 with an 8 GiB KV cache; every cycle runs real prefill and
decode steps (a chunked 2.5k-token prompt among them), so activations and per-step tensors were
allocated too. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import gc

import anyio
import pytest
import torch

from engine import AsyncEngine, EngineConfig, ModelRunner, SamplingParams
from engine.core.engine_core import EngineCore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CYCLES = 10
PROMPT_LENGTHS = (5, 300, 2500)
MAX_TOKENS = 16
MiB = 2**20


def _config() -> EngineConfig:
    return EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype="bfloat16",
                        kv_cache_bytes=8 * 2**30)


def _mem() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _fmt(m: tuple[int, int]) -> str:
    return f"allocated {m[0]} B ({m[0] / MiB:.1f} MiB), reserved {m[1]} B ({m[1] / MiB:.1f} MiB)"


def _requests():
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [(f"r{i}", list(range(1000, 1000 + n)), params) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def baseline() -> tuple[int, int]:
    """The allocator before any load (the CUDA context exists; it is not the engine's)."""
    torch.cuda.init()
    gc.collect()
    torch.cuda.empty_cache()
    m = _mem()
    print(f"\nbefore load: {_fmt(m)}")
    return m


def _core_cycle() -> dict:
    """Load, serve through ModelRunner + EngineCore on this thread, shut down."""
    torch.cuda.reset_peak_memory_stats()
    runner = ModelRunner(_config())
    runner.load()
    loaded = _mem()
    kv = runner.resource("kv_cache").nbytes
    core = EngineCore(runner)
    for rid, ids, params in _requests():
        core.add_request(rid, ids, params)
    steps = tokens = 0
    while core.has_work():
        tokens += sum(len(o.token_ids) for o in core.step())
        steps += 1
    assert tokens == MAX_TOKENS * len(PROMPT_LENGTHS)
    peak = torch.cuda.max_memory_allocated()
    order = runner.shutdown()
    return dict(loaded=loaded, kv=kv, peak=peak, steps=steps, order=order)


def test_core_cycles_return_every_byte(baseline):
    results = []
    for cycle in range(CYCLES):
        info = _core_cycle()
        gc.collect()
        after = _mem()
        results.append(after)
        print(f"cycle {cycle}: loaded {_fmt(info['loaded'])}; KV {info['kv'] / MiB:.0f} MiB; "
              f"peak allocated {info['peak'] / MiB:.1f} MiB over {info['steps']} steps; "
              f"released {info['order']}; after shutdown {_fmt(after)}")
        assert info["order"] == ["grammar_bitmask", "cuda_graphs", "model_state", "kv_cache", "weights"]
        assert info["loaded"][0] - baseline[0] > 8 * 2**30  # the 8 GiB cache and the weights
        assert info["peak"] > info["loaded"][0]  # the steps allocated activations
        assert after[0] == baseline[0], f"cycle {cycle}: allocated {after[0] - baseline[0]:+d} B"
        assert after[1] == baseline[1], f"cycle {cycle}: reserved {after[1] - baseline[1]:+d} B"
    assert results == [baseline] * CYCLES  # no growth


def test_async_engine_cycles_return_every_byte(baseline):
    """The same through AsyncEngine (steps on worker threads), three open/close cycles."""

    async def cycle() -> None:
        async with AsyncEngine.open(_config()) as engine:
            async with anyio.create_task_group() as tg:
                for rid, ids, params in _requests():
                    stream = engine.generate(ids, params, request_id=rid)

                    async def drain(s=stream):
                        n = 0
                        async for out in s:
                            n += len(out.token_ids)
                        assert n == MAX_TOKENS

                    tg.start_soon(drain)

    for i in range(3):
        anyio.run(cycle)
        gc.collect()
        after = _mem()
        print(f"AsyncEngine cycle {i}: after shutdown {_fmt(after)}")
        assert after == baseline, f"cycle {i}: allocated {after[0] - baseline[0]:+d} B, " \
                                  f"reserved {after[1] - baseline[1]:+d} B"


def test_release_with_a_full_prefix_cache_returns_every_byte(baseline):
    """Every KV block ends up holding a cached prefix (distinct prompts through a small cache,
    then a second pass that hits them): shutdown still gives back every byte, and the block
    manager, which is host bookkeeping of the KV cache resource, is closed with it."""
    cfg = EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype="bfloat16",
                       num_kv_blocks=64, max_num_seqs=8, max_model_len=512)
    runner = ModelRunner(cfg)
    runner.load()
    core = EngineCore(runner)
    blocks = core.blocks
    # one output token: a prompt of whole blocks leaves only full (cacheable) blocks behind
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    per = 8  # blocks per prompt
    n_prompts = 3 * blocks.num_blocks // per + 1
    prompts = [[1000 + (p * 7919 + i) % 50000 for i in range(per * blocks.block_size)]
               for p in range(n_prompts)]
    for rnd in range(2):
        for p, ids in enumerate(prompts[-8:] if rnd else prompts):
            core.add_request(f"{rnd}-{p}", ids, params)
        while core.has_work():
            core.step()
    stats = blocks.statistics()
    print(f"\nfull cache: {stats}, {blocks.num_blocks} blocks")
    assert stats.evictions > 0 and stats.hits > 0  # it filled up, and served hits
    assert stats.cached_blocks > blocks.num_blocks - per  # (nearly) every block a cached prefix
    runner.shutdown()
    del core
    gc.collect()
    after = _mem()
    print(f"after shutdown with a full cache: {_fmt(after)}")
    assert blocks.closed and blocks.statistics().cached_blocks == 0
    assert after == baseline, f"allocated {after[0] - baseline[0]:+d} B, reserved {after[1] - baseline[1]:+d} B"

"""GPU: prefix caching's blocks shared inside one step (``BlockManager.seal_ahead``).

48 requests with one 700-token prefix and tails of their own, added at once: with caching on,
the first request's chunk registers the prefix's blocks when it is scheduled and the others,
admitted in the same step, read them (the paged prefill kernel reads K/V the same step wrote a
layer earlier). Greedy fp32 outputs equal the uncached engine's (all but near-ties: cuBLAS
rounds by row count, as in test_gpu_mixed_graphs; K/V read before it is written would change
nearly every sequence), the hits are counted, and the device memory goes back to its baseline
after shutdown.

Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import gc

from gpu_memory import baseline, mem
import pytest
import torch

from engine import EngineConfig, ModelRunner, SamplingParams
from engine.core.engine_core import EngineCore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _serve(caching: bool):
    runner = ModelRunner(EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype="float32",
                                      kv_cache_bytes=2 * 2**30, max_num_seqs=64,
                                      enable_prefix_caching=caching))
    runner.load()
    core = EngineCore(runner, check_integrity=True)
    prefix = [(j * 7919) % 50000 + 300 for j in range(700)]
    for i in range(48):
        tail = [(i * 131 + j * 7) % 50000 + 300 for j in range(3 + (i * 37) % 90)]
        core.add_request(f"r{i}", prefix + tail, SamplingParams(max_tokens=8 + i % 9, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    first_step = None
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
        if first_step is None:
            first_step = core.blocks.statistics()
    stats = core.blocks.statistics()
    runner.shutdown()
    del core, runner
    gc.collect()
    return tokens, stats, first_step


def test_one_step_shares_its_prefix_and_outputs_equal_uncached():
    base = baseline()
    off, off_stats, _ = _serve(False)
    on, on_stats, first = _serve(True)
    after = mem()
    print(f"\nhits {on_stats.hits} of {on_stats.queries} prompt tokens; after the first step "
          f"{first.hits}; memory before {base}, after shutdown {after}")
    same = sum(on[r] == off[r] for r in off)
    print(f"identical greedy sequences {same}/{len(off)}")
    assert sorted(on) == sorted(off) and all(len(on[r]) == len(off[r]) for r in off)
    assert same >= 46, f"only {same}/48 greedy sequences identical in fp32"
    assert off_stats.hits == 0
    # the first step admits many requests; all but the first hit the 43 full prefix blocks
    assert first.hits >= 10 * 688, first
    assert on_stats.hits >= 47 * 688, on_stats
    assert after == base

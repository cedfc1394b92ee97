"""Tensor parallelism on CUDA: TP=2 greedy parity with TP=1 when two GPUs are there (NCCL), and
on one GPU with two processes (NCCL refuses two ranks on one device, so the ranks share it over
gloo, the collectives staged through host memory); every rank's tensors released."""

from __future__ import annotations

import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.asyncio,
]


async def generate_all(config: EngineConfig, prompts):
    out = []
    async with AsyncEngine.open(config) as eng:
        for p in prompts:
            toks = []
            async for o in eng.generate(p, SamplingParams(max_tokens=8, temperature=0,
                                                          ignore_eos=True)):
                toks += o.token_ids
            out.append(toks)
        runner = eng.runner
    return out, dict(getattr(runner._tp, "reports", {}) or {})


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
async def test_tp2_nccl_matches_tp1(hf_checkpoint) -> None:
    path, _ = hf_checkpoint("tp-llama-gpu")
    kw = dict(model=str(path), dtype="float32", device="cuda", kv_cache_bytes=64 << 20)
    prompts = [[5, 6, 7, 8], list(range(9, 60))]
    ref, _ = await generate_all(EngineConfig(**kw), prompts)
    got, reports = await generate_all(EngineConfig(tensor_parallel_size=2, **kw), prompts)
    assert got == ref
    assert sorted(reports) == [0, 1] and all(r.alive_bytes == 0 for r in reports.values())


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="the shared-GPU case: exactly one device")
async def test_tp2_on_one_gpu_over_gloo_matches_tp1(hf_checkpoint) -> None:
    from engine.tp.group import backend_for

    assert backend_for(torch.device("cuda"), 2) == "gloo"
    path, _ = hf_checkpoint("tp-llama-gpu1")
    kw = dict(model=str(path), dtype="float32", device="cuda", kv_cache_bytes=64 << 20)
    prompts = [[5, 6, 7, 8], list(range(9, 60))]
    ref, _ = await generate_all(EngineConfig(**kw), prompts)
    got, reports = await generate_all(EngineConfig(tensor_parallel_size=2, **kw), prompts)
    print(f"\nTP=1 {ref}\nTP=2 on one GPU {got}; release reports {reports}")
    assert got == ref
    assert sorted(reports) == [0, 1] and all(r.alive_bytes == 0 for r in reports.values())

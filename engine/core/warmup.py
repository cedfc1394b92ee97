"""The warm-up at load: real steps through the normal step path before the engine says ready.

What a first request would otherwise pay while serving -- Triton kernels compiled (or loaded
from Triton's on-disk cache) for the prompt, decode, sampler and logprob paths, cuBLAS picking
its kernels, the first decode graphs captured -- is paid here instead, before
``AsyncEngine.start`` moves the lifecycle to SERVING (so before ``/health`` and ``/ready`` say
ready, and before ``AsyncEngine.open`` yields). The graphs themselves are captured by the
runner's load (``RunnerLoad._capture_mixed``: every mixed row count and, with ``warmup``, every
decode bucket); this runs the steps around them.

The steps run on a throwaway :class:`EngineCore` whose scheduler allocates from a throwaway
:class:`BlockManager` (prefix caching off) over the same KV tensor. At load no block holds
anything, so writing K/V into free blocks is harmless; the runner's own block manager (and its
prefix cache), the serving core's stats and requests are never touched. What the steps change
on the runner is put back: its step count, the speculator's counters, the sampler's noise seed
and the global RNG states, so that seeded and unseeded outputs are those of an engine without a
warm-up (``tests/test_warmup.py`` checks it).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Callable

import torch

from engine.kv.block_manager import BlockManager
from engine.memory.owner import Resource as R
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner

from .engine_core import EngineCore
from .scheduler import Scheduler

log = logging.getLogger("enginecore.warmup")

#: the longest warm-up prompt on CUDA (a first request's size class; the mixed graphs cover
#: every row count already, so this is about the eager parts around them)
CUDA_PROMPT = 600


def _variants(device_type: str) -> list[list[tuple[SamplingParams, bool]]]:
    """Rounds of requests, each round run to completion alone: one request as a first request
    comes (greedy, then sampled), then a batch with every sampler path that has kernels of its
    own (top-k/top-p seeded, min-p, penalties, logprobs and prompt logprobs). On CPU no kernel
    is compiled on first use: one short greedy request is enough to touch the paths. Each
    request with its prompt's size: True the longest, False a short one (prompt logprobs over a
    long prompt would take a [tokens, vocab] float block for nothing)."""
    greedy = SamplingParams(max_tokens=2, ignore_eos=True)
    if device_type != "cuda":
        return [[(greedy, True)]]
    return [
        [(greedy, True)],
        [(SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True), True)],
        [(SamplingParams(max_tokens=3, temperature=0.8, top_k=20, top_p=0.9, seed=0,
                         ignore_eos=True), True),
         (SamplingParams(max_tokens=3, temperature=0.7, min_p=0.05, ignore_eos=True), False),
         (SamplingParams(max_tokens=3, repetition_penalty=1.1, frequency_penalty=0.1,
                         ignore_eos=True), False),
         (SamplingParams(max_tokens=3, logprobs=True, top_logprobs=5, prompt_logprobs=2,
                         ignore_eos=True), False),
         (SamplingParams(max_tokens=3, temperature=1.0, logprobs=True, top_logprobs=1,
                         ignore_eos=True), False)],
    ]


def _warm_head(runner: ModelRunner) -> int:
    """The LM head once at every row count a step samples (1 .. ``max_num_seqs``), from the
    first rows and gathered from every other row as a mixed step's are; returns the count.

    Why: the head's GEMM is run eagerly (outside the graphs) at the step's row count, and cuBLAS
    picks a kernel per shape; a kernel's first launch loads its module (CUDA's lazy loading),
    which waits for the device. A burst goes through every count from 256 down to 1 as its
    requests finish, so a cold server stalled its pipeline at each new one (py-spy of the
    first vs the second burst of bench.serve on an H100: ~1 s more host time in the head and
    its row gather; the first burst ran 7.1 ms steps against 6.7). Measured by
    tools/logits_first_use.py: ~0.25 s at load for 256 counts. Not with tensor parallelism
    (the head gathers its vocabulary shards across the ranks: a driver-only call would wait
    for them)."""
    if runner.tensor_parallel:
        return 0
    model = runner.resource(R.WEIGHTS)
    rows = runner.config.max_num_seqs
    weight = model.model.norm.weight
    hidden = torch.zeros(2 * rows, weight.shape[0], dtype=weight.dtype, device=runner.device)
    with torch.inference_mode():
        for m in range(1, rows + 1):
            runner.head_logits(model, hidden, list(range(m)))
            runner.head_logits(model, hidden, list(range(1, 2 * m, 2)))
    return rows


def warm_up(runner: ModelRunner, should_stop: Callable[[], bool] = lambda: False) -> float:
    """Run the warm-up steps on ``runner`` (loaded, not serving); returns its seconds. Nothing
    it made outlives it; a failure propagates (the load then fails as a whole)."""
    t0 = time.perf_counter()
    cfg = runner.config
    state = runner.resource(R.MODEL_STATE)
    saved_rng = torch.get_rng_state()
    cuda = runner.device.type == "cuda"
    saved_cuda = torch.cuda.get_rng_state(runner.device) if cuda else None
    noise = (state._noise_base, state._noise_steps)
    steps = runner.steps
    spec = runner.speculator
    spec_stats = copy.deepcopy(spec.stats_) if spec is not None else None
    core = EngineCore(runner)
    blocks = BlockManager(runner.num_blocks, runner.block_size, enable_caching=False)
    core.blocks = blocks  # the throwaway's blocks, never the runner's (its prefix cache)
    core.scheduler = Scheduler(blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
    n_steps = 0
    try:
        vocab = runner.model_config.vocab_size
        longest = min(CUDA_PROMPT if cuda else 8, runner.max_model_len - 4,
                      runner.num_blocks * runner.block_size - 4)
        for k, round_ in enumerate(_variants(runner.device.type)):
            for i, (params, long) in enumerate(round_):
                n = max(1, (longest if long else min(longest, 24)) - i)
                prompt = [(17 + 31 * j + i) % vocab for j in range(n)]
                core.add_request(f"warmup-{k}-{i}", prompt, params)
            while core.has_work() and not should_stop():
                core.step()
                n_steps += 1
            if should_stop():
                core.abort_all("warm-up stopped")
                while core.has_work():
                    core.step()
                break
        if core.requests or blocks.usage:
            raise RuntimeError(f"warm-up left {len(core.requests)} request(s), "
                               f"{blocks.usage:.3f} of its blocks in use")
    finally:
        blocks.close()
        runner.steps = steps
        state._noise_base, state._noise_steps = noise
        if spec is not None:
            spec.stats_ = spec_stats
        torch.set_rng_state(saved_rng)
        if saved_cuda is not None:
            torch.cuda.set_rng_state(saved_cuda, runner.device)
    heads = _warm_head(runner) if cuda and not should_stop() else 0
    if cuda:
        torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - t0
    log.info("warm-up: %d steps, the LM head at %d row counts, in %.2fs", n_steps, heads, seconds)
    return seconds


__all__ = ["warm_up", "CUDA_PROMPT"]

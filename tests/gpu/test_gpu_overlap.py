"""GPU: overlapped scheduling against the synchronous engine, random:qwen3-0.6b bf16 with CUDA
graphs. The two run the same kernels on the same inputs in the same order (the next step's
input tokens are gathered on the device instead of copied from the host), so greedy and seeded
outputs must be identical; every request gets exactly one terminal output, also when aborted
while its token is in flight; memory is back to 0 B after shutdown. Run with ``-s``.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from engine import EngineConfig, ModelRunner, SamplingParams
from engine.core.engine_core import EngineCore

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(overlap: bool, temperature: float, aborts=()):
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    runner = ModelRunner(EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype="bfloat16",
                                      kv_cache_bytes=2 * 2**30, max_num_seqs=64,
                                      overlap_scheduling=overlap))
    runner.load()
    core = EngineCore(runner, check_integrity=True)
    for i in range(48):
        prompt = [(i * 131 + j * 7) % 50000 + 300 for j in range(5 + (i * 37) % 300)]
        core.add_request(f"r{i}", prompt, SamplingParams(
            max_tokens=8 + (i * 13) % 40, ignore_eos=True, temperature=temperature,
            seed=i if temperature else None))
    tokens: dict[str, list[int]] = {}
    final: dict[str, str] = {}
    steps, t0 = 0, time.perf_counter()
    while core.has_work():
        for o in core.step():
            assert o.request_id not in final
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                final[o.request_id] = o.finish_reason
        steps += 1
        if steps == 6:
            for rid in aborts:
                final[rid] = core.abort(rid, "test").finish_reason
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    deferred = core.deferred_steps
    runner.shutdown()
    del core, runner
    gc.collect()
    after = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    print(f"\noverlap={overlap} T={temperature}: {steps} steps ({deferred} deferred) in {dt:.2f}s; "
          f"memory before {before}, after shutdown {after}")
    assert after == before == (0, 0) or after == before
    return tokens, final


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_overlap_matches_synchronous_on_gpu(temperature):
    sync = _run(False, temperature)
    over = _run(True, temperature)
    assert over == sync
    assert len(over[1]) == 48


def test_abort_in_flight_on_gpu():
    tokens, final = _run(True, 0.0, aborts=("r3", "r40"))
    assert final["r3"] == "abort" and final["r40"] == "abort" and len(final) == 48


# -- output constraints keep the overlap ------------------------------------------------
def _run_constrained(overlap: bool, kinds: str):
    """``kinds`` "length": constrained requests that end by length (a regex longer than
    max_tokens) beside unconstrained ones, greedy and seeded -- every step's batch is the same
    in both modes, so bf16 gives the same tokens. "stop": requests whose grammar completes
    (a request ending in step N was already scheduled into N+1, so the batches differ between
    the modes and bf16 rows may too): valid outputs, one terminal output each."""
    import re

    import anyio

    from engine import StructuredOutputs
    from engine.structured.grammars import GrammarService

    runner = ModelRunner(EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype="bfloat16",
                                      kv_cache_bytes=2 * 2**30, max_num_seqs=64,
                                      overlap_scheduling=overlap))
    runner.load()
    core = EngineCore(runner, check_integrity=True)
    c = StructuredOutputs(regex="[a-z]{300}" if kinds == "length" else "(ab|cd){2,6}x")
    svc = GrammarService(lambda: core.tokenizer, lambda: runner.model_config.vocab_size)
    grammar = anyio.run(svc.compiled, c)
    for i in range(48):
        prompt = [(i * 131 + j * 7) % 50000 + 300 for j in range(5 + (i * 37) % 300)]
        constrained = i % 3 != 1
        core.add_request(f"r{i}", prompt, SamplingParams(
            max_tokens=8 + (i * 13) % 40, ignore_eos=True, structured=c if constrained else None,
            temperature=0.7 if i % 4 == 1 else 0.0, seed=i if i % 4 == 1 else None),
            grammar if constrained else None)
    tokens: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    final: dict[str, str] = {}
    while core.has_work():
        for o in core.step():
            assert o.request_id not in final
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            text[o.request_id] = text.get(o.request_id, "") + o.text
            if o.finished:
                final[o.request_id] = o.finish_reason
    late, deferred, steps = core.late_sampled_steps, core.deferred_steps, core.statistics().steps
    runner.shutdown()
    print(f"\noverlap={overlap} {kinds}: {steps} steps, {deferred} deferred, {late} sampled late, "
          f"{core.grammar_jobs} on the grammar worker")
    assert len(final) == 48
    if kinds == "stop":
        for i in range(48):
            if i % 3 != 1 and final[f"r{i}"] == "stop":
                assert re.fullmatch(r"(ab|cd){2,6}x", text[f"r{i}"]), text[f"r{i}"]
        assert "stop" in final.values()
    return {rid: (tokens.get(rid, []), final[rid]) for rid in final}, (late, deferred, steps)


def test_constrained_overlap_matches_synchronous_on_gpu():
    sync, _ = _run_constrained(False, "length")
    over, (late, deferred, steps) = _run_constrained(True, "length")
    assert over == sync
    assert set(f for _, f in over.values()) == {"length"}
    assert late > 0 and deferred > 0.8 * steps


def test_constrained_requests_that_complete_overlapped_on_gpu():
    _, (late, deferred, steps) = _run_constrained(True, "stop")
    assert late > 0 and deferred > 0.8 * steps

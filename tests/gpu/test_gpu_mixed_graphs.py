"""GPU: steps with prompt tokens replayed from CUDA graphs (engine/forward/mixed_inputs.py,
on by default; ``EngineConfig.mixed_cuda_graphs=False`` turns them off).

(a) The same packed steps (fresh prompts, chunks after context, decode rows beside chunks, a
    one-token chunk; two steps of one row count) replayed from the graphs the load captured
    (over the scratch block alone), and eagerly: fp32 logits and KV cache equal within
    cuBLAS's row-count-dependent rounding; bf16 argmax agreement.
(b) An engine serving 64 requests of mixed lengths with the mixed graphs and without: the
    greedy outputs (fp32), and mixed graphs captured and replayed.
(c) Load, serve, shut down with mixed graphs: ``memory_allocated`` / ``memory_reserved`` back
    to their pre-load values to the byte.

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["basic", "more"])
def test_graphed_prompt_steps_equal_eager_ones(dtype, variant):
    """``more``: the rarer shapes (chunks at the cap, long contexts, a decode row over two
    splits, in-flight tokens, stale inputs: tests/fused_check.py)."""
    from tests.fused_check import compare_mixed

    res = compare_mixed("random:qwen3-0.6b", "cuda", dtype, variant)
    print(f"\n{dtype} {variant}: {res}")
    # the load captured every row count up to the model state's rows; each step replayed one
    assert {64, 128, 192} <= set(res["mixed_rows"]), res
    assert res["replays"] == (4 if variant == "basic" else res["replays"]) > 0, res
    if dtype == "float32":
        assert res["logits_max_abs"] <= 1e-3 * max(1.0, res["logits_scale"]), res
        assert res["kv_max_abs"] <= 1e-3, res
        assert res["argmax_agree"] == 1.0, res
    else:
        assert res["argmax_agree"] >= 0.95, res


def _serve(mixed: bool, monkeypatch, dtype: str = "float32"):
    runner = ModelRunner(EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype=dtype,
                                      kv_cache_bytes=2 * 2**30, max_num_seqs=64,
                                      mixed_cuda_graphs=mixed,
                                      enable_prefix_caching=False))
    runner.load()
    core = EngineCore(runner)
    for i in range(64):
        plen = 5 + (i * 37) % 700
        prompt = [(i * 131 + j * 7) % 50000 + 300 for j in range(plen)]
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8 + i % 24, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
    g = runner._owner.get("cuda_graphs")
    info = dict(mixed=[k for k in g.captured if isinstance(k, tuple)], replays=g.replays,
                capture_s={str(k): v for k, v in g.capture_seconds.items()})
    info["order"] = runner.shutdown()
    return tokens, info


def test_engine_outputs_with_mixed_graphs(monkeypatch):
    eager, _ = _serve(False, monkeypatch)
    graphed, info = _serve(True, monkeypatch)
    same = sum(eager[r] == graphed[r] for r in eager)
    print(f"\nmixed graphs captured {info['mixed']}, {info['replays']} replays; identical "
          f"sequences {same}/{len(eager)}; capture s {info['capture_s']}")
    assert info["mixed"], "no step with prompt tokens was replayed from a graph"
    assert all(len(graphed[r]) == len(eager[r]) for r in eager)
    assert same >= 62, f"only {same}/64 greedy sequences identical in fp32"


def test_release_with_mixed_graphs_returns_every_byte(monkeypatch):
    base = baseline()
    for cycle in range(2):
        _, info = _serve(True, monkeypatch, "bfloat16")
        gc.collect()
        after = mem()
        print(f"\ncycle {cycle}: mixed graphs {info['mixed']}; released {info['order']}; "
              f"allocated {after[0] - base[0]:+d} B, reserved {after[1] - base[1]:+d} B")
        assert info["mixed"]
        assert after == base, f"allocated {after[0] - base[0]:+d} B, reserved {after[1] - base[1]:+d} B"

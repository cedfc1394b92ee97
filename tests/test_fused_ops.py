"""The Triton kernels (engine/ops/triton/fused_ops.py, triton_prefill.py, triton_attention.py), run on CPU
by Triton's interpreter.

The interpreter executes the kernels' own code (indexing, masks, the residual carried in place,
the q/k head split, the KV-cache write through the slot mapping) with numpy; in fp32 the fused
path must then equal the plain torch path up to reduction order. (The interpreter rounds fp32 to
bf16 by truncation, unlike CUDA, so the bf16 comparison is the GPU test's:
tests/gpu/test_gpu_fused.py.) Skipped where Triton is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("model", ["random:tiny-qwen3", "random:tiny-llama"])
def test_fused_path_equals_plain_path_fp32(model):
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("ENGINECORE_FUSED", None)
    out = subprocess.run([sys.executable, "-m", "tests.fused_check", model, "cpu", "float32"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["rows"] == 37 + 100 + 10 + 70 + 2  # every row of the three steps
    assert res["fused_views"] >= 2 * 5  # q/k/v and gate/up fused in both layers
    assert res["logits_max_abs"] <= 1e-4 * max(1.0, res["logits_scale"]), res
    assert res["kv_max_abs"] <= 1e-4, res
    assert res["argmax_agree"] == 1.0, res


def test_paged_decode_kernel_equals_torch_decode_fp32():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "tests.fused_check", "decode", "cpu"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["decode_max_abs"] <= 1e-5


def test_paged_prefill_kernel_plain_and_packed_equal_a_dense_reference_fp32():
    """engine/ops/triton/prefill_attention.py: the plain kernel (a program a query head) and the packed one
    (``KernelChoice.packed``: the query heads of a KV head in one program, also with a smaller
    key tile) give a dense torch attention's output, GQA 4, 2 and 1, over scattered blocks;
    so do the packed heads' rows interleaved in one block
    (``interleave``, the default: a part of the tile's queries a program), also over keys whose
    scores keep growing from tile to tile."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "tests.fused_check", "prefill", "cpu"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(res) == {"default", "plain", "packed2", "packed4_n32", "interleaved4"}
    assert max(res.values()) <= 1e-5, res


def test_prefill_kernel_choice_refuses_what_cannot_launch():
    from engine.ops.triton.prefill_attention import KernelChoice

    c = KernelChoice(packed=2, block_n=32, warps=8, stages=3)
    assert c.heads_per_program(4) == 2 and c.heads_per_program(1) == 1
    assert KernelChoice(packed=4).heads_per_program(2) == 2
    for bad in (dict(packed=3), dict(warps=6), dict(block_n=0)):
        with pytest.raises(ValueError):
            KernelChoice(**bad)


def test_fixed_shape_inputs_of_graphed_prompt_steps_equal_the_eager_ones_fp32():
    """engine/forward/mixed_inputs.py: steps with prompt chunks (fresh, after context, one-token) and
    decode rows, padded to their row count with tiles of an empty chunk and decode rows of the
    scratch block, give the eager inputs' logits and KV cache (the scratch block aside)."""
    res = _mixed("basic")
    assert res["mixed_rows"] == [192, 128, 64, 64]  # every step took the fixed-shape inputs
    assert res["rows"] == 157 + 81 + 64 + 2


def test_fixed_shape_inputs_of_rarer_prompt_steps_equal_the_eager_ones_fp32():
    """engine/forward/mixed_inputs.py, the rarer shapes (tests/fused_check.py ``_more_mixed_steps``):
    as many chunks as the cap, chunks after a context of many blocks, a decode row over two
    splits, every decode row real, in-flight tokens, stale tiles and tables of a wider step
    before; the fixed-shape inputs' decode rows through the Triton decode kernel (split-K and
    its reduce, several programs a sequence) against the eager torch decode path, over a KV
    cache of random values."""
    res = _mixed("more")
    assert res["mixed_rows"] == [256, 64, 64, 192]  # every step took the fixed-shape inputs
    assert res["rows"] == 213 + 45 + 57 + 130


def _mixed(variant: str) -> dict:
    """``tests.fused_check mixed`` in the interpreter (fp32): the fixed-shape inputs' logits and
    KV cache against the eager inputs', checked here; its figures returned."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "tests.fused_check", "mixed", "random:tiny-llama",
                          "cpu", "float32", variant], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["logits_max_abs"] <= 1e-4 * max(1.0, res["logits_scale"]), res
    assert res["kv_max_abs"] <= 1e-5, res
    assert res["argmax_agree"] == 1.0, res
    return res

"""GPU: the fused Triton path (engine/fused_ops.py, the paged prefill of engine/triton_prefill.py)
against the plain torch path, bf16.

The same three packed steps (two prefills, a chunk after a cached prefix, a decode batch) run
through both paths from an empty cache (``engine.fused_check.compare``). Every rounding to bf16
happens at the same point in both; only fp32 reduction order (and therefore a last-bit tie
now and then) differs, and 28 layers carry such one-ulp differences forward: the logits must
agree to within 3 % of their largest magnitude (measured: 1.2 % on Qwen3-0.6B, 1.8 % on
Llama-3.2-1B) and 90 % of the rows' argmax (near-flat random-weight logits tie often).
Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import pytest
import torch

from engine.fused_check import compare
from engine import fused_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not fused_ops.AVAILABLE, reason="needs Triton (and ENGINECORE_FUSED not 0)"),
]


@pytest.mark.parametrize("model", ["random:qwen3-0.6b", "random:llama-3.2-1b"])
def test_fused_logits_match_plain_bf16(model):
    res = compare(model, "cuda", "bfloat16", reference=True)
    print(f"\n{model}: {res}")
    # bf16 rounding differs between the paths: the fused path must be no further from float32
    # (on the same weights) than the plain path is, within a margin
    assert res["fused_vs_fp32"] <= 1.5 * res["plain_vs_fp32"] + 1e-3, res
    assert res["logits_max_abs"] <= 0.05 * max(1.0, res["logits_scale"]), res
    assert res["argmax_agree"] >= 0.9, res


def test_fused_logits_match_plain_fp32():
    res = compare("random:qwen3-0.6b", "cuda", "float32")
    print(f"\nfp32: {res}")
    assert res["logits_max_abs"] <= 1e-3 * max(1.0, res["logits_scale"]), res
    assert res["argmax_agree"] == 1.0, res

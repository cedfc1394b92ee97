"""The fused decoder path (engine/fused_ops.py) against the plain torch path on one model.

``compare(model, device, dtype)`` runs the same packed steps -- two prefills, then two chunks
after context (one over 64 queries long), then a decode batch -- through both paths from an empty KV cache
and returns the largest absolute differences of the logits and of the KV cache, and the
fraction of rows whose argmax agrees. Used by tests/test_fused_ops.py (CPU, Triton's
interpreter, fp32) and tests/gpu/test_gpu_fused.py (bf16 on CUDA).
"""

from __future__ import annotations

import torch

from . import fused_linears
from .config import EngineConfig
from .owner import Resource as R
from .runner import ModelRunner
from .step_inputs import packed_forward


def _runner(model: str, device: str, dtype: str) -> ModelRunner:
    r = ModelRunner(EngineConfig(model=model, device=device, dtype=dtype, kv_cache_bytes=2**26,
                                 max_num_seqs=8, cuda_graphs=False, enable_prefix_caching=False))
    r.load()
    return r


def _agree(a: torch.Tensor, b: torch.Tensor) -> float:
    # counted, not a float mean: a mean of ones on CUDA can come back as 0.99999994
    return int((a.argmax(-1) == b.argmax(-1)).sum().item()) / a.shape[0]


def compare(model: str, device: str, dtype: str, reference: bool = False) -> dict:
    """With ``reference``, both paths are also measured against the plain path in float32 on
    the same (``dtype``-rounded) weights: ``plain_vs_fp32`` / ``fused_vs_fp32`` say whether the
    fused path's rounding is of the plain path's size."""
    r = _runner(model, device, dtype)
    try:
        lm, kv, st = r.resource(R.WEIGHTS), r.resource(R.KV_CACHE), r.resource(R.MODEL_STATE)
        b = list(range(4, 15))  # 11 blocks: 176 tokens at block size 16
        steps = [
            [(list(range(5, 42)), 0, [1, 2, 3], False), (list(range(9, 109)), 0, b, False)],
            # chunks after context (a cached prefix, a long prompt's next chunk): > 64 queries
            [(list(range(50, 60)), 37, [1, 2, 3], False), (list(range(200, 270)), 100, b, False)],
            [([7], 47, [1, 2, 3], True), ([8], 170, b, True)],  # decodes
        ]

        def run(fused: bool, runner: ModelRunner = r):
            m, cache = runner.resource(R.WEIGHTS), runner.resource(R.KV_CACHE).tensor
            m.use_fused = fused
            cache.zero_()
            outs = []
            with torch.inference_mode():
                for seqs in steps:
                    h = packed_forward(m, cache, runner.resource(R.MODEL_STATE), None,
                                       runner.device, runner.block_size, seqs)
                    outs.append(m.logits(h).float())
            m.use_fused = None
            return torch.cat(outs), cache.float().clone()

        (la, ka), (lb, kb) = run(False), run(True)
        res = {"logits_max_abs": (la - lb).abs().max().item(),
               "logits_scale": la.abs().max().item(),
               "kv_max_abs": (ka - kb).abs().max().item(),
               "argmax_agree": _agree(la, lb),
               "rows": la.shape[0],
               # checkpoint tensors living in fused q/k/v, gate/up weights (fused_linears)
               "fused_views": len(fused_linears.views(lm))}
        if reference:
            ref = _runner(model, device, "float32")
            try:
                with torch.no_grad():
                    for pr, pb in zip(ref.resource(R.WEIGHTS).parameters(), lm.parameters()):
                        pr.copy_(pb.float())
                lr, _ = run(False, ref)
            finally:
                ref.shutdown()
            res["plain_vs_fp32"] = (la - lr).abs().max().item()
            res["fused_vs_fp32"] = (lb - lr).abs().max().item()
        return res
    finally:
        r.shutdown()


def compare_decode(device: str = "cpu") -> float:
    """The Triton paged decode kernel against the torch decode path on random caches (GQA 4
    and 1, contexts from 1 token to more than one split); the largest absolute difference."""
    from . import triton_attention as ta
    from .attention import AttentionMetadata, decode_attention_torch

    if device == "cpu":  # Triton's interpreter: no device properties to size the grid from
        ta._sm_count = lambda dev: 4
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for heads, kv_heads, dim, lens in [(8, 2, 64, [17, 100, 1100]), (4, 4, 32, [1, 33])]:
        bs, nb = 16, 240  # 1,100 tokens: more than one split (SPLIT_TOKENS)
        cache = torch.randn(2, nb, bs, kv_heads, dim, generator=g).to(device)
        width = max(-(-n // bs) for n in lens)
        bt = (torch.randperm(nb - 1, generator=g)[: len(lens) * width] + 1).view(len(lens), width)
        q = torch.randn(len(lens), heads, dim, generator=g).to(device)
        rows, cl, bt = (torch.arange(len(lens)).to(device), torch.tensor(lens).to(device),
                        bt.to(device))
        out, ref = torch.zeros_like(q), torch.zeros_like(q)
        ta.decode_attention(q, cache, rows, bt, cl, dim ** -0.5, out)
        meta = AttentionMetadata(torch.zeros(len(lens), dtype=torch.long), [], rows, bt, cl,
                                 max(lens))
        decode_attention_torch(q, cache, meta, dim ** -0.5, ref)
        worst = max(worst, (out - ref).abs().max().item())
    return worst


if __name__ == "__main__":  # python -m engine.fused_check MODEL DEVICE DTYPE -> one JSON line
    import json                # python -m engine.fused_check decode DEVICE
    import sys

    if sys.argv[1] == "decode":
        print(json.dumps({"decode_max_abs": compare_decode(sys.argv[2])}))
    else:
        print(json.dumps(compare(*sys.argv[1:4])))

"""GPU: the fused Triton path (engine/ops/triton/fused_ops.py, the paged prefill of engine/ops/triton/prefill_attention.py)
against the plain torch path, bf16.

The same three packed steps (two prefills, a chunk after a cached prefix, a decode batch) run
through both paths from an empty cache (``tests.fused_check.compare``). Every rounding to bf16
happens at the same point in both; only fp32 reduction order (and therefore a last-bit tie
now and then) differs, and 28 layers carry such one-ulp differences forward: the logits must
agree to within 3 % of their largest magnitude (measured: 1.2 % on Qwen3-0.6B, 1.8 % on
Llama-3.2-1B) and 90 % of the rows' argmax (near-flat random-weight logits tie often).
Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import pytest
import torch

from engine.ops.triton import fused_ops
from tests.fused_check import compare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not fused_ops.AVAILABLE, reason="needs Triton"),
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


def test_one_pass_sampler_draws_softmax_and_takes_first_max_on_cuda(monkeypatch):
    """engine/ops/triton/fused_sample.py on the device at Qwen3's vocabulary: 8,192 rows whose mass sits on
    4 tokens spread over the vocabulary draw each with its probability (T = 1 and 0.7); greedy
    rows equal torch.argmax (ties included); refused (-inf) tokens are never drawn. Prints the
    one-pass time against the torch path's at 256 rows (run with -s)."""
    from engine.ops.triton import fused_sample
    from engine.sample.sampler import SamplingBatch, sample

    dev = torch.device("cuda")
    vocab, rows = 151_936, 8192
    cols = torch.tensor([7, 40_000, 99_999, 151_935], device=dev)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], device=dev)
    logits = torch.full((rows, vocab), float("-inf"), device=dev)
    logits[:, cols] = p.log()
    for t in (1.0, 0.7):
        toks = fused_sample.sample(logits, torch.full((rows,), t, device=dev), 11)
        assert torch.isin(toks, cols).all()
        freq = torch.stack([(toks == c).float().mean() for c in cols])
        want = p ** (1 / t) / (p ** (1 / t)).sum()
        assert (freq - want).abs().max() < 0.03, (t, freq.tolist(), want.tolist())
    g = torch.randn(64, vocab, device=dev).bfloat16().float()  # bf16 values: many ties
    g[:, 123_456] = g[:, 5] = 10.0
    assert torch.equal(fused_sample.sample(g, torch.zeros(64, device=dev), 1), g.argmax(-1))

    x = torch.randn(256, vocab, device=dev)
    temp = torch.full((256,), 0.6, device=dev)
    base = dict(temperature=temp, top_k=torch.zeros(256, dtype=torch.long, device=dev),
                top_p=torch.ones(256, device=dev), generators=[None] * 256, all_greedy=False,
                need_logprobs=False, any_top_k=False, any_top_p=False)
    times = {}
    for name, seed in (("one pass", 5), ("torch", None)):
        b = SamplingBatch(**base, noise_seed=seed)
        for _ in range(3):
            sample(x, b)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            sample(x, b)
        end.record()
        end.synchronize()
        times[name] = start.elapsed_time(end) / 20
    print(f"\nsampling 256 x {vocab}: one pass {times['one pass']:.3f} ms, torch {times['torch']:.3f} ms")


def test_greedy_one_pass_with_masks_equals_masked_argmax_on_cuda(monkeypatch):
    """``greedy=True`` (no noise; from 128 rows one program a row writing the tokens) at Qwen3's
    vocabulary gives the first maximum of the masked logits, as zero temperatures do, at 256
    rows (one program a row) and 8 (split); prints its time against the noisy pass's (-s)."""
    from engine.ops.triton import fused_sample
    from engine.ops.triton.fused_sample import GrammarRows

    dev = torch.device("cuda")
    vocab = 151_936
    words_n = -(-151_665 // 32)  # a grammar vocabulary short of the logits' (Qwen's padding)
    for rows in (256, 8):
        g = torch.randn(rows, vocab, device=dev).bfloat16().float()  # many ties
        g[:, 99] = g[:, 151_000] = 10.0
        words = torch.randint(-2**31, 2**31 - 1, (rows, words_n), device=dev, dtype=torch.int64
                              ).to(torch.int32)
        words[:, 99 // 32] |= 1 << (99 % 32)
        ids = torch.arange(vocab, device=dev)
        w = ids // 32
        allow = torch.zeros(rows, vocab, dtype=torch.bool, device=dev)
        inside = w < words_n
        allow[:, inside] = ((words.long()[:, w[inside]] >> (ids[inside] % 32)) & 1).bool()
        want = g.masked_fill(~allow, float("-inf")).argmax(-1)
        zero = torch.zeros(rows, device=dev)
        got = fused_sample.sample(g, zero, 3, GrammarRows(words, None), greedy=True)
        assert fused_sample.splits_for(rows, vocab, True) == (1 if rows == 256 else 16)
        assert got.dtype == torch.long and torch.equal(got, want), rows
        assert torch.equal(got, fused_sample.sample(g, zero, 3, GrammarRows(words, None)))
        if rows == 256:
            timed = (g, zero, GrammarRows(words, None))
    g, zero, m = timed
    times = {}
    for name, greedy in (("greedy", True), ("noisy", False)):
        for _ in range(3):
            fused_sample.sample(g, zero, 3, m, greedy=greedy)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fused_sample.sample(g, zero, 3, m, greedy=greedy)
        end.record()
        end.synchronize()
        times[name] = start.elapsed_time(end) / 20
    print(f"\nmasked greedy 256 x {vocab}: {times['greedy']:.3f} ms, noisy pass "
          f"{times['noisy']:.3f} ms")


def test_prefill_kernel_plain_and_packed_equal_a_dense_reference_fp32():
    """engine/ops/triton/prefill_attention.py's default launch (query heads interleaved two a program) and
    the plain one (a program a head) against a dense torch attention, fp32 (IEEE dots), GQA 4,
    2 and 1 (the other choices are checked in the interpreter: each fp32 variant compiles for
    ~10 s here)."""
    from tests.fused_check import compare_prefill

    res = compare_prefill("cuda", ["default", "plain"])
    print(res)
    assert max(res.values()) <= 1e-4, res

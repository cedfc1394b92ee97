"""Temperature sampling in one pass over the logits (Triton; CUDA, or Triton's CPU interpreter in
tests): the Gumbel-max draw ``argmax(logits / T + G)``, ``G = -log(-log(U))``, U uniform -- the
same distribution as the sampler's exponential race ``argmax(softmax(logits / T) / E)``
(engine/sample/sampler.py), without the softmax, the noise tensor and the divisions between them.
Rows with ``T <= 0`` take the plain argmax (the first index of the maximum, as ``torch.argmax``).

Why by hand: the torch form is ~8 full passes over a [rows, vocab] fp32 tensor (the division by
T, softmax, the exponential noise, its division, two argmaxes, copies): ~1 ms a step at 256 rows
of Qwen3's 151,936 logits on the H200, a quarter of a decode step at context 256. Here each row
is read once, split over several programs so that a small batch still fills the GPU; a tiny
second pass picks each row's winner among its splits.

Only for the plain case: no top-k / top-p / min-p, no seeded row (a seeded request draws its
noise from its own ``torch.Generator``, so its tokens do not depend on the batch: that stays the
torch path's), a noise seed given by the caller (``SamplingBatch.noise_seed``: per step, from
``ModelState.next_noise_seed``).

On by default on CUDA since tests/gpu/test_gpu_fused.py passed on the H200 (the
draws follow softmax(logits / T) within 0.03 over 8,192 rows, greedy rows equal torch.argmax with
ties, refused tokens are never drawn; 256 x 151,936 logits in 0.243 ms against the torch path's
0.591). The ``fused`` kill switch (engine/envs.py) turns it off with the other fused kernels.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .fused_ops import AVAILABLE, INTERPRET, tl, triton

#: columns one program reads per iteration
BLOCK = 2048
#: rows x splits aimed at: enough programs to fill the device for any batch
TARGET_PROGRAMS = 512
#: the same for an all-greedy batch (no noise: a plain read of the logits, bound by memory,
#: not by the noise's arithmetic): from 128 rows on, one program a row, whose winner is then
#: the token, written as such (no second pass on the host's critical path)
GREEDY_TARGET_PROGRAMS = 128


class GrammarRows(NamedTuple):
    """Grammar masks for :func:`sample` on the logits' device: ``words`` [R, W] int32, row r
    the mask of logits row r (bit j of word w allows id 32 w + j; ids past 32 W refused);
    ``flags`` [R] (nonzero: the row is masked), None when every row below R is."""

    words: torch.Tensor
    flags: Optional[torch.Tensor]


def usable(logits: torch.Tensor) -> bool:
    return AVAILABLE and (logits.is_cuda or INTERPRET) and logits.dim() == 2


def usable_on(device: torch.device) -> bool:
    """Whether the sampler runs on ``device`` (CUDA, or any under Triton's interpreter)."""
    return AVAILABLE and (device.type == "cuda" or INTERPRET)


def splits_for(rows: int, vocab: int, greedy: bool = False) -> int:
    """Programs per row: enough for ``TARGET_PROGRAMS`` (``GREEDY_TARGET_PROGRAMS``) in all,
    each at least one block."""
    target = GREEDY_TARGET_PROGRAMS if greedy else TARGET_PROGRAMS
    return max(1, min(-(-target // max(rows, 1)), -(-vocab // BLOCK)))


if triton is not None:

    # (the seed changes every step, the span and the splits with the batch: Triton would compile
    # another variant whenever one of them turns 1 or a multiple of 16)
    @triton.jit(do_not_specialize=["seed", "span", "n_splits", "m_rows"])
    def _gumbel_argmax_kernel(L, T, VAL, IDX, stride, vocab, span, seed, n_splits,
                              M, MF, m_words, m_rows, BLOCK: tl.constexpr, MASK: tl.constexpr,
                              GREEDY: tl.constexpr = False, ONE: tl.constexpr = False):
        # GREEDY: every row's temperature is <= 0 (no noise drawn); ONE: one program a row,
        # IDX [rows] int64 takes the token itself and VAL is not written
        row = tl.program_id(0)
        part = tl.program_id(1)
        t = tl.load(T + row)
        noisy = t > 0.0
        inv_t = 1.0 / tl.where(noisy, t, 1.0)
        # MASK 1: rows below m_rows take their grammar mask (M's row of the same index, m_words
        # int32 words, bit j of word w allowing id 32 w + j; ids past the words refused);
        # MASK 2: the rows below m_rows whose MF flag is set
        masked = row < m_rows
        if MASK == 2:
            masked = masked & (tl.load(MF + tl.minimum(row, m_rows - 1)) != 0)
        limit = m_words * masked.to(tl.int32)  # words read: none for a row without a mask
        unmasked = masked.to(tl.int32) - 1  # all bits set: every id allowed
        lo = part * span
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.full([BLOCK], 2147483647, tl.int32)
        for start in range(0, span, BLOCK):
            cols = lo + start + tl.arange(0, BLOCK)
            mask = (cols < vocab) & (start + tl.arange(0, BLOCK) < span)
            x = tl.load(L + row.to(tl.int64) * stride + cols, mask=mask,
                        other=float("-inf")).to(tl.float32)
            if GREEDY:
                s = x
            else:
                u = tl.rand(seed, row.to(tl.int64) * vocab + cols)
                g = -tl.log(-tl.log(u))
                s = tl.where(noisy, x * inv_t + g, x)
            if MASK != 0:
                w = cols // 32
                word = tl.load(M + row.to(tl.int64) * m_words + w, mask=mask & (w < limit),
                               other=0)
                allowed = (((word | unmasked) >> (cols % 32)) & 1) != 0
                s = tl.where(allowed, s, float("-inf"))
            s = tl.where(mask, s, float("-inf"))
            take = s > best  # strict: a lane keeps its earliest column on ties
            best = tl.where(take, s, best)
            best_i = tl.where(take, cols, best_i)
        m = tl.max(best, axis=0)
        # the first column holding the maximum (a row of -inf: its first column)
        i = tl.min(tl.where(best == m, best_i, 2147483647), axis=0)
        i = tl.where(i == 2147483647, lo, i)
        if not ONE:
            tl.store(VAL + row * n_splits + part, m)
        tl.store(IDX + row * n_splits + part, i)


def sample(logits: torch.Tensor, temperature: torch.Tensor, seed: int,
           mask: Optional["GrammarRows"] = None, greedy: bool = False) -> torch.Tensor:
    """One token per row of ``logits`` [N, V]: a Gumbel-max draw at the row's ``temperature``
    [N] (fp32 on the logits' device), the argmax where it is <= 0. ``seed``: this step's noise
    (the same seed and logits give the same tokens). ``mask``: grammar masks read in the same
    pass (the ids a row's mask refuses are never drawn, as if their logits were -inf; the
    logits are left as they are). ``greedy``: the caller knows every temperature is <= 0 (no
    noise is drawn: the same tokens, a plain read of the logits). Returns [N] long."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n = splits_for(rows, vocab, greedy)
    span = -(-vocab // n)
    one = n == 1
    if one:  # the kernel writes the tokens: no second pass (host calls) to pick a split
        idx = torch.empty(rows, dtype=torch.int64, device=logits.device)
        vals = idx  # (not written)
    else:
        vals = torch.empty((rows, n), dtype=torch.float32, device=logits.device)
        idx = torch.empty((rows, n), dtype=torch.int32, device=logits.device)
    if mask is None:
        words, flags, m_words, m_rows, mode = logits, logits, 1, 0, 0
    else:
        words, flags = mask.words, (mask.flags if mask.flags is not None else mask.words)
        m_words, m_rows = mask.words.shape[1], mask.words.shape[0]
        mode = 1 if mask.flags is None else 2
    _gumbel_argmax_kernel[(rows, n)](logits, temperature, vals, idx, logits.stride(0), vocab, span,
                                    seed & 0x7FFFFFFF, n, words, flags, m_words, m_rows,
                                    BLOCK=BLOCK, MASK=mode, GREEDY=greedy, ONE=one)
    if one:
        return idx
    # the earliest split holding the row's maximum holds its first maximal column
    return idx.gather(1, vals.argmax(1, keepdim=True)).squeeze(1).long()

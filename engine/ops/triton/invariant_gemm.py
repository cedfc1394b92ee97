"""The batch-invariant GEMM of deterministic mode on CUDA (engine/model/invariant.py; the
attention is engine/ops/triton/invariant.py, whose docstring says why these are written by hand).

:func:`linear`: one program per ``BLOCK_M x BLOCK_N`` tile of the output, its ``K`` loop in
``BLOCK_K`` steps from 0 in order, no split-K, one configuration for every row count. A tensor-core
MMA computes each output element from its own row and column, so a row's values do not depend on
the other rows of its tile or on how many tiles there are. With ``parts``, the same kernel runs
the ``K`` loop once per slice of the input, rounds each slice's product to the input's dtype
(the o/down projections of engine/model/invariant.py: one slice per KV head's share) or not
(the q/k/v and gate/up projections: fixed slices of the input) and adds them in order. A
decode step's few rows make few output tiles, too few programs to stream the weight at the
device's bandwidth (16 for the o/down projections of a 0.6B model on 132 SMs): there each
slice runs in a program of its own, stores its product in float32, and a second launch adds
them in the same order -- the same arithmetic, so the same bits, as one program looping over
the slices (checked bitwise in tests/unit/test_invariant_triton.py); which launch runs depends
on the row count, the bits do not.

With ``FLAT_ROWS`` set (off for now: not yet measured on a device), prompt-sized launches run as
one loop over every input (``_gemm_flat_kernel``): the same per-slice products added in the same
order, tiles chosen by the autotuner. Integer arguments that vary with the batch are not
specialized.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .fused_ops import tl, triton

#: the GEMM's one configuration (tensor-core tiles; bf16 / fp16 / fp32 inputs, fp32 accumulation)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


if triton is not None:

    @triton.jit
    def _slice_product(X, W, rows, cols, p, m, n, k, stride_x, stride_w,
                       IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # slice p of the input dimension (inputs p * k .. p * k + k - 1): its product, float32,
        # the K loop in BK steps from the slice's first input, in order
        ks = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, k, BK):
            kk = k0 + ks
            a = tl.load(X + rows[:, None] * stride_x + (p * k + kk)[None, :],
                        mask=(rows[:, None] < m) & (kk[None, :] < k), other=0.0)
            b = tl.load(W + cols[None, :] * stride_w + (p * k + kk)[:, None],
                        mask=(cols[None, :] < n) & (kk[:, None] < k), other=0.0)
            if IEEE:  # float32 inputs: no TF32 rounding
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit(do_not_specialize=["m"])
    def _gemm_kernel(X, W, Y, m, n, k, stride_x, stride_w, stride_y, stride_yp,
                     IEEE: tl.constexpr, PARTS: tl.constexpr, SUM: tl.constexpr,
                     ROUND: tl.constexpr, SPLIT: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # ``PARTS`` slices of ``k`` inputs each; ROUND: slice p's product rounded to X's dtype.
        # SUM: the slices' products added in order in float32, stored in Y's dtype; else each
        # slice's product stored (float32) at Y + p * stride_yp. SPLIT: this program computes
        # the one slice program_id(2) (stored as without SUM; _sum_kernel adds them). One
        # slice: a plain GEMM.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        out_mask = (rows[:, None] < m) & (cols[None, :] < n)
        if SPLIT:
            p = tl.program_id(2)
            part = _slice_product(X, W, rows, cols, p, m, n, k, stride_x, stride_w, IEEE, BM, BN, BK)
            if ROUND:
                part = part.to(X.dtype.element_ty).to(tl.float32)
            tl.store(Y + p * stride_yp + rows[:, None] * stride_y + cols[None, :], part,
                     mask=out_mask)
        else:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for p in tl.static_range(PARTS):
                part = _slice_product(X, W, rows, cols, p, m, n, k, stride_x, stride_w, IEEE, BM, BN, BK)
                if ROUND:
                    part = part.to(X.dtype.element_ty).to(tl.float32)
                if SUM:
                    if p == 0:
                        total = part
                    else:
                        total = total + part
                else:
                    tl.store(Y + p * stride_yp + rows[:, None] * stride_y + cols[None, :], part,
                             mask=out_mask)
            if SUM:
                tl.store(Y + rows[:, None] * stride_y + cols[None, :],
                         total.to(Y.dtype.element_ty), mask=out_mask)

    @triton.jit(do_not_specialize=["m", "m_class"])
    def _gemm_flat_kernel(X, W, Y, m, n, k, stride_x, stride_w, stride_y, m_class,
                          IEEE: tl.constexpr, PARTS: tl.constexpr, ROUND: tl.constexpr,
                          GROUP_M: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # _gemm_kernel's SUM launch (slices of k inputs, k a multiple of BK) as one loop over
        # every input, so that the loads pipeline across the slices' boundaries: the same
        # per-slice products (each from zero, in BK steps in order), rounded or not, added in
        # order -- the same bits. Tiles in groups of GROUP_M rows of tiles (a weight tile read
        # from L2 by the group).
        # m_class (unread): the autotuner's key for the row count (_flat_tuned)
        pid = tl.program_id(0)
        num_m = tl.cdiv(m, BM)
        num_n = tl.cdiv(n, BN)
        group = GROUP_M * num_n
        first = (pid // group) * GROUP_M
        size = tl.minimum(num_m - first, GROUP_M)
        pid_m = first + (pid % group) % size
        pid_n = (pid % group) // size
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        steps = k // BK
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for i in range(0, PARTS * steps):
            kk = i * BK + ks
            a = tl.load(X + rows[:, None] * stride_x + kk[None, :], mask=rows[:, None] < m, other=0.0)
            b = tl.load(W + cols[None, :] * stride_w + kk[:, None], mask=cols[None, :] < n, other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            if (i + 1) % steps == 0:  # a slice's end
                part = acc
                if ROUND:
                    part = part.to(X.dtype.element_ty).to(tl.float32)
                if i + 1 == steps:
                    total = part
                else:
                    total = total + part
                acc = tl.zeros((BM, BN), dtype=tl.float32)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], total.to(Y.dtype.element_ty),
                 mask=(rows[:, None] < m) & (cols[None, :] < n))

    @triton.jit(do_not_specialize=["total"])
    def _sum_kernel(P, Y, total, stride_p, PARTS: tl.constexpr, BLOCK: tl.constexpr):
        # Y = P[0] + P[1] + ... in order, float32, stored in Y's dtype (``_gemm_kernel`` with
        # SUM adds its slices the same way)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        acc = tl.load(P + offs, mask=mask, other=0.0)
        for p in tl.static_range(1, PARTS):
            acc = acc + tl.load(P + p * stride_p + offs, mask=mask, other=0.0)
        tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=mask)


#: elements a program of _sum_kernel adds
SUM_BLOCK = 1024
#: from this many rows (a prompt step) the GEMM runs _gemm_flat_kernel, its tiles picked by
#: Triton's autotuner per shape and row-count class (powers of two) among FLAT_CONFIGS (BM, BN,
#: warps, stages): which tiles a GEMM runs does not change a row's bits -- the K order is the
#: same (_gemm_kernel under 10 tile shapes gave its 64 x 64 tiles' bits at 1-2,048 rows on the
#: H100, tools/invariant_gemm_tiles.py), so a timing choice is safe here. None: off. NOTE: off
#: until measured on a GPU -- the one-loop kernel equals _gemm_kernel bit for bit in Triton's
#: interpreter (tests/unit/test_invariant_triton.py), not yet on a device, and its speed is
#: unmeasured (prompt steps' GEMMs were 60 % of their device time, 2.5-4x cuBLAS's at 2,048
#: rows, H100 2026-12-08); 256 is the intended value.
FLAT_ROWS: Optional[int] = None
FLAT_CONFIGS = ((128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4))


@functools.lru_cache(maxsize=None)
def _flat_tuned():
    """_gemm_flat_kernel under the autotuner (CUDA only: made at first use)."""
    configs = [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st)
               for bm, bn, w, st in FLAT_CONFIGS]
    return triton.autotune(configs, key=["n", "k", "m_class", "PARTS", "ROUND"])(_gemm_flat_kernel)


@functools.lru_cache(maxsize=None)
def programs_wanted(device: torch.device) -> int:
    """A GEMM whose output tiles are fewer than this runs its slices in programs of their own
    (the streaming multiprocessors; 4 in Triton's CPU interpreter, for the tests)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _gemm(x: torch.Tensor, weight: torch.Tensor, parts: int, summed: bool, rounded: bool = True,
          split: Optional[bool] = None) -> torch.Tensor:
    k, n = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    w = w.to(rows.dtype)
    m = rows.shape[0]
    if k % parts:
        raise ValueError(f"invariant GEMM: {k} inputs do not split into {parts} slices")
    tiles = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    # a slice a program, then the in-order sum (the same bits either way: module docstring)
    split = summed and parts > 1 and (
        split if split is not None else tiles[0] * tiles[1] < programs_wanted(x.device))
    y = (torch.empty(m, n, dtype=x.dtype, device=x.device) if summed
         else torch.empty(parts, m, n, dtype=torch.float32, device=x.device))
    if not m:
        return y
    flags = dict(IEEE=rows.dtype == torch.float32, PARTS=parts, ROUND=rounded,
                 BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=4, num_stages=3)
    if (FLAT_ROWS is not None and summed and not split and m >= FLAT_ROWS
            and (k // parts) % BLOCK_K == 0 and x.device.type == "cuda"):
        _flat_tuned()[lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)](
            rows, w, y, m, n, k // parts, rows.stride(0), w.stride(0), y.stride(0), m.bit_length(),
            IEEE=rows.dtype == torch.float32, PARTS=parts, ROUND=rounded,
            GROUP_M=8, BK=BLOCK_K)
        return y
    if split:
        part = torch.empty(parts, m, n, dtype=torch.float32, device=x.device)
        _gemm_kernel[(*tiles, parts)](rows, w, part, m, n, k // parts, rows.stride(0), w.stride(0),
                                      part.stride(-2), part.stride(0), SUM=False, SPLIT=True, **flags)
        _sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](part, y, m * n, part.stride(0),
                                                    PARTS=parts, BLOCK=SUM_BLOCK)
        return y
    _gemm_kernel[tiles](rows, w, y, m, n, k // parts, rows.stride(0), w.stride(0),
                        y.stride(-2), 0 if summed else y.stride(0), SUM=summed, SPLIT=False, **flags)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, parts: int = 1,
           rounded: bool = True, split: Optional[bool] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with a row's result independent of the other rows.
    ``parts``: the input dimension in that many equal slices, each slice's product (rounded to
    x's dtype with ``rounded``) added in order in float32 (:func:`partial_products` summed).
    With few output tiles (a decode step's rows) each slice runs in a program of its own and a
    second launch adds them; else one program loops over the slices: the same arithmetic, the
    same bits (``split`` forces one or the other: tests)."""
    n = weight.shape[0]
    y = _gemm(x, weight, parts, summed=True, rounded=rounded, split=split)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


def partial_products(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """``[parts, *x.shape[:-1], N]`` float32: the product of each of ``parts`` equal slices of
    the input dimension, rounded to x's dtype (what :func:`linear` with ``parts`` adds up)."""
    return _gemm(x, weight, parts, summed=False).view(parts, *x.shape[:-1], weight.shape[0])


__all__ = ["linear", "partial_products", "programs_wanted", "BLOCK_M", "BLOCK_N", "BLOCK_K", "FLAT_ROWS"]

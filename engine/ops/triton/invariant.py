"""Batch-invariant GEMM and paged attention for deterministic mode on CUDA
(engine/model/invariant.py).

Why by hand: on the GPU neither cuBLAS nor torch's reductions promise a row's result whatever the
rows beside it. cuBLAS picks its algorithm (split-K among them) by the problem's shape, and torch's
reduction kernels size their thread blocks by the number of outputs (one row's sum spread over 512
threads, a thousand rows' over 32 each): the same token then got other bits alone than in a batch
(measured on an H100: logprobs differed from the second token on, the CPU-tiled ``bmm`` of
engine/model/invariant.py included). Here every launch is one compiled kernel whose per-row
arithmetic is fixed at compile time:

* :func:`linear`: one program per ``BLOCK_M x BLOCK_N`` tile of the output, its ``K`` loop in
  ``BLOCK_K`` steps from 0 in order, no split-K, one configuration for every row count. A tensor-core
  MMA computes each output element from its own row and column, so a row's values do not depend on
  the other rows of its tile or on how many tiles there are. With ``parts``, the same kernel runs
  the ``K`` loop once per slice of the input, rounds each slice's product to the input's dtype and
  adds them in order (the o/down projections of engine/model/invariant.py: one launch instead of
  a GEMM, a copy and a cast per slice and an add per slice).
* :func:`attention`: one program per (query row, KV head), its GQA query heads together; the row's
  keys ``0 .. len - 1`` read through its own block table in chunks of ``BLOCK_N`` from key 0 with an
  online softmax. The chunks' boundaries depend only on the key positions, so a key computed this
  step, by an earlier chunk of the prompt or by another request (a cached prefix) is added at the
  same point of the same sum.
* RMSNorm: engine/ops/triton/fused_ops.py's kernel already reduces one row per program.

Integer arguments that vary with the batch are not specialized (``do_not_specialize``): one
compiled variant serves every batch.
"""

from __future__ import annotations

import torch

from .fused_ops import AVAILABLE, INTERPRET, tl, triton

#: the GEMM's one configuration (tensor-core tiles; bf16 / fp16 / fp32 inputs, fp32 accumulation)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
#: keys per step of the attention's online softmax
KEYS = 16


def usable(device: torch.device) -> bool:
    """Whether these kernels can run on ``device``."""
    return AVAILABLE and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))


if triton is not None:

    @triton.jit(do_not_specialize=["m"])
    def _gemm_kernel(X, W, Y, m, n, k, stride_x, stride_w, stride_y, stride_yp,
                     IEEE: tl.constexpr, PARTS: tl.constexpr, SUM: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # ``PARTS`` slices of ``k`` inputs each: slice p's product is rounded to X's dtype;
        # SUM: the slices' products added in order in float32, stored in Y's dtype; else each
        # slice's product stored (float32) at Y + p * stride_yp. One slice: a plain GEMM.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        out_mask = (rows[:, None] < m) & (cols[None, :] < n)
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for p in tl.static_range(PARTS):
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
            part = acc.to(X.dtype.element_ty).to(tl.float32)
            if SUM:
                if p == 0:
                    total = part
                else:
                    total = total + part
            else:
                tl.store(Y + p * stride_yp + rows[:, None] * stride_y + cols[None, :], part,
                         mask=out_mask)
        if SUM:
            tl.store(Y + rows[:, None] * stride_y + cols[None, :], total.to(Y.dtype.element_ty),
                     mask=out_mask)

    @triton.jit(do_not_specialize=["stride_t"])
    def _attention_kernel(Q, C, T, L, O, scale, stride_qt, stride_qh, stride_c0, stride_cb,
                          stride_cs, stride_ch, stride_t, stride_ot, stride_oh,
                          GQA: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                          BS: tl.constexpr, BN: tl.constexpr):
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        heads = kvh * GQA + tl.arange(0, G)
        hmask = tl.arange(0, G) < GQA
        d = tl.arange(0, D)
        q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=hmask[:, None], other=0.0).to(tl.float32)  # [G, D]
        n_keys = tl.load(L + row)
        m_i = tl.full((G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((G,), dtype=tl.float32)
        acc = tl.zeros((G, D), dtype=tl.float32)
        for start in range(0, n_keys, BN):
            keys = start + tl.arange(0, BN)
            kmask = keys < n_keys
            blk = tl.load(T + row * stride_t + keys // BS, mask=kmask, other=0)
            base = blk * stride_cb + (keys % BS) * stride_cs + kvh * stride_ch
            kv_mask = kmask[:, None]
            k = tl.load(C + base[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BN]
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(C + stride_c0 + base[:, None] + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=hmask[:, None])


def _gemm(x: torch.Tensor, weight: torch.Tensor, parts: int, summed: bool) -> torch.Tensor:
    k, n = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    w = w.to(rows.dtype)
    m = rows.shape[0]
    if k % parts:
        raise ValueError(f"invariant GEMM: {k} inputs do not split into {parts} slices")
    y = (torch.empty(m, n, dtype=x.dtype, device=x.device) if summed
         else torch.empty(parts, m, n, dtype=torch.float32, device=x.device))
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _gemm_kernel[grid](rows, w, y, m, n, k // parts, rows.stride(0), w.stride(0),
                           y.stride(-2), 0 if summed else y.stride(0),
                           IEEE=rows.dtype == torch.float32, PARTS=parts, SUM=summed,
                           BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=4, num_stages=3)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None, parts: int = 1) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with a row's result independent of the other rows.
    ``parts``: the input dimension in that many equal slices, each slice's product rounded to
    x's dtype, then added in order in float32 (:func:`partial_products` summed, in one launch)."""
    n = weight.shape[0]
    y = _gemm(x, weight, parts, summed=True)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


def partial_products(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """``[parts, *x.shape[:-1], N]`` float32: the product of each of ``parts`` equal slices of
    the input dimension, rounded to x's dtype (what :func:`linear` with ``parts`` adds up)."""
    return _gemm(x, weight, parts, summed=False).view(parts, *x.shape[:-1], weight.shape[0])


def attention(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
              scale: float, keys: int = KEYS, warps: int = 4) -> torch.Tensor:
    """q [T, H, D]; cache [2, blocks, bs, Hkv, D]; tables [T, W] (row r's blocks); lens [T]
    (row r sees keys ``0 .. lens[r] - 1``, each >= 1) -> [T, H, D] in q's dtype. ``keys``
    (the chunk of the online softmax) and ``warps``: for tools/bench_invariant_kernels.py; a
    deterministic engine runs one value of each (another chunk size changes the bits)."""
    t, heads, dim = q.shape
    bs, kv_heads = cache.shape[2], cache.shape[3]
    if heads % kv_heads or dim & (dim - 1) or cache.stride(-1) != 1:
        raise ValueError("invariant attention: heads, head size or cache layout not supported")
    gqa = heads // kv_heads
    q = q if q.stride(-1) == 1 else q.contiguous()
    if tables.stride(-1) != 1:  # (a row stride of its own is fine: a slice of a wider table)
        tables = tables.contiguous()
    lens = lens.contiguous()
    out = torch.empty(t, heads, dim, dtype=q.dtype, device=q.device)
    if t:
        _attention_kernel[(t, kv_heads)](
            q, cache, tables, lens, out, float(scale), q.stride(0), q.stride(1), cache.stride(0),
            cache.stride(1), cache.stride(2), cache.stride(3), tables.stride(0), out.stride(0),
            out.stride(1), GQA=gqa, G=triton.next_power_of_2(gqa), D=dim, BS=bs, BN=keys,
            num_warps=warps)
    return out


__all__ = ["usable", "linear", "partial_products", "attention", "BLOCK_M", "BLOCK_N", "BLOCK_K", "KEYS"]

"""Paged-attention decode in Triton: one query token per sequence, straight from the block table.

``decode_attention(q, cache, rows, block_tables, context_lens, scale, out)`` reads each
sequence's K/V blocks from the cache layer view ``[2, num_blocks, block_size, Hkv, D]`` through
its row of ``block_tables`` (no gather into a padded copy), with an online softmax in fp32. One
program handles one (sequence, KV head, split): the ``H // Hkv`` query heads that share the KV
head are the rows of one small ``tl.dot`` (padded to 16), so K/V are read once per KV head.

Split-K: a sequence's context is cut into fixed pieces of ``SPLIT_TOKENS`` tokens; the grid has
``ceil(table_width * block_size / SPLIT_TOKENS)`` splits and a program whose piece lies past its
sequence's end exits at once. A sequence that fits one piece is written directly; longer ones go
through a partial (max, sum, acc) buffer and a reduce kernel. Both decisions are made on the
device from ``context_lens``, so the launch is CUDA-graph safe (no host sync, the grid depends on
shapes only), and a sequence's arithmetic does not depend on the batch it is in or on the table
width (an eager step and a padded graph replay give bit-identical attention).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the torch path in attention.py is the CPU path and the fallback.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

SPLIT_TOKENS = 512  # tokens per split (a multiple of the tile below)
TILE_TOKENS = 64  # tokens per loop iteration (several KV blocks when block_size < 64)


def supported(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether ``decode_attention`` handles these shapes (else use the torch path)."""
    if not HAVE_TRITON or not q.is_cuda:
        return False
    d = q.shape[-1]
    heads, kv_heads = q.shape[1], cache.shape[3]
    bs = cache.shape[2]
    return (d >= 16 and d & (d - 1) == 0 and d <= 256 and heads % kv_heads == 0
            and bs & (bs - 1) == 0 and cache.stride(-1) == 1 and q.stride(-1) == 1
            and q.dtype == cache.dtype)


if HAVE_TRITON:

    @triton.jit
    def _decode_kernel(
        Q, K, V, Out, BT, CL, ROWS, PM, PL, PACC,
        scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kt, stride_kh, stride_bt,
        num_heads, num_splits,
        GQA: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(CL + b).to(tl.int32)
        tok0 = s * SPLIT
        if tok0 < ctx:
            tok1 = tl.minimum(tok0 + SPLIT, ctx)
            row = tl.load(ROWS + b)
            g = tl.arange(0, GP)
            d = tl.arange(0, HEAD_DIM)
            heads = kvh * GQA + g
            gmask = g < GQA
            q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                        mask=gmask[:, None], other=0.0)
            n = tl.arange(0, TILE)
            m_i = tl.full([GP], float("-inf"), tl.float32)
            l_i = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, HEAD_DIM], tl.float32)
            for t0 in range(tok0, tok1, TILE):
                tok = t0 + n
                valid = tok < tok1
                phys = tl.load(BT + b * stride_bt + tok // BLOCK_SIZE, mask=valid, other=0)
                off = phys * stride_kb + (tok % BLOCK_SIZE) * stride_kt + kvh * stride_kh
                k = tl.load(K + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                if IEEE:
                    qk = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    qk = tl.dot(q, tl.trans(k))
                qk = tl.where(valid[None, :], qk * scale_log2, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(qk, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            if ctx <= SPLIT:  # one piece: final output
                o = acc / l_i[:, None]
                tl.store(Out + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                         o.to(Out.dtype.element_ty), mask=gmask[:, None])
            else:
                idx = (b * num_heads + heads) * num_splits + s
                tl.store(PM + idx, m_i, mask=gmask)
                tl.store(PL + idx, l_i, mask=gmask)
                tl.store(PACC + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])

    @triton.jit
    def _reduce_kernel(
        PM, PL, PACC, Out, CL, ROWS,
        stride_ot, stride_oh, num_heads, num_splits,
        S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        ctx = tl.load(CL + b).to(tl.int32)
        if ctx > SPLIT:
            used = tl.cdiv(ctx, SPLIT)
            s = tl.arange(0, S_PAD)
            smask = s < used
            d = tl.arange(0, HEAD_DIM)
            base = (b * num_heads + h) * num_splits
            m = tl.load(PM + base + s, mask=smask, other=float("-inf"))
            lsum = tl.load(PL + base + s, mask=smask, other=0.0)
            mx = tl.max(m, 0)
            w = tl.where(smask, tl.exp2(m - mx), 0.0)
            total = tl.sum(lsum * w, 0)
            acc = tl.load(PACC + (base + s)[:, None] * HEAD_DIM + d[None, :],
                          mask=smask[:, None], other=0.0)
            o = tl.sum(acc * w[:, None], 0) / total
            row = tl.load(ROWS + b)
            tl.store(Out + row * stride_ot + h * stride_oh + d, o.to(Out.dtype.element_ty))


def num_splits(table_width: int, block_size: int) -> int:
    """Static split count for a table of ``table_width`` blocks (shape-only: graph safe)."""
    return max(1, -(-table_width * block_size // SPLIT_TOKENS))


def decode_attention(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     out: torch.Tensor) -> None:
    """Write attention for the decode rows into ``out``.

    q, out: ``[T, H, D]``; ``rows``: ``[B]`` long rows of q/out (one query each);
    cache: ``[2, num_blocks, block_size, Hkv, D]``; block_tables: ``[B, W]`` (row stride free,
    last stride 1); context_lens: ``[B]`` tokens each sequence attends to (its new token's
    K/V already written to the cache).
    """
    bsz = rows.shape[0]
    if bsz == 0:
        return
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block_size = cache.shape[3], cache.shape[2]
    gqa = heads // kv_heads
    gp = max(16, triton.next_power_of_2(gqa))
    splits = num_splits(block_tables.shape[1], block_size)
    assert block_tables.stride(1) == 1
    k, v = cache[0], cache[1]
    if splits > 1:  # partials, indexed densely: [B, H, S] (max, sum) and [B, H, S, D]
        f32 = dict(dtype=torch.float32, device=q.device)
        pm = torch.empty((bsz, heads, splits), **f32)
        pl = torch.empty((bsz, heads, splits), **f32)
        pacc = torch.empty((bsz, heads, splits, dim), **f32)
    else:
        pm = pl = pacc = context_lens  # unused (no sequence exceeds one split)
    tile = max(TILE_TOKENS, block_size)
    ieee = q.dtype == torch.float32
    _decode_kernel[(bsz, kv_heads, splits)](
        q, k, v, out, block_tables, context_lens, rows, pm, pl, pacc,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0),
        heads, splits,
        GQA=gqa, GP=gp, HEAD_DIM=dim, BLOCK_SIZE=block_size, TILE=tile,
        SPLIT=SPLIT_TOKENS, IEEE=ieee, num_warps=4, num_stages=2,
    )
    if splits > 1:
        _reduce_kernel[(bsz, heads)](
            pm, pl, pacc, out, context_lens, rows,
            out.stride(0), out.stride(1), heads, splits,
            S_PAD=triton.next_power_of_2(splits), HEAD_DIM=dim, SPLIT=SPLIT_TOKENS,
            num_warps=4,
        )

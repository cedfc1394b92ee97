"""Paged-attention decode in Triton: one query token per sequence, straight from the block table.

``decode_attention(q, cache, rows, block_tables, context_lens, scale, out)`` reads each
sequence's K/V blocks from the cache layer view ``[2, num_blocks, block_size, Hkv, D]`` through
its row of ``block_tables`` (no gather into a padded copy), with an online softmax in fp32. A
program works for one (sequence, KV head): the ``H // Hkv`` query heads that share the KV head
are the rows of one small ``tl.dot`` (padded to 16), so K/V are read once per KV head.

Split-K: a sequence's context is cut into fixed pieces of ``SPLIT_TOKENS`` tokens (at most
``ceil(table_width * block_size / SPLIT_TOKENS)``); a grid of ``G`` programs per (sequence, KV
head), ``G`` from the batch size (about four programs per multiprocessor in all), takes them in
turn. A sequence that fits one piece is written directly; longer ones go through a partial
(max, sum, acc) buffer and a reduce kernel that combines the pieces in order. Both decisions
are made on the device from ``context_lens``, so the launch is CUDA-graph safe (no host sync;
the grid depends on shapes only), and a sequence's arithmetic does not depend on the batch it is
in or on the table width (an eager step and a padded graph replay give bit-identical attention).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the torch path in attention.py is the CPU path and the fallback.
    import triton
    import triton.language as tl

    # (the ``triton`` kill switch, engine/envs.py, makes a model take the torch path instead)
    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

SPLIT_TOKENS = 1024  # tokens per split (a multiple of the tile below; 512 before the sweep)
TILE_TOKENS = 64  # tokens per loop iteration (several KV blocks when block_size < 64)
NUM_WARPS, NUM_STAGES = 4, 2  # the decode kernel's launch (tools/sweep_decode_attn.py)


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


if triton is not None:

    @triton.jit
    def attend_tile(q, K, V, off, d, valid, see, scale_log2, m_i, l_i, acc, IEEE: tl.constexpr,
                    MASKED: tl.constexpr = True):
        """One key tile of an online softmax: ``off`` the tile's K/V row offsets, ``valid`` the
        keys that exist, ``see`` the [queries, keys] (or [1, keys]) mask of the keys each query
        attends to; returns the new (max, sum, acc). Shared by the decode and prefill kernels.
        ``MASKED`` False: a tile whose keys all exist and every query sees (``valid`` and
        ``see`` unused, None): no load masks, no per-element select."""
        if MASKED:
            k = tl.load(K + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        else:
            k = tl.load(K + off[:, None] + d[None, :])
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if MASKED:
            qk = tl.where(see, qk * scale_log2, float("-inf"))
        else:
            qk = qk * scale_log2
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(V + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        else:
            v = tl.load(V + off[:, None] + d[None, :])
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit(do_not_specialize=["num_splits"])  # varies with the table width in eager steps
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
        ctx = tl.load(CL + b).to(tl.int32)
        row = tl.load(ROWS + b)
        g = tl.arange(0, GP)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GQA + g
        gmask = g < GQA
        q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)
        n = tl.arange(0, TILE)
        # this program takes splits pid, pid + G, ... of its sequence (G = the grid's 3rd dim);
        # each split is computed the same way whichever program takes it
        for s in range(tl.program_id(2), tl.cdiv(ctx, SPLIT), tl.num_programs(2)):
            tok0 = s * SPLIT
            tok1 = tl.minimum(tok0 + SPLIT, ctx)
            m_i = tl.full([GP], float("-inf"), tl.float32)
            l_i = tl.zeros([GP], tl.float32)
            acc = tl.zeros([GP, HEAD_DIM], tl.float32)
            for t0 in range(tok0, tok1, TILE):
                tok = t0 + n
                valid = tok < tok1
                phys = tl.load(BT + b * stride_bt + tok // BLOCK_SIZE, mask=valid, other=0)
                off = phys * stride_kb + (tok % BLOCK_SIZE) * stride_kt + kvh * stride_kh
                m_i, l_i, acc = attend_tile(q, K, V, off, d, valid, valid[None, :], scale_log2,
                                            m_i, l_i, acc, IEEE)
            if ctx <= SPLIT:  # one piece: final output
                o = acc / l_i[:, None]
                tl.store(Out + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                         o.to(Out.dtype.element_ty), mask=gmask[:, None])
            else:
                idx = (b * num_heads + heads) * num_splits + s
                tl.store(PM + idx, m_i, mask=gmask)
                tl.store(PL + idx, l_i, mask=gmask)
                tl.store(PACC + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])

    @triton.jit(do_not_specialize=["num_splits"])  # (as _decode_kernel's: varies in eager steps)
    def _reduce_kernel(
        PM, PL, PACC, Out, CL, ROWS,
        stride_ot, stride_oh, num_heads, num_splits,
        HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
    ):
        # Splits are combined one by one in a fixed order, so the result does not depend on
        # the grid's split count (an eager step and a graph replay agree bit for bit).
        b = tl.program_id(0)
        h = tl.program_id(1)
        ctx = tl.load(CL + b).to(tl.int32)
        if ctx > SPLIT:
            used = tl.cdiv(ctx, SPLIT)
            d = tl.arange(0, HEAD_DIM)
            base = (b * num_heads + h) * num_splits
            mx = tl.load(PM + base)
            for s in range(1, used):
                mx = tl.maximum(mx, tl.load(PM + base + s))
            total = tl.zeros([1], tl.float32)
            acc = tl.zeros([HEAD_DIM], tl.float32)
            for s in range(0, used):
                w = tl.exp2(tl.load(PM + base + s) - mx)
                total += tl.load(PL + base + s) * w
                acc += tl.load(PACC + (base + s) * HEAD_DIM + d) * w
            o = acc / total
            row = tl.load(ROWS + b)
            tl.store(Out + row * stride_ot + h * stride_oh + d, o.to(Out.dtype.element_ty))


_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    n = _SMS.get(device)
    if n is None:
        n = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


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
    # programs per (sequence, KV head): enough for ~4 per multiprocessor, at most one a split
    per = min(splits, max(1, -(-4 * _sm_count(q.device) // (bsz * kv_heads))))
    _decode_kernel[(bsz, kv_heads, per)](
        q, k, v, out, block_tables, context_lens, rows, pm, pl, pacc,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), k.stride(2), block_tables.stride(0),
        heads, splits,
        GQA=gqa, GP=gp, HEAD_DIM=dim, BLOCK_SIZE=block_size, TILE=tile,
        SPLIT=SPLIT_TOKENS, IEEE=ieee, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if splits > 1:
        _reduce_kernel[(bsz, heads)](
            pm, pl, pacc, out, context_lens, rows,
            out.stride(0), out.stride(1), heads, splits,
            HEAD_DIM=dim, SPLIT=SPLIT_TOKENS, num_warps=1,
        )

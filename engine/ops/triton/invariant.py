"""Batch-invariant paged attention (and, from invariant_gemm.py, the GEMM) for deterministic mode
on CUDA (engine/model/invariant.py).

Why by hand: on the GPU neither cuBLAS nor torch's reductions promise a row's result whatever the
rows beside it. cuBLAS picks its algorithm (split-K among them) by the problem's shape, and torch's
reduction kernels size their thread blocks by the number of outputs (one row's sum spread over 512
threads, a thousand rows' over 32 each): the same token then got other bits alone than in a batch
(measured on an H100: logprobs differed from the second token on, the CPU-tiled ``bmm`` of
engine/model/invariant.py included). Here every launch is one compiled kernel whose per-row
arithmetic is fixed at compile time:

* :func:`linear` (and :func:`partial_products`): engine/ops/triton/invariant_gemm.py.
* :func:`attention`: one program per (tile, KV head): a tile is a run of up to
  :func:`query_tile` consecutive queries of one sequence (a decode row: a tile of its own), its
  queries' GQA heads the rows of one block of ``ROWS`` rows; keys ``0 .. len - 1`` read through the
  sequence's block table in chunks of ``KEYS`` from key 0, scores and the weighted values by
  tensor-core dots, an online softmax. Each (query, head) row's arithmetic is its own: a dot
  computes each output element from its own row and column, the softmax reduces along the row,
  and a row whose keys ended before a chunk keeps its state unchanged (not multiplied by 1).
  The chunks' boundaries depend only on the key positions, so a key computed this step, by an
  earlier chunk of the prompt or by another request (a cached prefix) is added at the same
  point of the same sum, and a query gets the same bits in a prompt tile as alone in a decode.
* RMSNorm: engine/ops/triton/fused_ops.py's kernel already reduces one row per program.

Integer arguments that vary with the batch are not specialized (``do_not_specialize``): one
compiled variant serves every batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from .fused_ops import AVAILABLE, INTERPRET, tl, triton
from .invariant_gemm import BLOCK_K, BLOCK_M, BLOCK_N, linear, partial_products, programs_wanted
from .prefill_attention import BLOCK_M as PREFILL_TILE, PrefillBatch

#: keys per step of the attention's online softmax
KEYS = 64
#: (query, head) rows of one attention program: ``ROWS // G`` queries of one sequence, ``G`` heads
ROWS = 64
#: keys of one segment of the attention: each from an empty softmax state, merged in order
SEGMENT = 256


def usable(device: torch.device) -> bool:
    """Whether these kernels can run on ``device``."""
    return AVAILABLE and (device.type == "cuda" or (INTERPRET and device.type == "cpu"))


if triton is not None:

    @triton.jit
    def _segment(C, T, q, n_keys, kvh, seg0, seg_end, scale, stride_c0, stride_cb, stride_cs,
                 stride_ch, stride_t, tab, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                 IEEE: tl.constexpr, R: tl.constexpr):
        # the rows' softmax state over keys seg0 .. seg_end - 1 (each row: those below its own
        # n_keys), from an empty state, keys in chunks of BN from seg0: (max, sum, weighted V)
        d = tl.arange(0, D)
        m_i = tl.full((R,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((R,), dtype=tl.float32)
        acc = tl.zeros((R, D), dtype=tl.float32)
        for start in range(seg0, seg_end, BN):
            keys = start + tl.arange(0, BN)
            kmask = keys < seg_end
            blk = tl.load(T + tab * stride_t + keys // BS, mask=kmask, other=0)
            base = blk * stride_cb + (keys % BS) * stride_cs + kvh * stride_ch
            k = tl.load(C + base[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale  # [R, BN]
            seen = keys[None, :] < n_keys[:, None]
            s = tl.where(seen, s, float("-inf"))
            # a row whose keys ended before this chunk keeps its state exactly (not `* 1 + 0`)
            on = start < n_keys
            m_new = tl.where(on, tl.maximum(m_i, tl.max(s, axis=1)), m_i)
            alpha = tl.where(on, tl.exp(m_i - m_new), 1.0)
            p = tl.where(seen, tl.exp(s - m_new[:, None]), 0.0)
            v = tl.load(C + stride_c0 + base[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            l_i = tl.where(on, l_i * alpha + tl.sum(p, axis=1), l_i)
            acc = tl.where(on[:, None], acc * alpha[:, None] + pv, acc)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _merge(m, l, acc, m_s, l_s, acc_s, on):
        # the state so far and a later segment's, for the rows ``on`` (the others keep theirs
        # exactly). Explicit FMAs, so that the attention kernel and _merge_kernel round alike
        # (a compiler free to contract `x * a + y * b` may do so in one kernel, not the other);
        # from the empty state (m -inf, l and acc 0) the result is the segment's, exactly.
        m_new = tl.where(on, tl.maximum(m, m_s), m)
        a = tl.exp(m - m_new)
        b = tl.exp(m_s - m_new)
        l_new = tl.fma(l, a, l_s * b)
        acc_new = tl.fma(acc, a[:, None], acc_s * b[:, None])
        return m_new, tl.where(on, l_new, l), tl.where(on[:, None], acc_new, acc)

    @triton.jit(do_not_specialize=["stride_t", "z_count"])
    def _attention_kernel(Q, C, O, PM, PL, PA, T, RI, LN, TC, TM, QS, QL, CL, scale, stride_qt,
                          stride_qh, stride_c0, stride_cb, stride_cs, stride_ch, stride_t,
                          stride_ot, stride_oh, stride_pt, stride_ph, z_count,
                          GQA: tl.constexpr, G: tl.constexpr, BQ: tl.constexpr, D: tl.constexpr,
                          BS: tl.constexpr, BN: tl.constexpr, SEG: tl.constexpr,
                          IEEE: tl.constexpr, SPLIT: tl.constexpr, CHUNKS: tl.constexpr):
        # one program: up to BQ consecutive queries of one sequence (one block table) x one KV
        # head's GQA query heads, as the BQ * G rows of one block (row i: query i // G, head
        # i % G); query j of the run sees keys 0 .. k0 + j - 1. CHUNKS: the run is queries
        # m0 .. m0 + BQ - 1 of prompt chunk TC[tile] (m0: the tile's first query TM[tile] plus
        # BQ * program_id(2); the chunk's rows from QS, QL queries, the last seeing CL keys, its
        # table row c of T); else one decode query: packed row RI[i], table row i, LN[i] keys.
        # Keys in segments of SEG from key 0, each from an empty state (_segment), merged in
        # order (_merge). SPLIT (decode rows): this program computes segments z, z + z_count,
        # ... and stores each one's state at PM / PL / PA[i, head, segment]; _merge_kernel
        # merges them in order.
        i0 = tl.program_id(0)
        kvh = tl.program_id(1)
        if CHUNKS:
            c = tl.load(TC + i0)
            q_len = tl.load(QL + c)
            m0 = tl.load(TM + i0) + tl.program_id(2) * BQ
            r0 = tl.load(QS + c) + m0
            nr = q_len - m0
            k0 = tl.load(CL + c) - q_len + m0 + 1
            tab = c
        else:
            r0 = tl.load(RI + i0)
            nr = 1
            k0 = tl.load(LN + i0)
            tab = i0
        i = tl.arange(0, BQ * G)
        qi = i // G
        gi = i % G
        row = r0 + qi
        live = qi < nr
        valid = live & (gi < GQA)
        d = tl.arange(0, D)
        head = kvh * GQA + gi
        q = tl.load(Q + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=valid[:, None], other=0.0)  # [BQ * G, D]
        n_keys = tl.where(live, k0 + qi, 0)  # each row's own
        last = tl.max(n_keys, axis=0)
        if SPLIT:
            for seg0 in range(tl.program_id(2) * SEG, last, z_count * SEG):
                seg_end = tl.minimum(seg0 + SEG, last)
                m_s, l_s, acc_s = _segment(C, T, q, n_keys, kvh, seg0, seg_end, scale,
                                           stride_c0, stride_cb, stride_cs, stride_ch,
                                           stride_t, tab, D, BS, BN, IEEE, BQ * G)
                at = i0 * stride_pt + head * stride_ph + seg0 // SEG
                tl.store(PM + at, m_s, mask=valid)
                tl.store(PL + at, l_s, mask=valid)
                tl.store(PA + at[:, None] * D + d[None, :], acc_s, mask=valid[:, None])
        else:
            m_i = tl.full((BQ * G,), float("-inf"), dtype=tl.float32)
            l_i = tl.zeros((BQ * G,), dtype=tl.float32)
            acc = tl.zeros((BQ * G, D), dtype=tl.float32)
            for seg0 in range(0, last, SEG):
                seg_end = tl.minimum(seg0 + SEG, last)
                m_s, l_s, acc_s = _segment(C, T, q, n_keys, kvh, seg0, seg_end, scale,
                                           stride_c0, stride_cb, stride_cs, stride_ch,
                                           stride_t, tab, D, BS, BN, IEEE, BQ * G)
                m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s, seg0 < n_keys)
            out = acc / tl.where(live, l_i, 1.0)[:, None]
            tl.store(O + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(O.dtype.element_ty), mask=valid[:, None])

    @triton.jit
    def _merge_kernel(RI, LN, PM, PL, PA, O, stride_pt, stride_ph, stride_ot, stride_oh,
                      GQA: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SEG: tl.constexpr):
        # one program: decode query i (packed row RI[i], LN[i] keys) x one KV head's GQA heads;
        # its segments' states merged in order
        i0 = tl.program_id(0)
        kvh = tl.program_id(1)
        row = tl.load(RI + i0)
        gi = tl.arange(0, G)
        valid = gi < GQA
        head = kvh * GQA + gi
        d = tl.arange(0, D)
        n_keys = tl.load(LN + i0)
        m_i = tl.full((G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((G,), dtype=tl.float32)
        acc = tl.zeros((G, D), dtype=tl.float32)
        on = valid & (n_keys > 0)
        for s in range(0, tl.cdiv(n_keys, SEG)):
            at = i0 * stride_pt + head * stride_ph + s
            m_s = tl.load(PM + at, mask=valid, other=float("-inf"))
            l_s = tl.load(PL + at, mask=valid, other=0.0)
            acc_s = tl.load(PA + at[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _merge(m_i, l_i, acc, m_s, l_s, acc_s, on)
        out = acc / tl.where(on, l_i, 1.0)[:, None]
        tl.store(O + row * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=valid[:, None])


def query_tile(gqa: int) -> int:
    """Queries a program of :func:`attention` takes for a model with ``gqa`` query heads per KV
    head: ``ROWS`` rows of (query, head) in all."""
    return max(1, ROWS // triton.next_power_of_2(gqa)) if triton is not None else 1


#: (packed rows [n] long, block tables [n, W], key counts [n]) of decode queries
DecodeRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def attention(q: torch.Tensor, cache: torch.Tensor, scale: float,
              rows: Optional[DecodeRows] = None, chunks: Optional[PrefillBatch] = None, *,
              split: bool = False, keys: int = KEYS, warps: int = 4,
              segment: int = SEGMENT, block_rows: int = ROWS) -> torch.Tensor:
    """q [T, H, D]; cache [2, blocks, bs, Hkv, D] -> [T, H, D] in q's dtype, for the rows of
    ``rows`` (decode queries: packed row ``rows[0][i]`` sees keys ``0 .. rows[2][i] - 1``
    through table ``rows[1][i]``) and of ``chunks`` (the step's prompt chunks, the paged
    prefill kernel's :class:`~engine.ops.triton.prefill_attention.PrefillBatch`: query ``j``
    of chunk ``c`` is row ``q_start[c] + j`` and sees keys ``0 .. ctx_len[c] - q_len[c] + j``),
    decode rows first (a CUDA graph's padded decode rows write into a chunk's row, which the
    chunks' launch then writes); other rows are left unwritten. A chunk's queries run in tiles
    of :func:`query_tile`, a decode query alone: a query's bits are the same either way.
    ``split`` (decode rows only): each query's key segments in programs of their own, merged
    by a second launch -- the bits of one program going through them in order.
    ``keys`` (the chunk of the online softmax), ``segment``, ``warps`` and ``block_rows``: for
    tests and the kernel tools; a deterministic engine runs one value of each (another chunk or
    segment size changes the bits)."""
    t, heads, dim = q.shape
    bs, kv_heads = cache.shape[2], cache.shape[3]
    if heads % kv_heads or dim & (dim - 1) or dim < 16 or cache.stride(-1) != 1:
        raise ValueError("invariant attention: heads, head size or cache layout not supported")
    if segment % keys:
        raise ValueError("invariant attention: a segment is a whole number of key chunks")
    if split and chunks is not None:
        raise ValueError("invariant attention: split is for decode rows only")
    gqa = heads // kv_heads
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(t, heads, dim, dtype=q.dtype, device=q.device)
    g = triton.next_power_of_2(gqa)
    bq = max(1, block_rows // g)
    args = (float(scale), q.stride(0), q.stride(1), cache.stride(0), cache.stride(1),
            cache.stride(2), cache.stride(3))
    consts = dict(GQA=gqa, G=g, BQ=bq, D=dim, BS=bs, BN=keys, SEG=segment,
                  IEEE=q.dtype == torch.float32, num_warps=warps)
    if rows is not None and rows[0].shape[0]:
        index, tables, lens = rows
        n = index.shape[0]
        if tables.stride(-1) != 1:  # (a row stride of its own is fine: a slice of a wider table)
            tables = tables.contiguous()
        if split:
            # per-segment states: as many segments as the tables can address (fixed for a CUDA
            # graph's full-width tables), spread over z programs a row and head (any z: same bits)
            segs = triton.cdiv(tables.shape[1] * bs, segment)
            z = min(segs, max(1, triton.cdiv(2 * programs_wanted(q.device), n * kv_heads)))
            pm = torch.empty(n, heads, segs, dtype=torch.float32, device=q.device)
            pl = torch.empty_like(pm)
            pa = torch.empty(n, heads, segs, dim, dtype=torch.float32, device=q.device)
        else:  # not read: an eager prompt step's host time is launches and allocations
            z, pm, pl, pa = 1, out, out, out
        _attention_kernel[(n, kv_heads, z)](
            q, cache, out, pm, pl, pa, tables, index, lens, index, index, index, index, index,
            *args, tables.stride(0), out.stride(0), out.stride(1), pm.stride(0), pm.stride(1), z,
            SPLIT=split, CHUNKS=False, **consts)
        if split:
            _merge_kernel[(n, kv_heads)](index, lens, pm, pl, pa, out, pm.stride(0), pm.stride(1),
                                         out.stride(0), out.stride(1), GQA=gqa, G=g, D=dim,
                                         SEG=segment, num_warps=4)
    if chunks is not None and chunks.tile_chunk.shape[0]:
        b = chunks
        _attention_kernel[(b.tile_chunk.shape[0], kv_heads, triton.cdiv(PREFILL_TILE, bq))](
            q, cache, out, out, out, out, b.block_table, b.q_start, b.q_start, b.tile_chunk,
            b.tile_m0, b.q_start, b.q_len, b.ctx_len, *args, b.block_table.stride(0),
            out.stride(0), out.stride(1), 0, 0, 1, SPLIT=False, CHUNKS=True, **consts)
    return out


__all__ = ["usable", "linear", "partial_products", "attention", "query_tile", "DecodeRows", "ROWS", "SEGMENT", "BLOCK_M", "BLOCK_N", "BLOCK_K", "KEYS"]

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
  the ``K`` loop once per slice of the input, rounds each slice's product to the input's dtype
  (the o/down projections of engine/model/invariant.py: one slice per KV head's share) or not
  (the q/k/v and gate/up projections: fixed slices of the input) and adds them in order. A
  decode step's few rows make few output tiles, too few programs to stream the weight at the
  device's bandwidth (16 for the o/down projections of a 0.6B model on 132 SMs): there each
  slice runs in a program of its own, stores its product in float32, and a second launch adds
  them in the same order -- the same arithmetic, so the same bits, as one program looping over
  the slices (checked bitwise in tests/unit/test_invariant_triton.py); which launch runs depends
  on the row count, the bits do not.
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

import functools
from typing import Optional

import torch

from .fused_ops import AVAILABLE, INTERPRET, tl, triton
from .prefill_attention import BLOCK_M as PREFILL_TILE, PrefillBatch

#: the GEMM's one configuration (tensor-core tiles; bf16 / fp16 / fp32 inputs, fp32 accumulation)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
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
                          WHERE: tl.constexpr, GROUP_M: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # _gemm_kernel's SUM launch (slices of k inputs, k a multiple of BK) as one loop over
        # every input, so that the loads pipeline across the slices' boundaries: the same
        # per-slice products (each from zero, in BK steps in order), rounded or not, added in
        # order -- the same bits. Tiles in groups of GROUP_M rows of tiles (a weight tile read
        # from L2 by the group). WHERE: the slice's end by selects instead of a branch.
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
            if WHERE:
                acc = tl.where(i % steps == 0, 0.0, acc)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            if WHERE:
                part = acc
                if ROUND:
                    part = part.to(X.dtype.element_ty).to(tl.float32)
                end = (i + 1) % steps == 0
                total = tl.where(end, tl.where(i + 1 == steps, part, total + part), total)
            else:
                if (i + 1) % steps == 0:
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


#: elements a program of _sum_kernel adds
SUM_BLOCK = 1024
#: from this many rows (a prompt step) the GEMM runs _gemm_flat_kernel, its tiles picked by
#: Triton's autotuner per shape and row-count class (powers of two) among FLAT_CONFIGS (BM, BN,
#: warps, stages): which tiles a GEMM runs does not change a row's bits -- the K order is the
#: same (measured equal bit for bit on the H100 for 10 tile shapes against _gemm_kernel's 64 x 64
#: at 1-2,048 rows, tools/invariant_gemm_tiles.py), so a timing choice is safe here
FLAT_ROWS = 256
FLAT_CONFIGS = ((128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4))


@functools.lru_cache(maxsize=None)
def _flat_tuned():
    """_gemm_flat_kernel under the autotuner (CUDA only: made at first use)."""
    configs = [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st)
               for bm, bn, w, st in FLAT_CONFIGS]
    return triton.autotune(configs, key=["n", "k", "m_class", "PARTS", "ROUND"])(_gemm_flat_kernel)


@functools.lru_cache(maxsize=None)
def _programs_wanted(device: torch.device) -> int:
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
        split if split is not None else tiles[0] * tiles[1] < _programs_wanted(x.device))
    y = (torch.empty(m, n, dtype=x.dtype, device=x.device) if summed
         else torch.empty(parts, m, n, dtype=torch.float32, device=x.device))
    if not m:
        return y
    flags = dict(IEEE=rows.dtype == torch.float32, PARTS=parts, ROUND=rounded,
                 BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=4, num_stages=3)
    if (summed and not split and m >= FLAT_ROWS and (k // parts) % BLOCK_K == 0
            and x.device.type == "cuda"):
        _flat_tuned()[lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)](
            rows, w, y, m, n, k // parts, rows.stride(0), w.stride(0), y.stride(0), m.bit_length(),
            IEEE=rows.dtype == torch.float32, PARTS=parts, ROUND=rounded, WHERE=False,
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
    ``keys`` (the chunk of the online softmax), ``segment`` and ``warps``: for tests and
    tools/bench_invariant_kernels.py; a deterministic engine runs one value of each (another
    chunk or segment size changes the bits)."""
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
            z = min(segs, max(1, triton.cdiv(2 * _programs_wanted(q.device), n * kv_heads)))
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

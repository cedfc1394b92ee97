"""Paged prefill attention in Triton: every prefill chunk of a step in one launch per layer.

A chunk is ``n`` query rows of one sequence (packed at ``q_start``) at positions
``ctx - n .. ctx - 1``; its keys are the sequence's first ``ctx`` tokens, read straight from the
paged cache through its block table (this step's K/V were written before attention). So a fresh
prompt, the next chunk of a long prompt and a chunk after a prefix-cache hit are one case: no
gather of the context into a dense copy, no per-sequence calls (on the H200 the per-sequence
SDPA path cost ~8 launches a sequence a layer, which made the prefill steps host-bound).

A program computes ``BLOCK_M`` rows of one chunk: by default (``KernelChoice``) the rows of two
query heads of one KV head for ``BLOCK_M / 2`` queries, interleaved, each key tile loaded once
for both; or ``BLOCK_M`` queries of one head, or of several heads stacked. An online softmax
in fp32 runs over key tiles of ``BLOCK_N`` up to its last query's position (causal). The host
builds the step's tile list (``BLOCK_M`` queries a tile) once (``PrefillBatch``), not per layer.

Why by hand: torch's flash-attention varlen entry point (``torch.nn.attention.varlen``) takes a
paged block table only in releases newer than the 2.11 on the GPU machines, and its signature
differs between them; this kernel runs on both and in Triton's CPU interpreter (tests).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from engine.ops.host_arrays import padded_rows

from .decode_attention import HAVE_TRITON, tl, triton
from .fused_ops import INTERPRET

if triton is not None:
    from .decode_attention import attend_tile

BLOCK_M = 64
BLOCK_N = 64


@dataclasses.dataclass
class PrefillBatch:
    """A step's prefill chunks, for :func:`prefill_attention` (all on the device)."""
    tile_chunk: torch.Tensor  # [NT] int32: the chunk of each query tile
    tile_m0: torch.Tensor  # [NT] int32: the tile's first query within its chunk
    q_start: torch.Tensor  # [C] int32: the chunk's first packed row
    q_len: torch.Tensor  # [C] int32
    ctx_len: torch.Tensor  # [C] int32: keys the chunk's last query sees (context + chunk)
    block_table: torch.Tensor  # [C, W] int32 (padded with 0)


def usable(device: torch.device, head_dim: int, block_size: int) -> bool:
    return (HAVE_TRITON and (device.type == "cuda" or INTERPRET)
            and head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256
            and block_size & (block_size - 1) == 0)


def build(chunks: list[tuple[int, int, int, list[int]]], block_size: int,
          device: torch.device) -> PrefillBatch:
    """``chunks``: ``(first packed row, queries n, ctx_len, block ids)`` of every prefill chunk."""
    tc, tm = tiles(chunks)
    width = max(-(-c[2] // block_size) for c in chunks)
    nt, nc = len(tc), len(chunks)
    # NOTE: Triton specializes a kernel on whether each pointer is 16-byte aligned. The per-tile
    # and per-chunk arrays are rows of one host array (one copy each); a row of nt or nc int32
    # would start at 4 * nt (4 * nc, 8 * nc) bytes, aligned or not with the step's counts: a
    # new count class compiled a new variant mid-run (~1 s, measured on the H200). Rows padded
    # to a multiple of 4 values: every row starts aligned, one variant.
    host = padded_rows([tc, tm], _aligned(nt), np.int32)
    per = padded_rows([[c[i] for c in chunks] for i in range(3)], _aligned(nc), np.int32)
    # the blocks each chunk's context reaches; a chunk's table is cut at its own context
    bt = padded_rows([c[3][: -(-c[2] // block_size)] for c in chunks], width, np.int32)
    host, per, bt = (t.to(device, non_blocking=True) for t in (host, per, bt))
    return PrefillBatch(host[0, :nt], host[1, :nt], per[0, :nc], per[1, :nc], per[2, :nc], bt)


def tiles(chunks: list[tuple[int, int, int, list[int]]]) -> tuple[list[int], list[int]]:
    """The query tiles of ``chunks``: each tile's chunk and its first query within the chunk."""
    tc: list[int] = []
    tm: list[int] = []
    for j, (_, n, _, _) in enumerate(chunks):
        tm.extend(range(0, n, BLOCK_M))
        tc.extend([j] * (len(tm) - len(tc)))
    return tc, tm


def _aligned(n: int) -> int:
    """``n`` int32 values rounded up to whole 16-byte units."""
    return -(-n // 4) * 4


if triton is not None:

    # the block table's row stride is its width, which changes from step to step: not a
    # specialization key (Triton would compile a variant for each divisibility class mid-run)
    @triton.jit(do_not_specialize=["stride_bt"])
    def _prefill_kernel(
        Q, K, V, Out, TC, TM, QS, QL, CL, BT,
        scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kt, stride_kh, stride_bt,
        GQA: tl.constexpr, GP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        INTERLEAVE: tl.constexpr = False,
    ):
        """A program: one query tile of one chunk for ``GP`` query heads of one KV head (the
        tile's ``BLOCK_M`` queries of each head are the rows of one ``GP * BLOCK_M`` block, so
        every key tile and its block-table read is loaded once for them; ``GP`` 1: a program a
        head), with an online softmax over key tiles up to the tile's last query: the tiles of keys
        every query sees first, without masks (the cached turns' chunks of ~100 queries after
        ~1,300 keys: 20 of 22 tiles), then the diagonal's, masked.

        ``INTERLEAVE``: the ``GP`` heads' rows interleaved in one ``BLOCK_M``-row block of
        ``BLOCK_M // GP`` queries (row r: query ``r // GP``, head ``r % GP``); the tile's queries
        are then taken by ``GP`` programs in turn (``program_id(1)``: the head group and the
        part), so the grid stays (tiles, heads) with the host's tiles of ``BLOCK_M`` queries. A
        chunk of 93 queries then costs 3 programs of 64 rows a KV head, each key tile loaded
        once for 2 heads, instead of 4 (64 + 29 queries, twice)."""
        tile = tl.program_id(0)
        c = tl.load(TC + tile)
        m0 = tl.load(TM + tile)
        qs = tl.load(QS + c)
        n = tl.load(QL + c)
        ctx = tl.load(CL + c)
        if INTERLEAVE:
            QT: tl.constexpr = BLOCK_M // GP  # queries a program
            ROWS: tl.constexpr = BLOCK_M
            h0 = (tl.program_id(1) // GP) * GP
            m0 = m0 + (tl.program_id(1) % GP) * QT
            r = tl.arange(0, ROWS)
            h = h0 + r % GP
            i = m0 + r // GP
        else:
            QT: tl.constexpr = BLOCK_M
            ROWS: tl.constexpr = GP * BLOCK_M
            h0 = tl.program_id(1) * GP  # the program's first query head
            r = tl.arange(0, ROWS)
            h = h0 + r // BLOCK_M
            i = m0 + r % BLOCK_M
        kvh = h0 // GQA
        qmask = i < n
        qpos = ctx - n + i
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + (qs + i)[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=qmask[:, None], other=0.0)
        hi = tl.minimum(ctx, ctx - n + m0 + QT)  # keys up to the tile's last query
        hi = tl.where(m0 < n, hi, 0)  # (a part past the chunk's last query: no keys, no store)
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        nn = tl.arange(0, BLOCK_N)
        # key tiles every query of the tile sees (keys up to its first query's position,
        # ctx - n + m0): no masks, no per-element select; the rest (the diagonal) below
        lo = tl.minimum((ctx - n + m0 + 1) // BLOCK_N, hi // BLOCK_N)
        lo = tl.maximum(lo, 0) * BLOCK_N  # (never below 0, were a chunk's n > ctx)
        for t0 in range(0, lo, BLOCK_N):
            tok = t0 + nn
            phys = tl.load(BT + c * stride_bt + tok // BLOCK_SIZE)
            off = (phys.to(tl.int64) * stride_kb + (tok % BLOCK_SIZE) * stride_kt
                   + kvh * stride_kh)
            m_i, l_i, acc = attend_tile(q, K, V, off, d, None, None, scale_log2, m_i, l_i,
                                        acc, IEEE, MASKED=False)
        for t0 in range(lo, hi, BLOCK_N):
            tok = t0 + nn
            valid = tok < hi
            phys = tl.load(BT + c * stride_bt + tok // BLOCK_SIZE, mask=valid, other=0)
            off = phys.to(tl.int64) * stride_kb + (tok % BLOCK_SIZE) * stride_kt + kvh * stride_kh
            see = valid[None, :] & (tok[None, :] <= qpos[:, None])
            m_i, l_i, acc = attend_tile(q, K, V, off, d, valid, see, scale_log2, m_i, l_i, acc,
                                        IEEE)
        o = acc / l_i[:, None]
        tl.store(Out + (qs + i)[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
                 o.to(Out.dtype.element_ty), mask=qmask[:, None])


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """How the prefill attention is launched: ``packed`` query heads of a KV head per program
    (1: a program a head), whether their rows are ``interleave``d in one block of ``BLOCK_M``
    rows (a part of the tile's queries a program) or stacked (``BLOCK_M`` queries a head), the
    key tile, warps and pipeline stages. The default is the fastest measured on the H100
    (bench/RESULTS.md); the kernel micro-benchmark (scripts/gpu/) sweeps the others."""
    packed: int = 2
    block_n: int = BLOCK_N
    warps: int = 4
    stages: int = 2
    interleave: int = 1  # packed heads' rows interleaved in one block (0: stacked)

    def __post_init__(self) -> None:
        for key in ("packed", "block_n", "warps"):
            v = getattr(self, key)
            if v < 1 or v & (v - 1):
                raise ValueError(f"KernelChoice.{key} must be a power of two, not {v}")

    def heads_per_program(self, gqa: int) -> int:
        """Query heads a program takes: ``packed``, or fewer where the group is smaller."""
        p = self.packed
        while gqa % p:
            p //= 2
        return p


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, batch: PrefillBatch, scale: float,
                      out: torch.Tensor, choice: Optional[KernelChoice] = None) -> None:
    """Write attention of every prefill row of ``batch`` into ``out`` (q, out: ``[T, H, D]``;
    cache: ``[2, num_blocks, block_size, Hkv, D]`` with this step's K/V already written).
    ``choice``: how to launch it (the default ``KernelChoice()`` unless a benchmark asks)."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, block_size = cache.shape[3], cache.shape[2]
    k, v = cache[0], cache[1]
    choice = choice or _DEFAULT
    gqa = heads // kv_heads
    gp = choice.heads_per_program(gqa)
    args = (q, k, v, out, batch.tile_chunk, batch.tile_m0, batch.q_start, batch.q_len,
            batch.ctx_len, batch.block_table,
            scale * 1.4426950408889634,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k.stride(0), k.stride(1), k.stride(2), batch.block_table.stride(0))
    inter = bool(choice.interleave) and 1 < gp <= BLOCK_M // 8  # (at least 8 queries a part)
    common = dict(HEAD_DIM=dim, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_N=choice.block_n,
                  IEEE=q.dtype == torch.float32, INTERLEAVE=inter,
                  num_warps=choice.warps, num_stages=choice.stages)
    grid = (batch.tile_chunk.shape[0], heads if inter else heads // gp)
    _prefill_kernel[grid](*args, GQA=gqa, GP=gp, **common)


_DEFAULT = KernelChoice()

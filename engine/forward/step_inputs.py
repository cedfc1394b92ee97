"""One packed forward: rows → token ids, positions, KV slots and attention metadata on the
device, then the model (or a CUDA-graph replay). Shared by the runner and the draft speculator.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from engine.kv.kv_cache import blocks_needed
from engine.model import woq_forward
from engine.model.attention import (MAX_BATCHED_QUERIES, AttentionMetadata, PrefillSeq,
                                    context_groups)
from engine.ops.host_arrays import long_tensor, padded_rows
from engine.ops.triton import prefill_attention

# (tokens to compute, position of the first one, the sequence's KV block ids, as decode rows?)
Seq = tuple[list[int], int, list[int], bool]


def packed_forward(model, kv: torch.Tensor, state, graphs, device: torch.device,
                   block_size: int, seqs: Iterable[Seq],
                   fill: Optional[list[tuple[int, int]]] = None,
                   tables: Optional[Sequence] = None) -> torch.Tensor:
    """Hidden states ``[T, hidden]`` for every token of ``seqs``, in order.

    A sequence computed "as decode rows" gives one batched decode row per token, each attending
    to its own prefix (all K/V of the step is written before attention, so this is exact); the
    others are prefill chunks. A step made only of decode rows replays a CUDA graph when
    ``graphs`` has a bucket for it: padded rows write to the graphs' scratch slot/block.

    ``fill``: ``(packed row, sampled row)`` pairs whose token id is still on the device (a
    placeholder in ``seqs``): taken from ``state``'s ``sampled`` buffer, written by the step
    before (stream order makes it ready), without a round trip through the host.

    ``tables``: per sequence, its blocks as an array (``host_arrays.block_table``) or None;
    the decode rows' block tables are then copied from those arrays in one call.
    """
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    prefills: list[PrefillSeq] = []
    dec_rows: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    dec_arrays: Optional[list] = None if tables is None else []  # dec_tables' rows as arrays
    with_context: list[tuple[int, int, int, list[int]]] = []
    # on CUDA every prefill chunk goes to one paged Triton kernel a layer (engine/ops/triton/prefill_attention.py);
    # a model told ``use_fused = False`` runs the plain torch path throughout (the reference);
    # one built with the ``triton`` kill switch off (engine/envs.py) runs no Triton kernel
    cfg = getattr(model, "config", None)
    triton = getattr(model, "switches", None) is None or model.switches.triton
    paged = (cfg is not None and triton and getattr(model, "use_fused", None) is not False
             and prefill_attention.usable(device, cfg.head_dim, bs))
    chunks: list[tuple[int, int, int, list[int]]] = []
    for i, (toks, start, blocks, as_decode) in enumerate(seqs):
        m = len(toks)
        row0 = len(ids)
        table = blocks if tables is None or tables[i] is None else tables[i]  # (dec_arrays')
        if as_decode and m == 1:  # (most rows of a step: one decode token, no loop)
            ids.append(toks[0])
            pos.append(start)
            slots.append(blocks[start // bs] * bs + start % bs)
            dec_rows.append(row0)
            dec_tables.append(blocks)
            if dec_arrays is not None:
                dec_arrays.append(table)
            dec_lens.append(start + 1)
            continue
        ids.extend(toks)
        pos.extend(range(start, start + m))
        _extend_slots(slots, blocks, start, start + m, bs)
        if as_decode:
            for j in range(m):
                dec_rows.append(row0 + j)
                dec_tables.append(blocks)
                if dec_arrays is not None:
                    dec_arrays.append(table)
                dec_lens.append(start + j + 1)
        elif paged:
            chunks.append((row0, m, start + m, blocks))
        elif 0 < start and m <= MAX_BATCHED_QUERIES:  # short, after context: batched
            with_context.append((row0, m, start + m, blocks))
        else:
            prefills.append(PrefillSeq(row0, row0 + m, start + m, long_tensor(
                blocks[: blocks_needed(start + m, bs)]).to(device)))
    t = len(ids)
    bucket: Optional[int] = None
    mixed: Optional[int] = None  # the rows of a graphed step with prompt chunks
    if graphs is not None and not prefills and not with_context and not chunks and len(dec_rows) == t:
        bucket = graphs.bucket(t)
    elif graphs is not None and chunks and not prefills and not with_context:
        # a graphed step with prompt chunks runs at the eager row count below
        # (engine/forward/mixed_inputs.py ``rows``)
        mixed = graphs.mixed_rows(t, len(chunks), len(dec_rows))
    if bucket is not None:
        pad = bucket - t
        ids += [0] * pad
        pos += [0] * pad
        slots += [graphs.scratch_slot] * pad
        dec_lens += [1] * pad
        dec_tables += [[graphs.scratch_block]] * pad
        if dec_arrays is not None:
            dec_arrays += [[graphs.scratch_block]] * pad
    elif graphs is not None and chunks:
        # NOTE: an eager step runs every linear at its own row count, and cuBLAS picks a kernel
        # for each new (rows, shape) on the host: prefill steps of a new token count were
        # host-bound on the H200. Their rows are padded to a few sizes (at most 1/8
        # more rows); padded rows are no chunk's and no decode row's, and write their K/V to
        # the graphs' scratch slot, which no sequence reads.
        pad = min(eager_rows(t), state.buffers["input_ids"].shape[0]) - t
        if pad > 0:
            ids += [0] * pad
            pos += [0] * pad
            slots += [graphs.scratch_slot] * pad
    input_ids = state.load("input_ids", long_tensor(ids))
    if fill:
        idx = long_tensor(fill).to(device, non_blocking=True)
        input_ids.index_copy_(0, idx[:, 0], state.buffers["sampled"].index_select(0, idx[:, 1]))
    positions = state.load("positions", long_tensor(pos))
    if mixed is not None:
        assert len(ids) == mixed, (len(ids), mixed)  # padded above, at the eager row count
        slot_mapping = state.load("slot_mapping", long_tensor(slots))
        meta = graphs.mixed.meta(mixed, slot_mapping, state, chunks, dec_rows,
                                 dec_tables if dec_arrays is None else dec_arrays, dec_lens)
        return graphs.run_mixed(mixed, model, kv, state, meta)[:t]
    meta = AttentionMetadata(state.load("slot_mapping", long_tensor(slots)), prefills,
                             None, None, None, triton_decode=triton)
    if with_context:
        meta.context_groups = context_groups(with_context, bs, device)
    if chunks:
        meta.prefill_batch = prefill_attention.build(chunks, bs, device)
    if dec_rows:
        width = max(len(b) for b in dec_tables)
        meta.decode_block_tables = state.load(
            "block_tables", padded_rows(dec_tables if dec_arrays is None else dec_arrays, width))
        meta.decode_context_lens = state.load("context_lens", long_tensor(dec_lens))
        meta.decode_max_len = max(dec_lens)
        if bucket is None:
            meta.decode_rows = long_tensor(dec_rows).to(device, non_blocking=True)
        if (len(dec_rows) == t and getattr(model, "woq_forward", False)  # its only reader,
                and woq_forward.cpp_step(model, kv) is None):  # unless its step runs in C++
            meta.decode_spans = _spans(dec_tables, dec_lens, bs)
    if bucket is not None:
        return graphs.run(bucket, model, kv, state)[:t]
    out = model(input_ids, positions, kv, meta)
    return out if out.shape[0] == t else out[:t]


def eager_rows(t: int) -> int:
    """The row count an eager step of ``t`` tokens runs at: ``t`` rounded up to a multiple of
    64 (from 1,024 tokens on, of ``2**(bits - 4)``): fewer than 64 or ``t / 8`` more rows, 24
    sizes up to 2,048 tokens, 40 up to 8,192."""
    step = max(64, 1 << max(0, t.bit_length() - 4))
    return -(-t // step) * step


def _extend_slots(slots: list[int], blocks: list[int], lo: int, hi: int, bs: int) -> None:
    """Append the KV slots of positions ``lo..hi-1`` (a run of consecutive slots per block)."""
    while lo < hi:
        j, off = divmod(lo, bs)
        end = min(hi, lo - off + bs)
        base = blocks[j] * bs - (lo - off)
        slots.extend(range(base + lo, base + end))
        lo = end


def _spans(tables: list[list[int]], lens: list[int], bs: int) -> Optional[list[tuple[int, int]]]:
    """Each decode row's ``(first slot, context length)`` if the blocks holding its context are
    consecutive ids, else None (for all rows)."""
    out = []
    for blocks, n in zip(tables, lens):
        first = blocks[0]
        used = blocks_needed(n, bs)
        if blocks[:used] != list(range(first, first + used)):
            return None
        out.append((first * bs, n))
    return out

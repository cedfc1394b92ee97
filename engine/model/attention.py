"""Attention over the paged KV cache.

One step's tokens are packed as ``[T, ...]``. A prefill chunk with no earlier context is one
causal SDPA call on this step's own K/V. Chunks that continue earlier context (a cached prefix,
the next chunk of a long prompt) are batched: :func:`context_groups` packs them, once per step,
into a few padded groups (query rows, K/V slots, mask), each one gather and one SDPA call per
layer -- per-sequence calls cost ~20 kernel launches a sequence a layer, which made prefills after
a prefix-cache hit host-bound (measured on the H200: ~6k tok/s against ~40k without context).
Chunks longer than :data:`MAX_BATCHED_QUERIES` stay per sequence. Single-token decodes are batched: on CUDA with Triton by the paged decode kernel in
:mod:`.triton_attention` (reads K/V blocks through the block table; graph safe), elsewhere with
a padded gather of their blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from engine.ops.host_arrays import long_tensor, padded_rows
from engine.ops.triton import decode_attention, prefill_attention


@dataclasses.dataclass
class PrefillSeq:
    start: int  # first row in the packed batch
    end: int  # one past the last row
    context_len: int  # tokens in the sequence's cache after this step (prefix + chunk)
    block_table: torch.Tensor  # [n_blocks] long, on device


@dataclasses.dataclass
class ContextGroup:
    """Prefill chunks that continue earlier context, padded to one batch: ``B`` chunks of at
    most ``N`` queries over at most ``C`` cached keys."""
    q_rows: torch.Tensor  # [B, N] long: packed rows of the queries (padding repeats a real row)
    kv_slots: torch.Tensor  # [B, C] long: flat cache slots of each chunk's keys (padding: 0)
    mask: torch.Tensor  # [B, 1, N, C] bool: causal over the context, padding masked
    valid: torch.Tensor  # [V] long: indices into the flattened [B * N] that are real queries
    rows: torch.Tensor  # [V] long: their packed rows


@dataclasses.dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each token's k/v goes
    prefills: list[PrefillSeq]  # chunks without earlier context (and, unbatched, any others)
    decode_rows: Optional[torch.Tensor]  # [B] long rows in the packed batch, or None
    decode_block_tables: Optional[torch.Tensor]  # [B, max_blocks] long (padded with 0)
    decode_context_lens: Optional[torch.Tensor]  # [B] long
    decode_max_len: int = 0  # max context among decodes (torch path only; the kernel reads lens)
    context_groups: list[ContextGroup] = dataclasses.field(default_factory=list)
    # the torch decode path's [B, 1, 1, L] key mask: made by the first layer, reused by the rest
    decode_mask: Optional[torch.Tensor] = None
    # every prefill chunk, for the paged Triton kernel (CUDA); then prefills/context_groups are empty
    prefill_batch: Optional[prefill_attention.PrefillBatch] = None
    # a woq model's step of decode rows only whose every sequence's blocks are consecutive: each
    # row's (first KV slot, context length), so that its K/V can be read as a view
    # (engine/model/woq_forward.py)
    decode_spans: Optional[list[tuple[int, int]]] = None
    # False: decode rows take the torch path even where the Triton kernel could run (the
    # ``triton`` kill switch, engine/envs.py)
    triton_decode: bool = True


#: a group's padded queries stay within this factor of its real ones (plus a little slack)
_PAD_FACTOR, _PAD_SLACK = 2, 64
#: chunks of at most this many queries are batched; a longer one's per-sequence calls are few
#: against its work (batching those too made chunked long prompts slower on the H200: padding,
#: and scores materialized for the whole group)
MAX_BATCHED_QUERIES = 256


def context_groups(chunks: list[tuple[int, int, int, list[int]]], block_size: int,
                   device: torch.device) -> list[ContextGroup]:
    """Pack ``(first row, queries n, context_len, block ids)`` chunks into padded groups.

    Sorted by ``n``, a chunk joins the current group while the group's padded queries
    (``len * max n``) stay within :data:`_PAD_FACTOR` of its real ones: a long chunk never pads
    many short ones to its length (the scores are ``B x H x N x C``)."""
    groups: list[list[tuple[int, int, int, list[int]]]] = []
    for c in sorted(chunks, key=lambda c: -c[1]):
        g = groups[-1] if groups else None
        if g is not None and (len(g) + 1) * g[0][1] <= _PAD_FACTOR * (sum(x[1] for x in g) + c[1]) + _PAD_SLACK:
            g.append(c)
        else:
            groups.append([c])
    out = []
    for g in groups:
        row0, n, ctx = long_tensor([x[i] for i in range(3) for x in g]).view(3, -1)
        n_max, c_max = int(n[0]), int(ctx.max())
        width = -(-c_max // block_size)
        table = padded_rows([x[3] for x in g], width)
        i = torch.arange(n_max)
        q_rows = row0[:, None] + torch.minimum(i[None, :], n[:, None] - 1)
        p = torch.arange(c_max)
        kv_slots = table[:, p // block_size] * block_size + p % block_size
        # padding keys read the chunk's own first slot: computed, finite, and masked out
        kv_slots = torch.where(p[None, :] < ctx[:, None], kv_slots, kv_slots[:, :1])
        # query i sits at position ctx - n + i and sees keys 0..that position (padding queries:
        # the last real one's, so that no row is all masked)
        qpos = torch.minimum((ctx - n)[:, None] + i[None, :], ctx[:, None] - 1)
        mask = (qpos[:, :, None] >= p[None, None, :])[:, None]
        real = i[None, :] < n[:, None]
        flat = torch.nonzero(real.reshape(-1)).squeeze(1)
        out.append(ContextGroup(q_rows.to(device), kv_slots.to(device), mask.to(device),
                                flat.to(device), q_rows.reshape(-1)[flat].to(device)))
    return out


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """cache: [2, num_blocks, block_size, Hkv, D]; k/v: [T, Hkv, D]."""
    kv_heads, dim = k.shape[1], k.shape[2]
    cache[0].view(-1, kv_heads, dim).index_copy_(0, slots, k.to(cache.dtype))
    cache[1].view(-1, kv_heads, dim).index_copy_(0, slots, v.to(cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (this step's, already written to ``cache``). -> [T, H, D]"""
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], k.shape[1]
    gqa = heads // kv_heads
    # NOTE: decode rows first: a graphed step's padding decode rows write into a prefill row,
    # which the prefill kernel then overwrites (engine/forward/mixed_inputs.py)
    if meta.decode_rows is not None and meta.triton_decode and decode_attention.supported(q, cache):
        decode_attention.decode_attention(q, cache, meta.decode_rows, meta.decode_block_tables,
                                          meta.decode_context_lens, scale, out)
    elif meta.decode_rows is not None:
        decode_attention_torch(q, cache, meta, scale, out)
    if meta.prefill_batch is not None:
        prefill_attention.prefill_attention(q, cache, meta.prefill_batch, scale, out)
    if meta.context_groups:
        kf = cache[0].view(-1, kv_heads, k.shape[2])
        vf = cache[1].view(-1, kv_heads, k.shape[2])
        for g in meta.context_groups:
            qb = q[g.q_rows].transpose(1, 2)  # [B, H, N, D]
            kb = kf[g.kv_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, C, D]
            vb = vf[g.kv_slots].transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.mask, scale=scale,
                                               enable_gqa=gqa > 1)
            out[g.rows] = o.transpose(1, 2).reshape(-1, heads, q.shape[2])[g.valid]
    for p in meta.prefills:
        n = p.end - p.start
        qs = q[p.start:p.end].transpose(0, 1)  # [H, n, D]
        if p.context_len == n:  # no earlier context: use this step's k/v directly
            ks, vs = k[p.start:p.end], v[p.start:p.end]
            mask, causal = None, True
        else:
            ks = cache[0][p.block_table].reshape(-1, kv_heads, k.shape[2])[: p.context_len]
            vs = cache[1][p.block_table].reshape(-1, kv_heads, k.shape[2])[: p.context_len]
            # query i sits at position context_len - n + i and sees keys 0..that position
            qpos = torch.arange(p.context_len - n, p.context_len, device=q.device)
            mask = qpos[:, None] >= torch.arange(p.context_len, device=q.device)[None, :]
            causal = False
        ks, vs = ks.transpose(0, 1).to(q.dtype), vs.transpose(0, 1).to(q.dtype)
        grouped = gqa > 1
        if grouped and q.device.type == "cpu":
            # NOTE: on CPU, enable_gqa (or 3-D inputs) send SDPA to its math kernel (bmm,
            # softmax, masks: ~5 s of a 1,000-token prefill of the default model, measured);
            # K/V repeated per query head take the fused flash kernel, as transformers' repeat_kv.
            ks, vs, grouped = ks.repeat_interleave(gqa, 0), vs.repeat_interleave(gqa, 0), False
        if q.device.type == "cpu":  # and only 4-D inputs take it: a batch of one
            qs, ks, vs = qs[None], ks[None], vs[None]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal,
                                           scale=scale, enable_gqa=grouped)
        o = o[0] if o.dim() == 4 else o
        out[p.start:p.end] = o.transpose(0, 1)
    return out


def decode_attention_torch(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, out: torch.Tensor) -> None:
    """The decode rows by a padded gather of their blocks (CPU path, fallback, reference)."""
    heads, kv_heads, dim = q.shape[1], cache.shape[3], cache.shape[4]
    gqa = heads // kv_heads
    block_size = cache.shape[2]
    rows = meta.decode_rows
    bt = meta.decode_block_tables[:, : (meta.decode_max_len + block_size - 1) // block_size]
    bsz = bt.shape[0]
    ks = cache[0][bt].reshape(bsz, -1, kv_heads, dim)  # [B, L, Hkv, D]
    vs = cache[1][bt].reshape(bsz, -1, kv_heads, dim)
    length = ks.shape[1]
    mask = meta.decode_mask
    if mask is None or mask.shape[-1] != length:
        mask = (torch.arange(length, device=q.device)[None, :]
                < meta.decode_context_lens[:, None])[:, None, None, :]
        meta.decode_mask = mask
    # NOTE: one query per sequence, so the gqa query heads that share a KV head can stand in
    # the query-length dimension: [B, Hkv, gqa, D] against [B, Hkv, L, D], no K/V repeat.
    qd = q[rows].view(bsz, kv_heads, gqa, -1)
    ks = ks.permute(0, 2, 1, 3).to(q.dtype)
    vs = vs.permute(0, 2, 1, 3).to(q.dtype)
    o = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=mask, scale=scale)
    out[rows] = o.reshape(bsz, heads, -1)

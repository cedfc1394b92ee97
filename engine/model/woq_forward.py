"""The forward of a model packed for ``woq`` (engine/model/cpu_weights.py), in fewer op calls.

On the 2-core CPU a decode step of the default model was ~2,600 eager op calls (~87 a layer),
each costing microseconds of dispatch beside ~8 ms of int4 kernels: the calls, not the
arithmetic, were half the step. This path computes what :meth:`CausalLM.forward` computes with
the woq weights, in the same dtypes (float32 residual, norms, rotary and attention; the packed
linears take and return float32: :meth:`PackedLinear.mm`), with fewer calls:

* each norm is one ``F.rms_norm`` (float32, the same arithmetic);
* q and k are rotated as one tensor: ``x * cos2 + swap_halves(x) * sin2`` with
  ``cos2 = (cos, cos)`` and ``sin2 = (-sin, sin)`` is, element for element, the half-split
  formula of :class:`~engine.model.llama.Rotary` (``a + x * -s`` is ``a - x * s`` exactly);
* the residual adds the linears' outputs in place;
* a step of decode rows only reads K/V without the per-layer gather where it can: a sequence
  whose blocks are consecutive (:attr:`AttentionMetadata.decode_spans`) attends to a view of the
  cache, otherwise K and V are gathered in one index op (not two); the query and output rows
  are the step's rows as they are (no index ops).

Prefill and mixed steps take :func:`engine.model.attention.paged_attention` as the generic path does.
A step of decode rows only runs in one C++ call where the extension is built
(engine/ops/cpu/csrc/woq_decode.cpp: these ops, this order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.cpu import cpu_ext
from engine.ops.cpu.packed_linear import DENSE_ROWS, PackedLinear

from .attention import AttentionMetadata, paged_attention

#: decode rows with consecutive blocks attend through views of the cache, one SDPA call each,
#: up to this many rows a step; more share one gathered, masked call (fewer calls). Measured
#: (default model, 1 thread, 8 rows): a step at context 128 took 53.8 ms through views against
#: 58.4 ms gathered, at context 512 73.8 against 106.1 ms (the gather copies every layer's K/V)
MAX_SPAN_ROWS = 64
#: a step of decode rows only runs in one C++ call where the extension is built (tests turn
#: this off for the Python loop it must match)
CPP_STEP = True


def usable(model) -> bool:
    """The model is packed with bf16 activations, q/k/v and gate/up fused, no q/k norm and no
    biases (what this path computes); others keep the generic forward."""
    head = model.packed_head
    if head is not None and not (isinstance(head, PackedLinear)):
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        lins = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if attn.qk_norm or not all(isinstance(m, PackedLinear) and m.act_dtype == torch.bfloat16
                                   and m.kind == "int4" for m in lins):
            return False
    return True


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
    m = model.model
    cfg = model.config
    x = model.packed_head.rows(input_ids) if model.embed_from_head else m.embed_tokens(input_ids)
    t = x.shape[0]
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_width, kv_width = heads * dim, kv_heads * dim
    qk_heads = heads + kv_heads
    cos, sin = m.rotary.tables(positions)  # [T, 1, D/2] float32
    cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
    decode_only = (meta.decode_rows is not None and not meta.prefills and not meta.context_groups
                   and meta.prefill_batch is None and meta.decode_rows.shape[0] == t)
    hidden = (cfg.hidden_size,)
    scale = dim ** -0.5
    ext = cpp_step(model, kv) if decode_only else None
    if ext is not None:
        return _decode_cpp(ext, model, x, cos2, sin2, kv, meta, scale)
    for layer, cache in zip(m.layers, kv.unbind(0)):
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        h = F.rms_norm(x, hidden, norm.weight, norm.eps)
        qkv = attn.qkv_proj.mm(h)  # [T, q + k + v] float32
        qk = qkv[:, : q_width + kv_width].view(t, qk_heads, dim)
        swapped = qk.view(t, qk_heads, 2, dim // 2).flip(2).view(t, qk_heads, dim)
        torch.add(qk * cos2, swapped * sin2, out=qk)  # rotated in place: k stays beside v
        q = qk[:, :heads]
        # this step's k and v, [2, T, Hkv, D], written to the cache in one call
        new_kv = qkv[:, q_width:].view(t, 2, kv_heads, dim).transpose(0, 1)
        cache.view(2, -1, kv_heads, dim).index_copy_(1, meta.slot_mapping, new_kv)
        if decode_only:
            o = _decode_attention(q, cache, meta, scale)
        else:
            o = paged_attention(q, new_kv[0], new_kv[1], cache, meta, scale)
        x.add_(attn.o_proj.mm(o.reshape(t, q_width)))
        norm = layer.post_attention_layernorm
        h = F.rms_norm(x, hidden, norm.weight, norm.eps)
        gu = mlp.gate_up_proj.mm(h)
        inter = gu.shape[1] // 2
        a = F.silu(gu[:, :inter]).mul_(gu[:, inter:])
        x.add_(mlp.down_proj.mm(a))
    return F.rms_norm(x, hidden, m.norm.weight, m.norm.eps)


def _weights(model) -> list[torch.Tensor]:
    """Every layer's tensors in engine/ops/cpu/csrc/woq_decode.cpp's order, then the final norm's
    (gathered each step: a list kept across steps would hold tensors that sleep or release
    replace or empty)."""
    none = torch.empty(0)
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out.append(layer.input_layernorm.weight)
        for i, lin in enumerate((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            if i == 2:
                out.append(layer.post_attention_layernorm.weight)
            b = lin._buffers
            if "q4" in b:
                out += (b["q4"], b["d16"], b["m16"], b.get("dense", none))
            else:
                out += (b["qweight"], b["scales_zeros"], none, b.get("dense", none))
    out.append(model.model.norm.weight)
    return out


def _decode_cpp(ext, model, x, cos2, sin2, kv, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The decode-only step in one C++ call (engine/ops/cpu/csrc/woq_decode.cpp)."""
    cfg = model.config
    eps = model.model.layers[0].input_layernorm.eps
    lo, amx = cpu_ext.int4_options()
    return ext.woq_decode(x.contiguous(), _weights(model), kv, cos2, sin2, meta.slot_mapping,
                          meta.decode_block_tables, meta.decode_context_lens, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, eps, scale, DENSE_ROWS, lo, amx)


def cpp_step(model, kv: torch.Tensor):
    """The extension where a step of ``model``'s decode rows runs in C++ here (then the Python
    loop's views, ``AttentionMetadata.decode_spans``, go unread), else None."""
    if not CPP_STEP or kv.dtype != torch.float32:
        return None
    ext = cpu_ext.module()
    return ext if ext is not None and cpp_step_fits(model) else None


def cpp_step_fits(model) -> bool:
    """engine/ops/cpu/csrc/woq_decode.cpp's shapes (multiples of 16: its AVX-512 loops) and an AVX-512
    CPU; float32 activations and cache."""
    cfg = model.config
    return (cfg.hidden_size % 16 == 0 and cfg.intermediate_size % 16 == 0 and cfg.head_dim % 16 == 0
            and cpu_ext.cpu_capability().startswith("AVX512"))


def _decode_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """Attention of a step made of decode rows only (row ``b`` of the step is decode row
    ``b``; this step's K/V already written). q: [B, H, D] -> [B, H, D]."""
    bsz, heads, dim = q.shape
    kv_heads = cache.shape[3]
    gqa = heads // kv_heads
    # NOTE: one query per sequence, so the gqa query heads that share a KV head stand in the
    # query-length dimension: [B, Hkv, gqa, D] against [B, Hkv, L, D], no K/V repeat
    qd = q.reshape(bsz, kv_heads, gqa, dim)
    block_size = cache.shape[2]
    width = (meta.decode_max_len + block_size - 1) // block_size
    length = width * block_size
    mask = meta.decode_mask  # [B, 1, 1, L]: made by the first layer, reused by the rest
    if mask is None or mask.shape[-1] != length:
        mask = (torch.arange(length, device=q.device)[None, :]
                < meta.decode_context_lens[:, None])[:, None, None, :]
        meta.decode_mask = mask
    spans = meta.decode_spans
    if spans is not None and bsz <= MAX_SPAN_ROWS:
        # NOTE: each row reads whole blocks and the same mask as the gathered call (not just its
        # context, unmasked): SDPA then sums in the same order, and the outputs are the
        # gathered path's bit for bit (measured: unmasked, greedy agreement with fp32 moved)
        flat = cache.view(2, -1, kv_heads, dim)
        outs = []
        for b, (first, n) in enumerate(spans):
            used = (n + block_size - 1) // block_size * block_size
            kvs = flat[:, first:first + used].permute(0, 2, 1, 3)  # [2, Hkv, L, D], a view
            outs.append(F.scaled_dot_product_attention(qd[b:b + 1], kvs[0:1], kvs[1:2],
                                                       attn_mask=mask[b:b + 1, ..., :used], scale=scale))
        o = outs[0] if bsz == 1 else torch.cat(outs)
        return o.view(bsz, heads, dim)
    bt = meta.decode_block_tables[:, :width]
    # one gather of K and V ([2, B, Hkv, L, D]); index_select beat indexing here (106 vs 147 us)
    kvs = cache.index_select(1, bt.reshape(-1)).view(2, bsz, -1, kv_heads, dim).permute(0, 1, 3, 2, 4)
    o = F.scaled_dot_product_attention(qd, kvs[0], kvs[1], attn_mask=mask, scale=scale)
    return o.view(bsz, heads, dim)


__all__ = ["forward", "usable", "cpp_step", "MAX_SPAN_ROWS", "CPP_STEP"]

"""The batch-invariant forward of deterministic mode (``EngineConfig.deterministic``).

A token's hidden states, logits and logprobs are computed by arithmetic that depends only on the
token's own row and the K/V of its sequence: not on how many other rows share the step, on where
the row sits among them, on how its prompt was chunked, on whether its keys were computed this
step, by an earlier chunk or by another request (a cached prefix), or on the schedule
(preemption, overlap). :func:`make_invariant` turns a loaded :class:`~engine.model.llama.CausalLM`
into one, once, at load (a class swap: the parameters and their names stay as they are); the
default path is not touched.

Op by op (each checked on its own in tests/test_deterministic.py):

* linears (:func:`linear`): the rows in tiles of :data:`TILE_ROWS` (the last padded with zeros),
  all tiles in one ``bmm`` against the weight, so every GEMM the BLAS runs has the same shape
  whatever the row count. ``F.linear`` on CPU picks its kernel by row count (MKL: one row, two or
  three, four and more gave three different results for the same row, measured in float32);
  within a tile of fixed shape a row's result did not depend on its place nor on the other rows,
  nor on 1 vs 2 threads (measured).
* attention: engine/ops/cpu/invariant_attention.py (per query over its own keys, read through its
  block table; a C++ kernel, or torch ops).
* SiLU (:func:`silu`): ``x / (1 + exp(-x))``. ``F.silu``'s CPU kernel computes the elements
  past its last whole pair of vectors with a scalar ``exp`` that rounds differently from the
  vector one, so an element's value depended on where the tensor ended (measured: 21 of ~1,500
  elements); ``torch.exp`` runs one routine over every element (MKL's vector math, or a vector
  map that loads the tail partially).
* RMSNorm, rotary, the residual adds, the embedding: row-wise already (one reduction per row over
  the hidden size, exactly rounded elementwise ops); unchanged.
* the LM head: :func:`linear`; logprobs: engine/sample/logprobs.py ``device_rows_invariant``.

On the CPU the model runs the plain decoder (no fused kernels, no packed weights). On CUDA
(``InvariantCausalLM._forward_cuda``) it runs the default path's fused per-row kernels around
engine/ops/triton/invariant.py's GEMM and attention (over the step's decode rows and its prompt
chunks as the paged prefill kernel's metadata describes them), steps replayed from CUDA graphs
where the default path's are (a row's arithmetic is the same in a padded graph as eagerly).
Tensor parallel shards swap the same way: ``RowParallelLinear``'s partial product is an
invariant linear, then all-reduced (with two ranks one addition, exact in either order).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.ops.cpu import invariant_attention
from engine.ops.triton import fused_ops, invariant as gpu_invariant, prefill_attention

from .attention import AttentionMetadata, write_kv
from .llama import CausalLM, RMSNorm

#: rows per GEMM tile (see the module docstring): a step of fewer rows pays for this many.
#: Measured (one thread, float32, the default model's q/k/o/gate/down shapes, ms): 1 row 0.28
#: through F.linear against 0.99 / 1.27 / 2.01 in tiles of 8 / 16 / 32; 2,048 rows 99 against
#: 182 / 139 / 117 (many small GEMMs run slower than one large one)
TILE_ROWS = 16

#: CUDA: a linear without ``k_parts`` sums its input dimension in this many fixed slices (their
#: float32 products added in order, not rounded): a decode step's few rows then run a slice a
#: program and still fill the device (engine/ops/triton/invariant.py). The slices depend on the
#: input dimension only, which a tensor-parallel shard of these linears keeps whole.
K_SPLIT = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with every row computed in a GEMM of one shape (on CUDA:
    engine/ops/triton/invariant.py's GEMM, one configuration for every row count)."""
    if gpu_invariant.usable(x.device):  # CUDA (or Triton's CPU interpreter: tests)
        return gpu_invariant.linear(x, weight, bias)
    k, n = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, k)
    t = rows.shape[0]
    pad = -t % TILE_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    tiles = rows.view(-1, TILE_ROWS, k)
    y = torch.bmm(tiles, weight.t().expand(tiles.shape[0], k, n)).view(-1, n)[:t]
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU in float32 through ``torch.exp`` (see the module docstring), in ``x``'s dtype."""
    xf = x.float()
    return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)


def partial_products(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """``[parts, *x.shape[:-1], N]`` float32: the products of ``x`` and ``weight`` over each of
    ``parts`` equal slices of the input dimension (:func:`linear`, in x's dtype)."""
    if gpu_invariant.usable(x.device):
        return gpu_invariant.partial_products(x, weight, parts)
    k = x.shape[-1] // parts
    return torch.stack([linear(x[..., i * k:(i + 1) * k].contiguous(),
                               weight[:, i * k:(i + 1) * k]).float() for i in range(parts)])


def add_in_order(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` left to right in float32, then ``dtype``."""
    y = parts[0]
    for p in parts[1:]:
        y = y + p
    return y.to(dtype)


class InvariantLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`linear`. ``k_parts`` (the o and down
    projections, :func:`make_invariant`): the input dimension in that many slices (one per KV
    head's share), their products added in order (:func:`add_in_order`) -- what a tensor-
    parallel shard's ``RowParallelLinear`` computes from every rank's slices (engine/tp/
    layers.py), so that TP=w gives TP=1's bits for every w dividing the KV heads."""

    k_parts = 0  # 0: one GEMM

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.k_parts < 2:
            if gpu_invariant.usable(x.device):  # in K_SPLIT slices where the input divides
                s = K_SPLIT if self.in_features % (K_SPLIT * gpu_invariant.BLOCK_K) == 0 else 1
                return gpu_invariant.linear(x, self.weight, self.bias, parts=s, rounded=False)
            return linear(x, self.weight, self.bias)
        if gpu_invariant.usable(x.device):  # the same sum, in one launch
            return gpu_invariant.linear(x, self.weight, self.bias, parts=self.k_parts)
        y = add_in_order(partial_products(x, self.weight, self.k_parts), x.dtype)
        return y if self.bias is None else y + self.bias


class InvariantRMSNorm(RMSNorm):
    """An ``RMSNorm`` that on CUDA reduces each row in a program of its own (fused_ops'
    kernel, rounded at the same points as the torch forward): torch's CUDA reduction sizes its
    thread blocks by the number of rows, so a row's sum depended on the batch. On the CPU the
    torch forward (one row per thread) is kept."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gpu_invariant.usable(x.device):
            return fused_ops.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


def row_tables(meta: AttentionMetadata, positions: torch.Tensor,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each packed row's block table ``[T, W]`` and visible key count ``[T]`` (its position + 1),
    from the step's attention metadata (decode rows, prefill chunks, batched chunks after
    context): made once per step, read by every layer (the CPU's attention; on CUDA the kernel
    reads the step's decode rows and paged prompt chunks as they are)."""
    t = positions.shape[0]
    dev = positions.device
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, their tables)
    if meta.decode_rows is not None:
        parts.append((meta.decode_rows, meta.decode_block_tables))
    if meta.prefill_batch is not None:
        raise RuntimeError("the paged prefill kernel's metadata has no per-row tables: a "
                           "deterministic model on the CPU runs with use_fused = False")
    for p in meta.prefills:
        rows = torch.arange(p.start, p.end, device=dev)
        parts.append((rows, p.block_table[None].expand(p.end - p.start, -1)))
    for g in meta.context_groups:
        # a chunk's keys' slots, position by position: its blocks are every block_size-th one's
        tables = g.kv_slots[:, ::block_size] // block_size  # [B, C / bs]
        parts.append((g.rows, tables[g.valid // g.q_rows.shape[1]]))
    width = max((tb.shape[1] for _, tb in parts), default=1)
    tables = torch.zeros(t, width, dtype=torch.long, device=dev)
    for rows, tb in parts:
        tables[rows, : tb.shape[1]] = tb
    return tables, positions + 1


class InvariantCausalLM(CausalLM):
    """A :class:`CausalLM` whose forward and logits are batch-invariant (module docstring)."""

    #: (q, cache, tables, lens, scale) -> attention output; set by :func:`make_invariant`
    attention_kernel = staticmethod(invariant_attention.attention_torch)
    #: the CUDA forward (engine/ops/triton/invariant.py's attention over the step's decode rows
    #: and paged prompt chunks, the fused per-row kernels); set by :func:`make_invariant`
    triton_forward = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.triton_forward:
            if meta.prefills or meta.context_groups:
                raise RuntimeError("deterministic CUDA forward: every prompt chunk in the paged "
                                   "prefill metadata expected (use_fused not False)")
            rows = None if meta.decode_rows is None else (
                meta.decode_rows, meta.decode_block_tables, meta.decode_context_lens)
            chunks = meta.prefill_batch
            # a step of decode rows only: each row's key segments in programs of their own,
            # merged by a second launch (the same bits)
            return self._forward_cuda(input_ids, positions, kv, meta, lambda q, c, a: (
                gpu_invariant.attention(q, c, a.scale, rows, chunks, split=chunks is None)))
        m = self.model
        t = input_ids.shape[0]
        x = m.embed_tokens(input_ids)
        rot = m.rotary.tables(positions)
        tables, lens = row_tables(meta, positions, kv.shape[3])
        attend = self.attention_kernel
        for i, layer in enumerate(m.layers):
            a, mlp = layer.self_attn, layer.mlp
            q, k, v = a._qkv(layer.input_layernorm(x))
            if a.qk_norm:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = m.rotary(q, rot), m.rotary(k, rot)
            write_kv(kv[i], k, v, meta.slot_mapping)
            x = x + a.o_proj(attend(q, kv[i], tables, lens, a.scale).reshape(t, -1))
            h = layer.post_attention_layernorm(x)
            x = x + mlp.down_proj(silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return m.norm(x)

    def _forward_cuda(self, input_ids, positions, kv, meta, attend) -> torch.Tensor:
        """The forward on CUDA: the default path's fused kernels, each of which computes a row
        (or a row's head) in a program of its own -- RMSNorm with the residual carried beside the
        hidden state, q/k norm + rotary + the K/V write in one kernel, SiLU * up in one pass --
        with the invariant linears (q/k/v and gate/up fused into one each where the runner
        fused them: a column's arithmetic is the same in any GEMM) and attention."""
        m = self.model
        t = input_ids.shape[0]
        x = m.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(m.layers):
            a, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
            if residual is None:
                residual = x
                h = fused_ops.rms_norm(x, norm.weight, norm.eps)
            else:
                h = fused_ops.rms_norm(x, norm.weight, norm.eps, residual)
            q, k, v = a._qkv(h)
            qw, kw = (a.q_norm.weight, a.k_norm.weight) if a.qk_norm else (None, None)
            q, _ = fused_ops.qk_norm_rope_write(q, k, v, qw, kw, a.q_norm.eps if a.qk_norm else 0.0,
                                                m.rotary.cos, m.rotary.sin, positions,
                                                meta.slot_mapping, kv[i])
            x = a.o_proj(attend(q, kv[i], a).reshape(t, -1))
            norm = layer.post_attention_layernorm
            h = fused_ops.rms_norm(x, norm.weight, norm.eps, residual)
            if mlp.gate_up_proj is not None:
                x = mlp.down_proj(fused_ops.silu_mul_halves(mlp.gate_up_proj(h)))
            else:
                x = mlp.down_proj(fused_ops.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        if residual is None:
            return m.norm(x)
        return fused_ops.rms_norm(x, m.norm.weight, m.norm.eps, residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return linear(hidden, w).float()


@functools.lru_cache(maxsize=None)
def _swapped(cls: type, base: type) -> type:
    """``base`` itself for its own parent class, else ``cls`` with ``base`` after it: a subclass
    (``RowParallelLinear``, ``TPCausalLM``) keeps its own forward, whose ``super()`` call then
    reaches ``base``'s."""
    if cls is base.__mro__[1]:
        return base
    return type(f"Invariant{cls.__name__}", (cls, base), {})


def make_invariant(model: CausalLM) -> str:
    """Swap ``model`` (and every linear in it) for the batch-invariant classes, in place; the
    name of the attention it runs (for the log)."""
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and not isinstance(mod, InvariantLinear):
            mod.__class__ = _swapped(type(mod), InvariantLinear)
        elif type(mod) is RMSNorm:
            mod.__class__ = InvariantRMSNorm
    if not isinstance(model, InvariantCausalLM):
        model.__class__ = _swapped(type(model), InvariantCausalLM)
    parts = model.config.num_kv_heads  # (a shard's: its share of them)
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.k_parts = parts if proj.in_features % parts == 0 else 1
    device = model.model.norm.weight.device
    # (16: any power of two -- EngineConfig's block sizes are)
    model.triton_forward = (gpu_invariant.usable(device) and prefill_attention.usable(
        device, model.config.head_dim, 16) and fused_ops.usable(model.model.norm.weight,
                                                                 model.config.head_dim))
    if model.triton_forward:
        # the step's prompt chunks in the paged prefill kernel's metadata (a CUDA graph's
        # mixed steps too: engine/forward/mixed_inputs.py), read by the invariant attention
        model.use_fused = None
        kernel, name = None, "Triton kernel (engine/ops/triton/invariant.py)"
    else:
        model.use_fused = False  # the plain forward builds per-row metadata (row_tables)
        kernel, name = invariant_attention.kernel(device)
    model.attention_kernel = kernel
    model.attention_name = name
    return name


__all__ = ["K_SPLIT", "linear", "silu", "partial_products", "add_in_order", "InvariantLinear",
           "InvariantRMSNorm", "InvariantCausalLM", "make_invariant", "row_tables", "TILE_ROWS"]

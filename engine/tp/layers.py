"""The parallel layers: a rank's :class:`~engine.model.llama.CausalLM` is built from its local shapes
(``shard.local_config``) and gets three kinds of modules swapped in, keeping Hugging Face's
parameter names so the loader fills them as it fills the full model:

* :class:`RowParallelLinear` for ``o_proj`` and ``down_proj``: a partial product, all-reduced;
* :class:`VocabParallelEmbedding`: the rows of this rank's vocabulary slice, others zero,
  all-reduced;
* the LM head (tied or not): this rank's slice of the logits, all-gathered along the vocabulary.

Column-parallel q/k/v and gate/up need nothing but their smaller shapes.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.distributed as dist
import torch.nn.functional as F

from engine.model.invariant import add_in_order, partial_products
from engine.model.llama import CausalLM
from engine.model.model_config import ModelConfig


def _staged(t: torch.Tensor, group) -> bool:
    """gloo with CUDA tensors (ranks sharing a GPU): collectives go through host copies, since
    gloo's CUDA support does not cover every collective used here."""
    return t.is_cuda and dist.get_backend(group) == "gloo"


def all_reduce(t: torch.Tensor, group) -> None:
    if _staged(t, group):
        host = t.cpu()
        dist.all_reduce(host, group=group)
        t.copy_(host)
    else:
        dist.all_reduce(t, group=group)


def all_gather(t: torch.Tensor, world: int, group) -> list[torch.Tensor]:
    src = t.cpu() if _staged(t, group) else t
    parts = [torch.empty_like(src) for _ in range(world)]
    # NOTE: all_gather (not gather): both gloo and NCCL have it; the workers drop theirs.
    dist.all_gather(parts, src, group=group)
    return [p.to(t.device) for p in parts] if src is not t else parts


class RowParallelLinear(nn.Linear):
    """``y = all_reduce(x_local @ W_local^T)``; no bias (o/down projections have none)."""

    def __init__(self, in_features: int, out_features: int, group):
        super().__init__(in_features, out_features, bias=False)
        self.group = group

    k_parts = 0  # deterministic mode: this rank's slices of the input (engine/model/invariant.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.k_parts:  # every rank's slices' products, added in one order on every rank
            world = dist.get_world_size(self.group)
            mine = partial_products(x, self.weight, self.k_parts).contiguous()
            return add_in_order(torch.cat(all_gather(mine, world, self.group)), x.dtype)
        y = super().forward(x)  # nn.Linear's
        all_reduce(y, self.group)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, start + num_embeddings)`` of the full table."""

    def __init__(self, num_embeddings: int, dim: int, start: int, group):
        super().__init__(num_embeddings, dim)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        all_reduce(out, self.group)
        return out


class TPCausalLM(CausalLM):
    """One rank's shard of the decoder; ``logits`` returns the full vocabulary on every rank."""

    def __init__(self, local: ModelConfig, rank: int, world: int, group):
        super().__init__(local)
        self.world, self.group = world, group
        m = self.model
        m.embed_tokens = VocabParallelEmbedding(local.vocab_size, local.hidden_size,
                                                rank * local.vocab_size, group)
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            a.o_proj = RowParallelLinear(a.o_proj.in_features, a.o_proj.out_features, group)
            mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features,
                                              mlp.down_proj.out_features, group)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        part = super().logits(hidden).contiguous()  # [rows, vocab / world], fp32
        return torch.cat(all_gather(part, self.world, self.group), dim=-1)


def create_tp_model(local: ModelConfig, rank: int, world: int, group, device: torch.device,
                    dtype: torch.dtype) -> TPCausalLM:
    """As ``loader.create_model``: allocated on ``device`` uninitialised, fp32 rope tables."""
    with torch.device("meta"):
        model = TPCausalLM(local, rank, world, group)
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary.reset(device)
    return model.train(False).requires_grad_(False)

"""q/k/v and gate/up as one linear each, where the fused Triton path runs (CUDA).

One GEMM instead of three (q, k, v) and one instead of two (gate, up): 84 fewer kernels in a
Qwen3-0.6B step, and as many fewer ``aten::mm`` calls on the host in eager (mixed) steps, where
each cost ~23 us of CPU. Each output row of the fused weight is the row
of the linear it came from, so the products are those of the separate GEMMs.

The checkpoint's names stay what a weight update speaks: :func:`views` maps each of them to its
rows of a fused parameter, and ``weights.copy_into`` writes there in place (CUDA graphs keep
their addresses).
"""

from __future__ import annotations

import torch
from torch import nn

from .invariant import InvariantLinear

#: (parent in a decoder layer, fused name, the linears it replaces, in row order)
GROUPS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
          ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def fuse(model: nn.Module) -> int:
    """Replace each layer's q/k/v and gate/up ``nn.Linear`` by one (the float weights
    concatenated by rows; biases too). Returns how many linears were replaced."""
    replaced = 0
    with torch.no_grad():
        for layer in model.model.layers:
            for parent_name, fused_name, names in GROUPS:
                parent = getattr(layer, parent_name)
                lins = [getattr(parent, n, None) for n in names]
                kind = type(lins[0])
                if kind not in (nn.Linear, InvariantLinear) or not all(type(m) is kind for m in lins):
                    continue  # packed on CPU, or already fused
                biased = {m.bias is not None for m in lins}
                if len(biased) != 1:
                    continue
                w = torch.cat([m.weight for m in lins])
                with torch.device("meta"):
                    lin = nn.Linear(w.shape[1], w.shape[0], bias=biased.pop())
                lin.__class__ = kind  # (deterministic mode's: a column's bits are the same)
                lin.weight = nn.Parameter(w, requires_grad=False)
                if lin.bias is not None:
                    lin.bias = nn.Parameter(torch.cat([m.bias for m in lins]), requires_grad=False)
                lin.split_sizes = tuple(m.out_features for m in lins)
                for n in names:
                    delattr(parent, n)
                setattr(parent, fused_name, lin)
                replaced += len(names)
    return replaced


def views(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name (``...q_proj.weight``, ``...up_proj.bias``) -> its rows of the fused
    parameter that holds it (a view: writing it writes the fused weight)."""
    out: dict[str, torch.Tensor] = {}
    for path, parent, fused_name, names in _fused(model):
        lin = getattr(parent, fused_name)
        for kind in ("weight", "bias"):
            p = getattr(lin, kind)
            if p is None:
                continue
            for name, rows in zip(names, p.split(lin.split_sizes)):
                out[f"{path}.{name}.{kind}"] = rows
    return out


def _fused(model: nn.Module):
    for i, layer in enumerate(model.model.layers):
        for parent_name, fused_name, names in GROUPS:
            parent = getattr(layer, parent_name)
            if isinstance(getattr(parent, fused_name, None), nn.Linear):
                yield f"model.layers.{i}.{parent_name}", parent, fused_name, names


__all__ = ["fuse", "views", "GROUPS"]

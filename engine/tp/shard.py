"""Which part of each weight a rank holds (Megatron-style, as vLLM shards Llama):

* column-parallel (rows of the weight, dim 0): q/k/v projections (and their biases), gate/up;
* row-parallel (columns, dim 1): o and down projections -- their outputs are all-reduced;
* vocab-parallel (dim 0): the embedding and the LM head;
* replicated: the norms.

Every rank reads the checkpoint's full tensor and keeps a copy of its slice only (the full one
is dropped tensor by tensor). A tensor whose full shape differs from the model's is refused with
the tensor's name, both shapes and the rank, before anything is sliced.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional

import torch

from engine.model.model_config import ModelConfig

from ..errors import BadRequestError, CheckpointError

_COLUMN = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
           "v_proj.bias", "gate_proj.weight", "up_proj.weight", "embed_tokens.weight",
           "lm_head.weight")
_ROW = ("o_proj.weight", "down_proj.weight")


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """Refuse (as vLLM does) a size that does not divide the heads, KV heads, MLP width or
    vocabulary; the message names each number that does not divide."""
    bad = [f"{what} ({n})" for what, n in (
        ("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)) if n % world]
    if bad:
        raise BadRequestError(f"tensor_parallel_size {world} must divide {', '.join(bad)} of "
                              f"this {cfg.architecture}")


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shapes one rank's modules have: heads, KV heads, MLP width and vocabulary / world."""
    check_divisible(cfg, world)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world,
                               num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world,
                               vocab_size=cfg.vocab_size // world)


def shard_dim(name: str) -> Optional[int]:
    """0 (column / vocab parallel), 1 (row parallel) or None (replicated)."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def shard_of(t: torch.Tensor, dim: Optional[int], rank: int, world: int,
             copy: bool = True) -> torch.Tensor:
    """``rank``'s slice of ``t`` along ``dim``; ``copy``: a tensor of its own (at load: the full
    tensor is freed after), else a view (a weight update copies it into the weights at once)."""
    if dim is None:
        return t
    n = t.shape[dim] // world
    part = t.narrow(dim, rank * n, n)
    return part.clone() if copy else part


class ShardedTensors:
    """Wraps a loader's ``tensors()`` factory: yields each rank's slice, checked against the
    full model's shapes (``full_shapes``: name -> shape)."""

    def __init__(self, inner: Callable[[], Iterator[tuple[str, torch.Tensor]]],
                 full_shapes: dict[str, tuple[int, ...]], rank: int, world: int, source: str):
        self._inner, self._shapes = inner, full_shapes
        self.rank, self.world, self.source = rank, world, source

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._inner():
            want = self._shapes.get(name)
            if want is not None and tuple(t.shape) != want:
                raise CheckpointError(self.source, (
                    f"shape mismatch for {name}: checkpoint {tuple(t.shape)}, model {want} "
                    f"(rank {self.rank} of tensor_parallel_size {self.world} would hold a "
                    f"1/{self.world} slice of it)"))
            yield name, shard_of(t, shard_dim(name) if want is not None else None,
                                 self.rank, self.world)

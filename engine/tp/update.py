"""A weight update across the ranks: the driver has the full tensors (checked in full against
the model before any rank is told), every rank keeps its own slice.

The bytes travel over the ranks' process group, not the control channel: the driver packs the
tensors into buckets (``engine.weight_transfer``'s grouping and layout: each bucket the tensors'
bytes back to back, 16-byte aligned, one ``broadcast`` each), every worker receives each bucket
into one reused buffer, and each rank -- the driver too, from its full tensors -- copies its
slice (``shard.shard_dim``: the load's rule) into its weights. The control frame
(``channel.Update``) carries the names and shapes ahead, in send order.

The buffer lives where the backend can broadcast from: the device with NCCL, host memory with
gloo (also when ranks share a GPU: see ``layers._staged``).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from engine.weight_transfer import _layout, buckets

from .shard import shard_dim, shard_of

#: bytes per broadcast; the workers hold one bucket buffer of at most this size while updating
BUCKET_BYTES = 64 * 2**20

Write = Callable[[dict[str, torch.Tensor]], None]


def _buffer_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def _plan(names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: torch.dtype,
          bucket_bytes: int) -> list[tuple[list[int], list[int], int]]:
    meta = [(n, tuple(s), dtype) for n, s in zip(names, shapes)]
    return [(idx, *_layout(meta, idx)) for idx in buckets(meta, bucket_bytes)]


def _local(name: str, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of ``full`` (a view: it is copied into the weights at once)."""
    return shard_of(full, shard_dim(name), rank, world, copy=False)


def send(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
         world: int, write: Write, bucket_bytes: int = BUCKET_BYTES) -> int:
    """The driver's side (rank 0): broadcast ``tensors`` (full shapes, any device, converted to
    ``dtype``) bucket by bucket, writing rank 0's slices as it goes; returns the bytes sent."""
    names = list(tensors)
    plan = _plan(names, [t.shape for t in tensors.values()], dtype, bucket_bytes)
    buf = torch.empty(max(size for *_, size in plan), dtype=torch.uint8,
                      device=_buffer_device(device))
    for idx, offsets, size in plan:
        view = buf[:size]
        for i, at in zip(idx, offsets):
            t = tensors[names[i]].detach().to(dtype).contiguous().reshape(-1).view(torch.uint8)
            view[at:at + t.numel()].copy_(t)
        dist.broadcast(view, src=0)
        write({names[i]: _local(names[i], tensors[names[i]], 0, world) for i in idx})
    return sum(size for *_, size in plan)


def receive(names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: torch.dtype,
            device: torch.device, rank: int, world: int, write: Write,
            bucket_bytes: int) -> int:
    """A worker's side: the buckets :func:`send` broadcasts, each rank's slices written."""
    plan = _plan(names, shapes, dtype, bucket_bytes)
    buf = torch.empty(max(size for *_, size in plan), dtype=torch.uint8,
                      device=_buffer_device(device))
    for idx, offsets, size in plan:
        view = buf[:size]
        dist.broadcast(view, src=0)
        out = {}
        for i, at in zip(idx, offsets):
            shape = tuple(shapes[i])
            n = dtype.itemsize * _numel(shape)
            full = view[at:at + n].view(dtype).reshape(shape)
            out[names[i]] = _local(names[i], full, rank, world)
        write(out)
    return sum(size for *_, size in plan)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = ["send", "receive", "BUCKET_BYTES"]

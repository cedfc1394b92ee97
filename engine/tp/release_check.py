"""The weakref check each rank runs around its release: weak references to every tensor its
owner holds, taken just before ``DeviceOwner.close()``, must all be dead (or hold no storage)
after it and a collection -- on every rank, reported to the driver (``channel.Released``)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn


def _tensors(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif depth < 3 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif depth < 3 and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from _tensors(v, depth + 1)


def tensor_refs(owner) -> list[weakref.ref]:
    return [weakref.ref(t) for name in owner.names() for t in _tensors(owner[name])]


def alive(refs: list[weakref.ref]) -> tuple[int, int]:
    """(tensors still alive, storage bytes they hold) after a collection."""
    gc.collect()
    live = [t for r in refs if (t := r()) is not None]
    return len(live), sum(t.untyped_storage().nbytes() for t in live)

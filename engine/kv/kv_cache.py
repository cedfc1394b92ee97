"""Paged KV cache: the block allocator (host bookkeeping) and the cache tensor (device memory).

The target model's cache carries its :class:`~engine.kv.block_manager.BlockManager` (reference
counts and the prefix cache) as ``blocks``: host bookkeeping that lives and dies with the
tensor, so ``close()`` drops every cached entry with the memory it described. (The draft
speculator's cache uses a plain :class:`BlockAllocator` of its own.)

Layout of the one cache tensor: ``[num_layers, 2 (k, v), num_blocks, block_size, kv_heads,
head_dim]``. A token's *slot* is ``block_id * block_size + offset``. Layers receive a per-call
view (``cache[layer]``); no view is ever stored anywhere, so releasing the base frees it all.

On CPU the tensor lives in an anonymous memory map of its own (:func:`zeroed_host`): the OS
guarantees its pages read as zeros and gives them memory only when first written, so a cache
sized for 64 sequences of 2,048 tokens costs the resident memory of the tokens actually cached,
not its whole budget (``torch.zeros`` wrote every page: 512 MiB resident at load).
"""

from __future__ import annotations

from collections import deque
import math
import mmap

import torch


class BlockAllocator:
    """Fixed-size KV blocks. Paired query/act methods: ``can_allocate``/``allocate``, ``free``."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("need at least one KV block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return len(self._used) / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: want {n}, have {len(self._free)}")
        out = [self._free.popleft() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"double free of KV block {b}")
            self._used.remove(b)
            self._free.append(b)

    def check_integrity(self) -> None:
        """Every block is either free or used, exactly once."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert not (free & self._used), "a block is both free and used"
        assert len(free) + len(self._used) == self.num_blocks, "a block went missing"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def zeroed_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor of ``shape`` in a fresh anonymous memory map of its own. Reads
    as zeros everywhere -- guaranteed by the OS for an anonymous mapping, not left to the
    allocator -- yet takes resident memory only for the pages written (a read of an untouched
    page maps the kernel's shared zero page). The tensor's storage holds the only reference to
    the map, so the map is unmapped exactly when the storage dies (``set_()`` on the tensor
    and no view left): never while a tensor can still read it. (Not ``mmap.close()``:
    ``torch.frombuffer`` keeps the object, not a buffer export, so a close would unmap under a
    live view.)"""
    numel = math.prod(shape)
    size = max(1, numel * torch.empty(0, dtype=dtype).element_size())
    if hasattr(mmap, "MAP_PRIVATE"):  # POSIX: private, so not shared memory (shmem) pages
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:  # Windows: anonymous maps are private and zero-filled there too
        buf = mmap.mmap(-1, size)
    t = torch.frombuffer(buf, dtype=dtype, count=numel)
    t.set_(t.untyped_storage(), 0, shape)  # the shape in place: not a view, no base to pin it
    return t


class KVCache:
    """The device tensor behind the paged KV cache. Owned (and released) by ``DeviceOwner``."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, blocks=None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = blocks  # the BlockManager of the target's cache (host only), or None
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.tensor: torch.Tensor | None = (
            zeroed_host(shape, dtype) if torch.device(device).type == "cpu"
            else torch.zeros(shape, dtype=dtype, device=device))

    @property
    def nbytes(self) -> int:
        t = self.tensor
        return 0 if t is None else t.numel() * t.element_size()

    def layer(self, i: int) -> torch.Tensor:
        assert self.tensor is not None, "KV cache released"
        return self.tensor[i]

    def close(self) -> None:
        if self.blocks is not None:
            self.blocks.close()
        if self.tensor is not None:
            self.tensor.set_()  # on CPU this unmaps the cache's memory map (zeroed_host)
        self.tensor = None

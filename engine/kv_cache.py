"""Paged KV cache: the block allocator (host bookkeeping) and the cache tensor (device memory).

The target model's cache carries its :class:`~engine.block_manager.BlockManager` (reference
counts and the prefix cache) as ``blocks``: host bookkeeping that lives and dies with the
tensor, so ``close()`` drops every cached entry with the memory it described. (The draft
speculator's cache uses a plain :class:`BlockAllocator` of its own.)

Layout of the one cache tensor: ``[num_layers, 2 (k, v), num_blocks, block_size, kv_heads,
head_dim]``. A token's *slot* is ``block_id * block_size + offset``. Layers receive a per-call
view (``cache[layer]``); no view is ever stored anywhere, so releasing the base frees it all.
"""

from __future__ import annotations

from collections import deque

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


class KVCache:
    """The device tensor behind the paged KV cache. Owned (and released) by ``DeviceOwner``."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, blocks=None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = blocks  # the BlockManager of the target's cache (host only), or None
        self.tensor: torch.Tensor | None = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=dtype, device=device,
        )

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
            self.tensor.set_()
        self.tensor = None

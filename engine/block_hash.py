"""Chained block hashes for the prefix cache.

A full block's hash is BLAKE2b-128 over (its parent's hash, its token ids as native int32; the
cache lives in one process), so equal hashes mean equal whole prefixes, not just equal blocks.
The root (the parent of a first block) covers the weights version, the cache's reset epoch and
the block size: K/V computed under other weights can never be found. No Python ``hash()``
(64-bit, salted per process for str); no pickle.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

_DIGEST = 16


def root_hash(weights_version: int, epoch: int, block_size: int) -> bytes:
    key = f"enginecore-kv/v1/weights={weights_version}/epoch={epoch}/block={block_size}"
    return hashlib.blake2b(key.encode(), digest_size=_DIGEST).digest()


def chain_hashes(parent: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block is ignored), each
    chained to the one before, the first to ``parent``."""
    n = len(token_ids) // block_size
    tokens = array("i", token_ids[: n * block_size])  # one conversion for all blocks
    data, step = tokens.tobytes(), block_size * tokens.itemsize
    out: list[bytes] = []
    blake2b = hashlib.blake2b
    for i in range(0, n * step, step):
        parent = blake2b(parent + data[i:i + step], digest_size=_DIGEST).digest()
        out.append(parent)
    return out

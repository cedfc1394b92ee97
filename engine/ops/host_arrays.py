"""Host lists of ints -> CPU tensors for a step's inputs, through numpy.

``torch.tensor`` on a Python list infers a type per element: ~250 ns an element, ~20 µs for a
list of 64 (measured on the dev box); ``numpy.array`` with the dtype given takes ~25 ns an
element and ~2 µs. A step packs its token ids, positions, KV slots and block tables this way,
so its host cost stays a few µs per request plus a small constant per token.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def long_tensor(values: Sequence[int]) -> torch.Tensor:
    """``values`` as a 1-D int64 CPU tensor."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def int32_tensor(values: Sequence[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int32))


def block_table(req) -> np.ndarray:
    """``req.block_ids`` as an int32 array, from a mirror kept on the request: blocks added at
    the end since the last call are copied in, any other change (``req.block_epoch``, bumped by
    the BlockManager) makes it anew.

    NOTE: a decode step's block tables were converted from Python lists every step: ~1.5 us a
    row of 82 blocks, 0.4 ms for 256 rows on the development box, ~9 % of the step thread's
    busy time in bench.prefix on the H100 (py-spy). From these mirrors the rows
    are copied by ``padded_rows`` in one numpy call."""
    ids = req.block_ids
    n = len(ids)
    m = req.block_mirror
    if m is not None and m[0] == req.block_epoch and m[1] <= n:  # blocks only added since
        if m[1] == n:
            return m[3]
        buf, k = m[2], m[1]
        if n > buf.shape[0]:  # past its room: a larger buffer, the mirrored part moved over
            buf = np.empty(2 * n, dtype=np.int32)
            buf[:k] = m[2][:k]
        buf[k:n] = ids[k:]
    else:
        buf = np.empty(max(16, 2 * n), dtype=np.int32)  # room to grow without a copy
        buf[:n] = ids
    view = buf[:n]
    req.block_mirror = (req.block_epoch, n, buf, view)
    return view


def padded_rows(rows: Sequence[Sequence[int]], width: int, dtype=np.int64) -> torch.Tensor:
    """``[len(rows), width]``: row ``i`` holds the first ``width`` values of ``rows[i]``, then
    zeros. Rows that are numpy arrays (``block_table``; lists may be mixed in) no longer than
    ``width`` are copied in one call."""
    if rows and type(rows[0]) is np.ndarray:
        lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        if not len(lens) or lens.max() <= width:
            out = np.zeros((len(rows), width), dtype=dtype)
            out[np.arange(width) < lens[:, None]] = np.concatenate(rows)
            return torch.from_numpy(out)
    out = np.zeros((len(rows), width), dtype=dtype)
    for i, r in enumerate(rows):
        k = min(len(r), width)
        if k:
            out[i, :k] = r[:k] if k < len(r) else r
    return torch.from_numpy(out)

"""``MixedInputs``: a step with prompt tokens described in fixed-shape device buffers, so that
it can be replayed from a CUDA graph (engine/forward/cuda_graphs.py; ``EngineConfig.mixed_cuda_graphs``).

An eager step with prompt tokens costs the host one launch per kernel -- ~300 on the H200 for
qwen3-0.6b, 20-45 ms a step measured -- while its device work is a few ms: prefill
steps were host-bound, and a burst of later turns waited through several of them. Replayed
from a graph, the launches cost one call. What a graph needs is a step whose every kernel has
the same grid and reads the same buffers each time; this module gives a step of ``t`` tokens
that shape:

* rows: ``R = rows(t)``, the eager row count of ``t`` (``step_inputs.eager_rows``: at most
  1/8 or 63 rows more);
* prefill chunks: the paged prefill kernel's per-tile and per-chunk arrays at a fixed length
  for ``R`` (``R // BLOCK_M + max_chunks`` tiles, every chunk's tiles first; the rest point
  at a chunk of no queries and no context, whose programs store nothing), block tables at
  the KV cache's full width;
* decode rows: a fixed count for ``R`` (at most ``max_rows``); the padded ones attend to the
  scratch block alone and write their output to the first chunk's first row, which the
  prefill kernel writes after them (``attention.paged_attention`` runs decode rows first).

Tokens, positions and KV slots stay in the model state's buffers (padded rows write K/V to the
scratch slot). The buffers here are device memory: owned by the graphs object that owns the
graphs, released by its ``close()``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from engine.model.attention import AttentionMetadata
from engine.ops.host_arrays import padded_rows
from engine.ops.triton import prefill_attention
from engine.ops.triton.prefill_attention import BLOCK_M, PrefillBatch

from .step_inputs import eager_rows


def rows(t: int) -> int:
    """The row count a step of ``t`` tokens runs at."""
    return eager_rows(t)


class MixedInputs:
    def __init__(self, *, max_tokens: int, max_rows: int, table_width: int, scratch_block: int,
                 block_size: int, device: torch.device):
        """``max_tokens``: rows the model state's buffers hold; ``max_rows``: sequences one step
        may carry (the model state's decode rows); ``table_width``: its block tables' width."""
        self.max_tokens = max_tokens
        self.max_rows = max_rows
        self.width = table_width
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.max_tiles = self.tiles(max_tokens)
        i32 = dict(dtype=torch.int32, device=device)
        # every buffer its own allocation: each starts 16-byte aligned (Triton specializes on it)
        self.buffers: Optional[dict[str, torch.Tensor]] = {
            "tile_chunk": torch.zeros(self.max_tiles, **i32),
            "tile_m0": torch.zeros(self.max_tiles, **i32),
            "q_start": torch.zeros(max_rows + 1, **i32),
            "q_len": torch.zeros(max_rows + 1, **i32),
            "ctx_len": torch.zeros(max_rows + 1, **i32),
            "chunk_tables": torch.zeros((max_rows + 1, table_width), **i32),
            "decode_rows": torch.zeros(max_rows, dtype=torch.long, device=device),
        }

    def chunks_cap(self, r: int) -> int:
        return min(r, self.max_rows)

    def tiles(self, r: int) -> int:
        """Tiles of a step of ``r`` rows: ``sum(ceil(n / BLOCK_M))`` over its chunks is at most
        ``r // BLOCK_M`` plus one a chunk."""
        return r // BLOCK_M + self.chunks_cap(r)

    def fits(self, t: int, n_chunks: int, n_decode: int) -> Optional[int]:
        """The row count for a step of ``t`` tokens, or None if it does not fit the buffers."""
        r = rows(t)
        if r > self.max_tokens or n_chunks > self.chunks_cap(r) or n_decode > self.chunks_cap(r):
            return None
        return r

    def meta(self, r: int, slot_mapping: torch.Tensor, state,
             chunks: list[tuple[int, int, int, list[int]]], dec_rows: list[int],
             dec_tables: list[list[int]], dec_lens: list[int]) -> AttentionMetadata:
        """The step's attention metadata as views of fixed shape for ``r`` rows (the values of
        this step written into them). ``slot_mapping``: the model state's ``[r]`` view."""
        assert self.buffers is not None, "mixed inputs released"
        buf, bs = self.buffers, self.block_size
        nt, cap = self.tiles(r), self.chunks_cap(r)
        # prefill: the real chunks' tiles, then tiles of the empty chunk ``cap``
        tc, tm = prefill_attention.tiles(chunks)
        pad = nt - len(tc)
        assert pad >= 0 and len(chunks) <= cap, (r, len(tc), len(chunks))
        tiles = np.array([tc + [cap] * pad, tm + [0] * pad], dtype=np.int32)
        per = np.zeros((3, cap + 1), dtype=np.int32)  # the empty chunk: no rows, no context
        for j, (row0, n, ctx, _) in enumerate(chunks):
            per[:, j] = (row0, n, ctx)
        tiles_t, per_t = torch.from_numpy(tiles), torch.from_numpy(per)
        buf["tile_chunk"][:nt].copy_(tiles_t[0], non_blocking=True)
        buf["tile_m0"][:nt].copy_(tiles_t[1], non_blocking=True)
        for k, name in enumerate(("q_start", "q_len", "ctx_len")):
            buf[name][: cap + 1].copy_(per_t[k], non_blocking=True)
        if chunks:  # a chunk's table up to the blocks its context reaches (the rest unread)
            tables = [c[3][: -(-c[2] // bs)] for c in chunks]
            w = max(len(x) for x in tables)
            buf["chunk_tables"][: len(chunks), :w].copy_(
                padded_rows(tables, w, np.int32), non_blocking=True)
        batch = PrefillBatch(buf["tile_chunk"][:nt], buf["tile_m0"][:nt], buf["q_start"][: cap + 1],
                             buf["q_len"][: cap + 1], buf["ctx_len"][: cap + 1],
                             buf["chunk_tables"][: cap + 1])
        # decode rows: the real ones, then rows of the scratch block writing into the first
        # chunk's first row (the prefill kernel writes it after them)
        d = len(dec_rows)
        pad = cap - d
        first = chunks[0][0]
        buf["decode_rows"][:cap].copy_(torch.tensor(dec_rows + [first] * pad, dtype=torch.long),
                                       non_blocking=True)
        tables = state.buffers["block_tables"]
        lens = state.buffers["context_lens"]
        if d:
            w = max(len(x) for x in dec_tables)
            tables[:d, :w].copy_(padded_rows(dec_tables, w), non_blocking=True)
        if pad:
            tables[d:cap, 0] = self.scratch_block
        lens[:cap].copy_(torch.tensor(dec_lens + [1] * pad, dtype=torch.long), non_blocking=True)
        meta = AttentionMetadata(slot_mapping, [], buf["decode_rows"][:cap], tables[:cap],
                                 lens[:cap], tables.shape[1] * bs)
        meta.prefill_batch = batch
        return meta

    def close(self) -> None:
        if self.buffers is not None:
            with torch.no_grad():
                for t in self.buffers.values():
                    t.set_()
        self.buffers = None


__all__ = ["MixedInputs", "rows"]

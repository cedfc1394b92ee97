"""CUDA graphs for decode-only steps: one graph per batch-size bucket, one private memory pool.

A step is *decode-only* when every scheduled entry is one token of a sequence that already has
context (no prefill chunk, no speculative tokens). Such a step of ``n`` sequences is padded to
the smallest bucket ``B >= n`` (1, 2, 4, ..., 256, capped at ``max_num_seqs``) and replayed from
a graph captured on first use of that bucket. The graph's inputs are the persistent
:class:`~engine.forward.model_state.ModelState` buffers (``input_ids``, ``positions``, ``slot_mapping``,
``context_lens`` and ``block_tables`` at full width): the runner copies the step's values into
their front rows as it does for an eager step, then calls :meth:`CudaGraphs.run`. Padded rows
write their K/V into a reserved *scratch block* of the KV cache that no sequence owns, attend to
that one slot, and are never sampled.

Ownership: the graphs, their private pool (the activations and outputs allocated during
capture), the capture stream's cuBLAS workspace and the row index live here, and
:meth:`CudaGraphs.close` releases them: the runner adopts this object into its ``DeviceOwner``
after the model state, so it is released first; together with the owner's final
``empty_cache`` the caching allocator returns to its pre-load figures, to the byte.

Capture is at load with ``EngineConfig.warmup`` (:meth:`CudaGraphs.capture_decode`, every
bucket), else lazy (a bucket is captured the first time a step needs it); a capture costs one
eager warm-up forward plus one recorded forward. ``capture_seconds`` records the cost per bucket
(a test counts its entries to see that serving captured nothing).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from engine.model.attention import AttentionMetadata
from engine.ops.triton import decode_attention

from .mixed_inputs import MixedInputs, rows as mixed_rows

log = logging.getLogger("enginecore.cuda_graphs")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def buckets_for(max_num_seqs: int) -> tuple[int, ...]:
    """The bucket sizes for ``max_num_seqs``: the powers of two below it and the cap itself
    (at most 256), so that every decode batch up to the cap has a bucket."""
    cap = min(max_num_seqs, BUCKETS[-1])
    return tuple(b for b in BUCKETS if b < cap) + (cap,)


def usable(device: torch.device, enabled: bool, head_dim: int, block_size: int) -> bool:
    """Graphs need CUDA, the config's consent (and the ``triton`` kill switch's), and the
    graph-safe Triton decode kernel."""
    return (enabled and device.type == "cuda" and decode_attention.HAVE_TRITON
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and head_dim <= 256
            and block_size & (block_size - 1) == 0)


class CudaGraphs:
    """Lazily captured decode graphs. A device resource: ``close()`` releases all of it."""

    def __init__(self, *, max_num_seqs: int, scratch_block: int, block_size: int,
                 device: torch.device, max_tokens: int = 0, table_width: int = 0,
                 mixed: bool = False):
        """``mixed``: steps with prompt tokens get graphs too, one per row count
        (engine/forward/mixed_inputs.py; ``max_tokens`` and ``table_width``: the model state's buffers)."""
        self.buckets = buckets_for(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.scratch_block = scratch_block  # a KV block no sequence owns
        self.scratch_slot = scratch_block * block_size
        self.block_size = block_size
        self.device = device
        self.capture_seconds: dict[int, float] = {}
        self.replays = 0
        self._pool = torch.cuda.graph_pool_handle()
        self._stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> final hidden [B, hidden] (pool)
        self._rows: Optional[torch.Tensor] = torch.arange(self.max_batch, device=device)
        self.mixed: Optional[MixedInputs] = None
        if mixed:
            self.mixed = MixedInputs(max_tokens=max_tokens, max_rows=max_num_seqs,
                                     table_width=table_width, scratch_block=scratch_block,
                                     block_size=block_size, device=device)
        self.closed = False

    def bucket(self, n: int) -> Optional[int]:
        """The smallest bucket holding ``n`` decodes, or None (run eagerly)."""
        if self.closed or n < 1 or n > self.max_batch:
            return None
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def mixed_rows(self, t: int, n_chunks: int, n_decode: int) -> Optional[int]:
        """The rows of the mixed graph for a step of ``t`` tokens with prompt chunks, or None
        (run eagerly)."""
        if self.closed or self.mixed is None:
            return None
        return self.mixed.fits(t, n_chunks, n_decode)

    @property
    def captured(self) -> list:
        return sorted(self._graphs, key=str)

    def _meta(self, bucket: int, state) -> AttentionMetadata:
        buf = state.buffers
        return AttentionMetadata(
            slot_mapping=buf["slot_mapping"][:bucket], prefills=[],
            decode_rows=self._rows[:bucket],
            decode_block_tables=buf["block_tables"][:bucket],  # full width
            decode_context_lens=buf["context_lens"][:bucket],
            decode_max_len=buf["block_tables"].shape[1] * self.block_size,
        )

    def _capture(self, bucket, model, kv: torch.Tensor, state,
                 meta: Optional[AttentionMetadata] = None) -> None:
        """Capture the graph of ``bucket`` (a decode batch size, or ``("mixed", rows)`` with the
        step's ``meta``, engine/forward/mixed_inputs.py) over the inputs now in ``state``'s buffers."""
        t0 = time.perf_counter()
        buf = state.buffers
        rows = bucket[1] if isinstance(bucket, tuple) else bucket
        ids, pos = buf["input_ids"][:rows], buf["positions"][:rows]
        if meta is None:
            meta = self._meta(bucket, state)
        stream = self._stream
        # Warm up on the capture stream, with this step's real inputs (the rows already hold
        # them): compiles the Triton kernels and creates this stream's cuBLAS workspace outside
        # the pool. It writes the same K/V the replay writes next.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            model(ids, pos, kv, meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream,
                              capture_error_mode="thread_local"):
            out = model(ids, pos, kv, meta)
        self._graphs[bucket] = graph
        self._outputs[bucket] = out
        self.capture_seconds[bucket] = time.perf_counter() - t0
        log.info("captured %s graph for %d rows in %.3fs",
                 "mixed" if isinstance(bucket, tuple) else "decode", rows, self.capture_seconds[bucket])

    def run(self, bucket: int, model, kv: torch.Tensor, state) -> torch.Tensor:
        """Replay the graph of ``bucket`` (capturing it first if needed) over the inputs now in
        ``state``'s buffers; returns the final hidden states ``[bucket, hidden]`` (valid until
        the next replay)."""
        assert not self.closed, "CUDA graphs released"
        if bucket not in self._graphs:
            self._capture(bucket, model, kv, state)
        self._graphs[bucket].replay()
        self.replays += 1
        return self._outputs[bucket]

    @torch.inference_mode()
    def capture_mixed(self, model, kv: torch.Tensor, state, max_batched_tokens: int,
                      should_stop=lambda: False) -> None:
        """Capture the mixed graph of every row count a step of up to ``max_batched_tokens``
        tokens can take, now (at load: captured lazily, the first steps of each size would pay
        it while serving). Each is captured over a step that touches only the scratch block:
        one chunk as long as a block table reaches, the other rows padding."""
        t0 = time.perf_counter()
        width = self.mixed.width
        for r in sorted({mixed_rows(t) for t in range(1, max_batched_tokens + 1)}):
            if should_stop() or r > self.mixed.max_tokens or ("mixed", r) in self._graphs:
                continue
            n = min(r, (width - 1) * self.block_size)
            buf = state.buffers
            buf["input_ids"][:r].zero_()
            buf["positions"][:r].zero_()
            buf["slot_mapping"][:r].fill_(self.scratch_slot)
            chunk = (0, n, n, [self.scratch_block] * -(-n // self.block_size))
            meta = self.mixed.meta(r, buf["slot_mapping"][:r], state, [chunk], [], [], [])
            self.run_mixed(r, model, kv, state, meta)
        torch.cuda.synchronize(self.device)
        log.info("captured %d mixed graphs in %.2fs", sum(isinstance(k, tuple) for k in self._graphs),
                 time.perf_counter() - t0)

    @torch.inference_mode()
    def capture_decode(self, model, kv: torch.Tensor, state, should_stop=lambda: False) -> None:
        """Capture the decode graph of every bucket now (at load, ``EngineConfig.warmup``),
        largest first (the smaller ones reuse its pool's memory). Each is captured over rows
        that touch only the scratch block: one token of context each."""
        t0 = time.perf_counter()
        buf = state.buffers
        n = 0
        for b in sorted(self.buckets, reverse=True):
            if should_stop() or b in self._graphs:
                continue
            buf["input_ids"][:b].zero_()
            buf["positions"][:b].zero_()
            buf["slot_mapping"][:b].fill_(self.scratch_slot)
            buf["block_tables"][:b, 0] = self.scratch_block
            buf["context_lens"][:b].fill_(1)
            self.run(b, model, kv, state)
            n += 1
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode graphs in %.2fs", n, time.perf_counter() - t0)

    def run_mixed(self, rows: int, model, kv: torch.Tensor, state,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Replay the mixed graph of ``rows`` (capturing it first if needed) over the inputs
        now in ``state``'s buffers and ``meta`` (:meth:`MixedInputs.meta`: the same views every
        step); returns the final hidden states ``[rows, hidden]`` (valid until the next replay)."""
        assert not self.closed, "CUDA graphs released"
        key = ("mixed", rows)
        if key not in self._graphs:
            self._capture(key, model, kv, state, meta)
        self._graphs[key].replay()
        self.replays += 1
        return self._outputs[key]

    def close(self) -> None:
        """Reset every graph (drops its hold on the pool), free the pool's live tensors and the
        row index; the owner's ``empty_cache`` then hands the pool's segments back."""
        if self.closed:
            return
        self.closed = True
        if self._graphs and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)
        for g in self._graphs.values():
            g.reset()
        self._graphs.clear()
        with torch.inference_mode():
            for t in self._outputs.values():
                t.set_()
            if self._rows is not None:
                self._rows.set_()
        self._outputs.clear()
        self._rows = None
        if self.mixed is not None:
            self.mixed.close()
            self.mixed = None
        self._stream = None
        self._pool = None

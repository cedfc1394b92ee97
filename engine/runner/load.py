"""The runner's load (a mixin of :class:`~engine.runner.model_runner.ModelRunner`): weights
created, adopted, then filled; packed for a CPU format or fused; the KV cache, model state,
CUDA graphs and the grammar bitmask built (``_build_stack``, again when a sleep is woken);
the speculator last. Everything is adopted by the runner's owner as it is made, so a load that
fails or is stopped part way releases what it made.
"""

from __future__ import annotations

import logging
import traceback

import torch

from engine.forward import cuda_graphs
from engine.forward.device_stack import device_stack
from engine.kv.block_manager import BlockManager
from engine.loader.checkpoint import LoadStopped, create_model, fill_model, resolve_source
from engine.memory.owner import Resource as R, trim_host_heap
from engine.model import fused_linears
from engine.model.cpu_weights import checkpoint_dtype, choose_format, pack_model
from engine.ops.triton import fused_ops
from engine.structured.bitmask import TokenBitmask
from engine.structured.grammars import grammar_vocab_size

from . import gc_freeze

log = logging.getLogger("enginecore.runner")

_MAX_CONTEXT_DEFAULT = 8192


class RunnerLoad:
    def load(self, should_stop=lambda: False) -> None:
        """Create weights, KV cache, model state (and speculator). ``should_stop`` is polled
        between stages so a signal during startup stops loading promptly. A load that raises
        keeps nothing: what was adopted is released (the owner is closed) before the error
        propagates, and the error's traceback holds no tensor (its frames' locals are cleared)."""
        try:
            self._load(should_stop)
        except BaseException as exc:
            self.shutdown()
            traceback.clear_frames(exc.__traceback__)
            raise
        # the load's host temporaries (the GGUF's dequantized tensors, packing's copies) are
        # freed by now, but glibc keeps their pages resident until trimmed
        trim_host_heap()
        if self.config.freeze_gc and not self._gc_frozen:  # engine/runner/gc_freeze.py
            gc_freeze.hold(self.config.gc_young_threshold)
            self._gc_frozen = True

    def _load(self, should_stop) -> None:
        if self._tp is not None:
            self._tp.start(should_stop)  # the driver starts the workers: they load meanwhile
        cfg, tensors, tok = resolve_source(self.config.model, self.config.revision)
        self.model_config, self._shapes, self.tokenizer = cfg, cfg, tok
        self.dtype = checkpoint_dtype(self.device, self.config, tensors, self.dtype)
        tok.max_token_chars  # computed once here, on the loading thread (admission reads it)
        self.max_model_len = min(self.config.max_model_len or _MAX_CONTEXT_DEFAULT,
                                 cfg.max_position_embeddings)
        if should_stop():
            return
        # Adopt first, fill second: a failed or stopped fill is released like everything else.
        if self._tp is None:
            model = self._owner.adopt(R.WEIGHTS, create_model(cfg, self.device, self.dtype,
                                                              self.switches, self.config.deterministic))
        else:
            from engine.tp.load import create_shard

            model, tensors = create_shard(self, cfg, tensors)
        try:
            fill_model(model, tensors, self.config.seed, self.config.model, should_stop)
        except LoadStopped as stopped:
            log.warning("loading stopped: %s", stopped)
            return
        if self._tp is None:
            self._pack(model, tensors)
        del model
        if should_stop():
            return
        self.num_blocks = self._num_kv_blocks(self._shapes)
        if self._tp is not None:  # every rank's cache has the same blocks: the smallest budget
            self.num_blocks = self._tp.agree_blocks(self.num_blocks)
        # host bookkeeping of the KV blocks and the prefix cache: made once, kept across sleeps
        # (a rebuilt cache is invalidated through EngineCore.reset_kv), closed at shutdown
        self._blocks = BlockManager(self.num_blocks, self.block_size,
                                    enable_caching=self.config.enable_prefix_caching)
        if not self._build_stack(should_stop):
            return
        if self._tp is not None:
            self._tp.wait_ready()  # LOADED only once every rank is
        if self.config.speculator != "none" and not should_stop():
            from engine.spec_decode import build_speculator

            self.speculator = build_speculator(self.config, self)
        if self.config.deterministic:
            log.info("deterministic mode: on (batch-invariant linears, attention by %s, SiLU and "
                     "logprobs; float weights; on CUDA its own fused kernels and CUDA graphs for decode steps; "
                     "docs/deterministic.md)", getattr(self._owner[R.WEIGHTS], "attention_name", "?"))
        log.info("loaded %s on %s/%s (%s weights): %d KV blocks of %d tokens (%.1f MiB); CUDA graphs %s",
                 self.config.model, self.device, self.dtype, self.weight_format, self.num_blocks, self.block_size,
                 self._owner[R.KV_CACHE].nbytes / 2**20,
                 "on" if R.CUDA_GRAPHS in self._owner else "off")

    def _pack(self, model, tensors) -> None:
        """Keep a quantized GGUF's linears packed on CPU where that is faster (the format and
        why are logged); ``float`` keeps the dequantized weights as they are."""
        types = getattr(tensors, "gguf_types", None)
        fmt, why = choose_format(self.device, self.config.dtype, self.config.cpu_weights, types,
                                 self.config.deterministic)
        n = pack_model(model, fmt, types or {})
        self.weight_format = fmt if n else "float"
        log.info("weights: %s, %d linears packed (%s)", self.weight_format, n, why)
        # (deterministic mode too: its Triton GEMM computes a column alike in any GEMM; on the
        # CPU, where its tiled bmm promises that for rows only, nothing is fused)
        fusable = self.switches.fused and fused_ops.AVAILABLE and (
            self.device.type == "cuda" or fused_ops.INTERPRET)
        if not n and self._tp is None and fusable:
            log.info("q/k/v and gate/up fused: %d linears", fused_linears.fuse(model))

    def _build_stack(self, should_stop=lambda: False) -> bool:
        """KV cache, model state and (CUDA) graphs, each adopted as it is made; False if
        stopped part way. At load, and again when a sleep is woken."""
        cfg = self._shapes
        # NOTE: no CUDA graphs with TP yet: the all-reduces would be captured too (untested)
        graphs = self._tp is None and cuda_graphs.usable(
            self.device, self.config.cuda_graphs and self.switches.triton, cfg.head_dim,
            self.block_size)
        # with a speculator a decode carries up to k draft rows, each a decode row
        rows_per_seq = 1 + (self.config.num_speculative_tokens
                            if self.config.speculator != "none" else 0)
        for name, part in device_stack(
                cfg, num_blocks=self.num_blocks, block_size=self.block_size, dtype=self.dtype,
                device=self.device, use_graphs=graphs, max_model_len=self.max_model_len,
                max_tokens=self.config.max_num_batched_tokens + self.config.max_num_seqs * 17,
                max_rows=self.config.max_num_seqs * rows_per_seq,
                mixed_graphs=self.config.mixed_cuda_graphs):
            self._owner.adopt(name, part)
            del part
            if should_stop():
                return False
        self._capture_mixed(should_stop)
        # one token bitmask row per sampled row (constrained requests are not speculated, but
        # a row index can reach the batch's whole sampled width)
        vocab, tok = self.model_config.vocab_size, self.tokenizer
        self._owner.adopt(R.GRAMMAR_BITMASK, TokenBitmask(
            self.config.max_num_seqs * rows_per_seq, vocab, self.device,
            grammar_vocab=lambda: grammar_vocab_size(tok, vocab), switches=self.switches,
            budget=self.grammar_budget))
        return True

    def _capture_mixed(self, should_stop=lambda: False) -> None:
        """Capture the graphed prompt steps (engine/forward/mixed_inputs.py) if the graphs want them,
        and with ``warmup`` every decode bucket (engine/core/warmup.py: nothing captured while serving).
        NOTE: not while the weights are asleep (the KV cache woken alone): the capture runs the
        model, whose weights are then in host memory (level 1) or gone (level 2); the wake of
        the weights (or the weights written after a level-2 sleep) captures them instead."""
        g = self._owner.get(R.CUDA_GRAPHS)
        if g is not None and g.mixed is not None and "weights" not in self.asleep:
            g.capture_mixed(self._owner[R.WEIGHTS], self._owner[R.KV_CACHE].tensor,
                            self._owner[R.MODEL_STATE], self.config.max_num_batched_tokens,
                            should_stop)
        if g is not None and self.config.warms_up() and "weights" not in self.asleep:
            g.capture_decode(self._owner[R.WEIGHTS], self._owner[R.KV_CACHE].tensor,
                             self._owner[R.MODEL_STATE], should_stop)

    def _num_kv_blocks(self, cfg) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        per_block = cfg.kv_bytes_per_token * self.block_size * torch.finfo(self.dtype).bits // 8
        budget = self.config.kv_cache_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.4)
            else:
                budget = 512 * 2**20
        enough = self.config.max_num_seqs * (-(-self.max_model_len // self.block_size))
        return max(1, min(budget // per_block, enough))

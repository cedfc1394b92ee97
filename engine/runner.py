"""``ModelRunner``: loads a model onto a device, runs one mixed prefill/decode step, releases.

Every device allocation is adopted by ``self._owner`` (a :class:`DeviceOwner`) in creation
order: weights, KV cache, model state, CUDA graphs (CUDA only), speculator. ``shutdown()``
synchronizes and releases them in reverse. The runner refuses to hold a tensor or module as a
plain attribute (see ``__setattr__``), so a new device attribute cannot be forgotten at shutdown.
"""

from __future__ import annotations

import logging
import traceback
from typing import Optional, Sequence

import torch

from . import cuda_graphs
from .config import EngineConfig
from .errors import BadRequestError
from .block_manager import BlockManager
from .kv_cache import KVCache
from .loader import LoadStopped, create_model, fill_model, resolve_source
from .model_state import ModelState
from .owner import DeviceOwner, reachable_tensors
from .request import Request
from .sampler import SamplingBatch, sample
from .step_inputs import packed_forward

log = logging.getLogger("enginecore.runner")

_MAX_CONTEXT_DEFAULT = 8192


class InjectedFault(RuntimeError):
    """Raised by the ``fault_at_step`` test hook."""


class StepResult:
    """Per scheduled entry: the new tokens (empty while a prefill is still chunking)."""

    __slots__ = ("tokens", "logprobs")

    def __init__(self, tokens: list[list[int]], logprobs: Optional[list[list[float]]]):
        self.tokens = tokens
        self.logprobs = logprobs


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config.validate()
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self._owner = DeviceOwner(self.device)
        self.model_config = None
        self.tokenizer = None
        self.num_blocks = 0
        self.block_size = config.block_size
        self.max_model_len = 0
        self.steps = 0
        self.speculator = None  # host-side proposer; its device tensors live in the owner

    # -- the seed bug, made impossible ------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        if name != "_owner" and not isinstance(value, (str, int, float, bool, type(None))):
            if reachable_tensors(value):
                raise TypeError(
                    f"ModelRunner.{name} would hold a device tensor outside the owner; adopt it "
                    f"with self._owner.adopt(name, resource) so shutdown() releases it"
                )
        object.__setattr__(self, name, value)

    # -- lifecycle -------------------------------------------------------------------------
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

    def _load(self, should_stop) -> None:
        cfg, tensors, tok = resolve_source(self.config.model)
        self.model_config, self.tokenizer = cfg, tok
        self.max_model_len = min(self.config.max_model_len or _MAX_CONTEXT_DEFAULT,
                                 cfg.max_position_embeddings)
        if should_stop():
            return
        # Adopt first, fill second: a failed or stopped fill is released like everything else.
        model = self._owner.adopt("weights", create_model(cfg, self.device, self.dtype))
        try:
            fill_model(model, tensors, self.config.seed, self.config.model, should_stop)
        except LoadStopped:
            return
        del model
        if should_stop():
            return
        graphs = cuda_graphs.usable(self.device, self.config.cuda_graphs, cfg.head_dim,
                                    self.block_size)
        usable_blocks = self._num_kv_blocks(cfg)
        # with CUDA graphs, one extra block (the last) is the scratch block padded rows write to
        blocks = BlockManager(usable_blocks, self.block_size,
                              enable_caching=self.config.enable_prefix_caching)
        kv = KVCache(num_layers=cfg.num_layers, num_blocks=usable_blocks + int(graphs),
                     block_size=self.block_size, num_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, dtype=self.dtype, device=self.device, blocks=blocks)
        self._owner.adopt("kv_cache", kv)
        self.num_blocks = usable_blocks
        if should_stop():
            return
        max_blocks = -(-self.max_model_len // self.block_size) + 1
        # with a speculator a decode carries up to k draft rows, each a decode row
        rows_per_seq = 1 + (self.config.num_speculative_tokens
                            if self.config.speculator != "none" else 0)
        self._owner.adopt("model_state", ModelState(
            max_tokens=self.config.max_num_batched_tokens + self.config.max_num_seqs * 17,
            max_seqs=self.config.max_num_seqs * rows_per_seq, max_blocks_per_seq=max_blocks,
            device=self.device))
        if graphs:  # after model_state, so that it is released first
            self._owner.adopt("cuda_graphs", cuda_graphs.CudaGraphs(
                max_num_seqs=self.config.max_num_seqs * rows_per_seq, scratch_block=usable_blocks,
                block_size=self.block_size, device=self.device))
        if self.config.speculator != "none" and not should_stop():
            from .speculative import build_speculator

            self.speculator = build_speculator(self.config, self)
        log.info("loaded %s on %s/%s: %d KV blocks of %d tokens (%.1f MiB); CUDA graphs %s; "
                 "prefix caching %s", self.config.model, self.device, self.dtype, self.num_blocks,
                 self.block_size, kv.nbytes / 2**20, "on" if graphs else "off",
                 "on" if self.config.enable_prefix_caching else "off")

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

    @property
    def loaded(self) -> bool:
        return "model_state" in self._owner

    @property
    def released(self) -> bool:
        return self._owner.closed

    @property
    def block_manager(self) -> BlockManager:
        """The KV cache's blocks and prefix cache (host bookkeeping of the owned KV tensor)."""
        return self._owner["kv_cache"].blocks

    def adopt(self, name: str, resource):
        """For components (the speculator) that allocate device memory for this runner."""
        return self._owner.adopt(name, resource)

    def resource(self, name: str):
        return self._owner[name]

    def shutdown(self) -> list[str]:
        """Synchronize, release speculator, model state, KV cache, weights (reverse creation)."""
        if self.speculator is not None:
            self.speculator = None
        order = self._owner.close()
        log.info("released %s", ", ".join(order) or "nothing")
        return order

    # -- one step ----------------------------------------------------------------------------
    def check_prompt(self, n: int, max_tokens: int) -> None:
        if n == 0:
            raise BadRequestError("prompt is empty")
        if n >= self.max_model_len:
            raise BadRequestError(
                f"prompt has {n} tokens; the context limit is {self.max_model_len} "
                f"(prompt must leave room for at least one output token)")
        need = -(-(n + 1) // self.block_size)
        if need > self.num_blocks:
            raise BadRequestError(f"prompt needs {need} KV blocks; the cache has {self.num_blocks}")

    def forget(self, request_id: str) -> None:
        """A request is gone: drop its per-request device state."""
        self._owner["model_state"].forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    @torch.inference_mode()
    def execute(self, batch: Sequence[tuple[Request, int]]) -> StepResult:
        """Run the scheduled ``(request, num_tokens)`` entries; sample where a request reaches
        the end of its known tokens. Speculative tokens in ``request.spec_token_ids`` are
        verified in the same forward."""
        self.steps += 1
        if self.config.fault_at_step is not None and self.steps == self.config.fault_at_step:
            raise InjectedFault(f"injected fault at step {self.steps}")
        state: ModelState = self._owner["model_state"]
        model = self._owner["weights"]
        kv: KVCache = self._owner["kv_cache"]
        seqs = []
        sample_rows: list[list[int]] = []  # per entry: rows whose logits are sampled
        row = 0
        for req, n in batch:
            start = req.num_computed_tokens
            ends = start + n == req.num_tokens
            spec = req.spec_token_ids if ends else []
            toks = req.token_ids[start:start + n] + spec
            # a decode plus its draft tokens: every row is a decode row (the graphable path)
            seqs.append((toks, start, req.block_ids, start > 0 and (len(toks) == 1 or bool(spec))))
            sample_rows.append(list(range(row + n - 1, row + len(toks))) if ends else [])
            row += len(toks)
        hidden = packed_forward(model, kv.tensor, state, self._owner.get("cuda_graphs"),
                                self.device, self.block_size, seqs)
        flat = [r for rows in sample_rows for r in rows]
        if not flat:
            return StepResult([[] for _ in batch], None)
        if flat == list(range(len(flat))):
            logits = model.logits(hidden[: len(flat)])
        else:
            logits = model.logits(hidden[torch.tensor(flat, device=self.device)])
        owners = [i for i, rows in enumerate(sample_rows) for _ in rows]
        if self.speculator is not None:
            return self.speculator.verify(batch, sample_rows, owners, logits, state)
        return self._sample(batch, sample_rows, owners, logits, state)

    def sampling_batch(self, batch, owners: list[int], state: ModelState) -> SamplingBatch:
        params = [batch[i][0].params for i in owners]
        gens = []
        for i in owners:
            req = batch[i][0]
            seed = req.params.seed
            gens.append(None if seed is None or req.params.temperature == 0
                        else state.generator(req.request_id, seed))
        dev = self.device
        return SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            generators=gens,
            all_greedy=all(p.temperature == 0 for p in params),
            need_logprobs=any(p.logprobs for p in params),
        )

    def _sample(self, batch, sample_rows, owners, logits, state) -> StepResult:
        sb = self.sampling_batch(batch, owners, state)
        tokens, logprobs = sample(logits, sb)
        tok_list = tokens.tolist()
        lp_list = logprobs.tolist() if logprobs is not None else None
        out: list[list[int]] = [[] for _ in batch]
        lps: Optional[list[list[float]]] = [[] for _ in batch] if lp_list is not None else None
        for k, i in enumerate(owners):
            out[i].append(tok_list[k])
            if lps is not None:
                lps[i].append(lp_list[k])
        return StepResult(out, lps)

"""``ModelRunner``: loads a model onto a device, runs one mixed prefill/decode step, releases.

Every device allocation is adopted by ``self._owner`` (a :class:`DeviceOwner`) in creation order:
weights, KV cache, model state, CUDA graphs (CUDA only), the structured outputs' token bitmask,
speculator. ``shutdown()`` synchronizes and releases them in reverse. The runner refuses to hold a
tensor or module as a plain attribute (``__setattr__``): none can be forgotten at shutdown.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from engine import envs
from engine.config import EngineConfig
from engine.errors import BadRequestError
from engine.forward.model_state import ModelState
from engine.forward.step_inputs import packed_forward
from engine.kv.block_manager import BlockManager
from engine.kv.kv_cache import KVCache
from engine.memory.owner import DeviceOwner, Resource as R, reachable_tensors
from engine.ops.host_arrays import block_table, long_tensor
from engine.ops.triton import fused_sample
from engine.request import Request
from engine.sample import logprobs
from engine.sample.sampler import StepResult, build_sampling_batch, one_pass, process, sample
from engine.structured.bitmask import Filling, TokenBitmask
from engine.structured.budget import GrammarBudget

from . import gc_freeze
from .launched import Forwarded, Launched, by_entry
from .load import RunnerLoad
from .sleep import RunnerSleep

log = logging.getLogger("enginecore.runner")


class ModelRunner(RunnerLoad, RunnerSleep):
    def __init__(self, config: EngineConfig, tp=None):
        self.config = config.validate()
        # tensor parallel (engine/tp/): the driver's DriverGroup, a worker's WorkerLink; None with
        # one rank -- then nothing below takes a tensor-parallel branch
        if tp is None and config.tensor_parallel_size > 1:
            from engine.tp.group import DriverGroup

            tp = DriverGroup(config)
        self._tp = tp
        self.device = config.resolved_device()
        #: the kill switches (engine/envs.py), read once, now: the kernels this engine may run
        self.switches = envs.switches()
        self.dtype = config.resolved_dtype()
        self._owner = DeviceOwner(self.device)
        self.model_config = None
        self._shapes = None  # this rank's module shapes: model_config, or its shard (TP)
        self.tokenizer = None
        self.num_blocks = 0
        self._blocks: Optional[BlockManager] = None
        self.block_size = config.block_size
        self.max_model_len = 0
        self.steps = 0
        self.speculator = None  # host-side proposer; its device tensors live in the owner
        self.asleep: tuple[str, ...] = ()  # sleep mode: the parts freed ("weights", "kv_cache")
        self.sleep_level = 0
        self.sleep_timings: dict[str, float] = {}  # seconds by part, of the last sleep or wake
        #: where the weights came from (reloaded from it after sleep level 2); None: tensors
        self.weights_source: Optional[str] = config.model
        self.weight_format = "float"  # or a packed CPU format (engine/model/cpu_weights.py)
        self._gc_frozen = False  # this runner holds a freeze of the heap (engine/runner/gc_freeze.py)
        #: one constrained request's grammar work a step, bounded (engine/structured/budget.py)
        self.grammar_budget = GrammarBudget(config.grammar_row_budget_ms)
        self._device_rows = (logprobs.device_rows_invariant if config.deterministic  # (docs/
                             else logprobs.device_rows)  # deterministic.md: logprobs)

    def __setattr__(self, name: str, value) -> None:
        if name != "_owner" and not isinstance(value, (str, int, float, bool, type(None))):
            if reachable_tensors(value):
                raise TypeError(
                    f"ModelRunner.{name} would hold a device tensor outside the owner; adopt it "
                    f"with self._owner.adopt(name, resource) so shutdown() releases it")
        object.__setattr__(self, name, value)

    # -- lifecycle (loading: engine/runner/load.py) -------------------------------------------
    @property
    def loaded(self) -> bool:
        return R.MODEL_STATE in self._owner

    @property
    def released(self) -> bool:
        return self._owner.closed

    @property
    def block_manager(self) -> BlockManager:
        """The KV cache's blocks and prefix cache (host bookkeeping of the owned KV tensor)."""
        return self._blocks

    def adopt(self, name: str, resource):
        """For components (the speculator) that allocate device memory for this runner."""
        return self._owner.adopt(name, resource)

    def resource(self, name: str):
        return self._owner[name]

    def shutdown(self) -> list[str]:
        """Synchronize, release speculator, model state, KV cache, weights (reverse creation)."""
        if self._gc_frozen:  # thawed first: the release's collection must see the whole heap
            self._gc_frozen = False
            gc_freeze.release()
        if self.speculator is not None:
            self.speculator = None
        refs = None
        if self._tp is not None:
            from engine.tp.release_check import tensor_refs

            refs = tensor_refs(self._owner)
        order = self._owner.close()
        if self._blocks is not None:
            self._blocks.close()  # the prefix cache goes with the KV cache
        log.info("released %s", ", ".join(order) or "nothing")
        if self._tp is not None:  # every other rank releases too (and reports), then the group
            from engine.tp.release_check import alive

            # what is still reachable from the whole runner, once the group let go of its
            # failure callback (the engine)
            self._tp.close(order, alive(refs), lambda: reachable_tensors(self))
        return order

    def watch_ranks(self, on_failure) -> None:
        """Tensor parallel: ``on_failure(exc)`` is called (from a watcher thread) when another
        rank dies or fails while serving."""
        if self._tp is not None:
            self._tp.on_failure = on_failure

    @property
    def tensor_parallel(self) -> bool:
        return self._tp is not None

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

    def admit(self, req: Request) -> None:
        """Prepare ``req``'s per-request host state once, when it enters the engine: its row of
        sampling parameters (top_k clamped to the vocabulary, so every value fits the sampler's
        tensors) and its seeded generator. Whatever fails here fails this request alone; the
        step then only packs values that were prepared here."""
        p = req.params
        vocab = self.model_config.vocab_size
        req.sampling_row = (float(p.temperature), min(int(p.top_k), vocab), float(p.top_p))
        if p.seed is not None and p.temperature > 0:
            self._owner[R.MODEL_STATE].generator(req.request_id, int(p.seed))

    def forget(self, request_id: str) -> None:
        """A request is gone: drop its per-request device state."""
        self._owner[R.MODEL_STATE].forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    @torch.inference_mode()
    def execute(self, batch: Sequence[tuple[Request, int]]) -> StepResult:
        """Run the scheduled ``(request, num_tokens)`` entries; sample where a request reaches
        the end of its known tokens. Speculative tokens in ``request.spec_token_ids`` are
        verified in the same forward."""
        return self.collect(self.launch(batch, defer=False))

    @torch.inference_mode()
    def launch(self, batch: Sequence[tuple[Request, int]], defer: bool) -> "Launched":
        """:meth:`execute` up to the point where the host needs the sampled tokens. With
        ``defer`` (overlapped scheduling: no speculator, no logits processing in the batch) the
        tokens stay on the device -- in the model state's ``sampled`` buffer, for the next
        step's inputs -- and a pinned host copy is under way: :meth:`collect` waits for that
        copy alone. A request whose new token is still in flight (``req.pending``) gets it from
        that buffer, not from the host. :meth:`forward` then :meth:`sample_step`."""
        return self.sample_step(self.forward(batch), defer)

    @torch.inference_mode()
    def forward(self, batch: Sequence[tuple[Request, int]],
                poll: Optional[Callable[[], None]] = None) -> "Forwarded":
        """The step's forward and logits launched on the device; nothing sampled yet, no grammar
        mask read. Overlapped scheduling with output constraints (EngineCore.step): between this
        and :meth:`sample_step` the host applies the step before (its matchers take their tokens).
        ``poll()``: called twice on the way (before the model's launch, before the logits'),
        for the caller to start host work beside the rest of the launch."""
        self.steps += 1
        state: ModelState = self._owner[R.MODEL_STATE]
        model = self._owner[R.WEIGHTS]
        kv: KVCache = self._owner[R.KV_CACHE]
        seqs = []
        tables = []  # per entry: a decode row's blocks as an array (host_arrays.block_table)
        sample_rows: list[list[int]] = []  # per entry: rows whose logits are sampled
        row_starts: list[int] = []  # per entry: its first packed row
        fill: list[tuple[int, int]] = []  # (packed row, sampled row) of in-flight tokens
        row = 0
        for req, n in batch:
            start = req.num_computed_tokens
            ends = start + n == req.num_known_tokens
            spec = req.spec_token_ids if ends else []
            toks = req.token_ids[start:start + n] + spec
            if req.pending and ends:  # its last token is on the device: a placeholder here
                fill.append((row + len(toks), req.pending_row))
                toks.append(0)
            # a decode plus its draft tokens: every row is a decode row (the graphable path)
            as_decode = start > 0 and (len(toks) == 1 or bool(spec))
            seqs.append((toks, start, req.block_ids, as_decode))
            tables.append(block_table(req) if as_decode else None)
            sample_rows.append(list(range(row + n - 1, row + len(toks))) if ends else [])
            row_starts.append(row)
            row += len(toks)
        flat = [r for rows in sample_rows for r in rows]
        plp = logprobs.prompt_rows(batch, row_starts)  # prompt tokens whose logprobs are asked
        idx = flat + [r for _, r, _ in plp]
        if self._tp is not None:  # the workers run the same forward (and logits rows) with us
            self._tp.step(seqs, idx)
        if poll is not None:
            poll()
        hidden = packed_forward(model, kv.tensor, state, self._owner.get(R.CUDA_GRAPHS),
                                self.device, self.block_size, seqs, fill, tables)
        if poll is not None:
            poll()
        if not idx:
            return Forwarded(batch, sample_rows, plp, [], None, None, None, None)
        logits_all = self.head_logits(model, hidden, idx)
        owners = [i for i, rows in enumerate(sample_rows) for _ in rows]
        logits = logits_all[: len(flat)]
        sb = processed = None
        if flat:
            # the rows' sampling values and seeded generators are taken now: a request that
            # finishes before sample_step() (the step before, applied in between) keeps them
            sb = build_sampling_batch([batch[i][0] for i in owners], state.generators, self.device)
            if self.switches.fused and fused_sample.usable(logits):
                sb.noise_seed = state.next_noise_seed()  # the one-pass sampler's (fused_sample.py)
            processed = process(logits, sb)
        return Forwarded(batch, sample_rows, plp, owners, logits_all, logits, sb, processed)

    def fill_masks(self, fwd: "Forwarded", background: bool = True,
                   terminated: Optional[dict] = None) -> Filling:
        """Fill the grammar masks of ``fwd``'s constrained rows (the matchers' states now), by
        default in the background (matchers left alone until :meth:`sample_step`)."""
        bitmask: TokenBitmask = self._owner[R.GRAMMAR_BITMASK]
        return bitmask.fill(_constrained(fwd.batch), background=background,
                            terminated=terminated)

    def accept_then_fill(self, matchers: Sequence, tokens: Sequence[int], batch,
                         rows: Optional[Sequence[int]] = None):
        """Feed ``matchers`` their tokens and fill the grammar masks of the constrained rows
        ``batch`` will sample, on the grammar worker, beside the caller
        (:meth:`TokenBitmask.accept_then_fill`): its job, or None (not started). Each token
        must be in its mask; ``rows`` (those the tokens were sampled from): the worker checks
        that first (:meth:`grammar_allows`), and the job does nothing if one is not."""
        bitmask: TokenBitmask = self._owner[R.GRAMMAR_BITMASK]
        return bitmask.accept_then_fill(matchers, tokens, _constrained(batch), rows)

    @property
    def grammar_worker_fills(self) -> tuple[int, float]:
        """The grammar worker's fills so far: (count, wall seconds); (0, 0.0) while released."""
        bitmask: Optional[TokenBitmask] = self._owner.get(R.GRAMMAR_BITMASK)
        return (0, 0.0) if bitmask is None else (bitmask.worker_fills, bitmask.worker_fill_seconds)

    @property
    def has_grammar_worker(self) -> bool:
        """Whether :meth:`accept_then_fill` can start jobs (the grammar worker was built)."""
        bitmask: TokenBitmask = self._owner[R.GRAMMAR_BITMASK]
        return bitmask.has_worker

    def grammar_allows(self, rows: Sequence[int], tokens: Sequence[int]) -> list[bool]:
        """Whether each sampled token is in the grammar mask its row was sampled with (the
        bitmask's host rows hold the last masked step's until the next fill)."""
        bitmask: TokenBitmask = self._owner[R.GRAMMAR_BITMASK]
        return bitmask.allows(rows, tokens)

    @torch.inference_mode()
    def sample_step(self, fwd: "Forwarded", defer: bool,
                    masks: Optional[Filling] = None) -> "Launched":
        """The rest of :meth:`launch` after :meth:`forward`: the constrained rows' grammar masks
        (``masks`` from :meth:`fill_masks`, or filled now from the matchers' states), sampling,
        logprob rows, the tokens' copy."""
        batch, sample_rows, plp, owners, logits_all, logits, sb, processed = fwd
        bitmask: TokenBitmask = self._owner[R.GRAMMAR_BITMASK]
        if logits_all is None:
            if masks is not None:
                masks.rows()
            return Launched(StepResult([[] for _ in batch], None))
        state: ModelState = self._owner[R.MODEL_STATE]
        n_flat = len(owners)
        tokens = None  # the sampled tokens, still on the device (no speculator)
        result = StepResult([[] for _ in batch], None)
        want_lp = bool(plp or any(r.params.logprobs for r, _ in batch))
        if n_flat:  # the constrained rows' grammars: disallowed tokens -inf, before any sampling
            if masks is None:
                masks = bitmask.fill(_constrained(batch))
            grammar = None
            if (self.speculator is None and not want_lp and bitmask.fusable
                    and one_pass(processed, sb)):
                # the one-pass sampler reads the masks as it draws: no pass of their own over
                # the logits, no kernel launch of their own on the host's critical path
                grammar = bitmask.grammar_rows(masks)
            else:
                processed = bitmask.mask(processed, masks, copy=processed is logits and want_lp)
            if self.speculator is not None:
                result = self.speculator.verify(batch, sample_rows, processed, sb)
            elif defer:
                tokens, _ = sample(processed, sb, grammar)
                state.buffers["sampled"][: tokens.shape[0]].copy_(tokens)
            else:
                tokens, _ = sample(processed, sb, grammar)
        lp_plan = None
        if want_lp:
            counts = ([len(r) for r in sample_rows] if tokens is not None
                      else [len(t) for t in result.tokens])
            lp_plan = logprobs.plan(batch, sample_rows, counts, plp, logits_all.shape[1])
            logits_all = logprobs.source(batch, owners, logits_all, processed, sb)
        if defer and tokens is not None:  # the host copy (tokens, logprob rows) under way
            packed = tokens if lp_plan is None else self._packed_rows(tokens, logits_all, lp_plan)
            return Launched.deferred(len(batch), owners, packed, n_flat, lp_plan)
        if lp_plan is None:
            return Launched(result if tokens is None
                            else by_entry(len(batch), owners, tokens.tolist()))
        return Launched(self._with_logprobs(batch, owners, n_flat, tokens, result, logits_all,
                                            lp_plan))

    def _packed_rows(self, tokens, logits_all, lp_plan: "logprobs.Plan") -> torch.Tensor:
        """The sampled tokens and the step's logprob rows as one int32 device tensor."""
        rows = self._device_rows(logits_all, lp_plan, self._chosen(tokens, lp_plan))
        return torch.cat([tokens.int(), rows.flatten()])

    def _chosen(self, tokens, lp_plan: "logprobs.Plan") -> torch.Tensor:
        out_rows = lp_plan.rows[: lp_plan.n_out]
        if out_rows == list(range(tokens.shape[0])):
            return tokens
        return tokens[torch.tensor(out_rows, dtype=torch.long).to(self.device, non_blocking=True)]

    @staticmethod
    def collect(launched: "Launched") -> StepResult:
        """The step's result, waiting for its sampled tokens' host copy if it was deferred."""
        return launched.wait()

    def _with_logprobs(self, batch, owners, n_flat: int, tokens, result: StepResult, logits_all,
                       lp_plan: "logprobs.Plan") -> StepResult:
        """The step's logprob rows computed on the device and brought to the host in one copy,
        with the sampled ``tokens`` (still on the device; None: a speculator's ``result`` has
        them on the host already)."""
        if tokens is not None:
            chosen = self._chosen(tokens, lp_plan)
        else:
            chosen = torch.tensor([t for i, a, _, _ in lp_plan.spans if a < lp_plan.n_out
                                   for t in result.tokens[i]], dtype=torch.long, device=self.device)
        rows = self._device_rows(logits_all, lp_plan, chosen)
        # One device->host copy per step for the sampled tokens and every logprob row (a
        # blocking copy: the host reads them at once, so a non_blocking one would be followed
        # by a synchronize anyway); on CPU it copies nothing.
        flat_host = (torch.cat([tokens.int(), rows.flatten()]) if tokens is not None
                     else rows.flatten()).cpu().numpy()
        n_tok = n_flat if tokens is not None else 0
        if tokens is not None:
            result = by_entry(len(batch), owners, flat_host[:n_tok].tolist())
        words = flat_host[n_tok:].reshape(len(lp_plan.rows), -1)
        result.token_lps, result.prompt_lps, result.logprobs = logprobs.unpack(
            words, lp_plan, len(batch))
        return result

    def head_logits(self, model, hidden, idx: list[int]):
        if idx == list(range(len(idx))):
            return model.logits(hidden[: len(idx)])
        return model.logits(hidden[long_tensor(idx).to(self.device, non_blocking=True)])

    @torch.inference_mode()
    def replay(self, seqs, logits_rows: list[int]) -> None:
        """A tensor-parallel worker's step: the driver's forward and logits rows, in lockstep
        (the collectives inside pair up with the driver's); the driver samples."""
        hidden = packed_forward(self._owner[R.WEIGHTS], self._owner[R.KV_CACHE].tensor,
                                self._owner[R.MODEL_STATE], None, self.device, self.block_size,
                                seqs)
        if logits_rows:
            self.head_logits(self._owner[R.WEIGHTS], hidden, logits_rows)


def _constrained(batch) -> list[tuple]:
    """(matcher, first sampled row, drafts) of each constrained entry of ``batch`` that samples;
    rows count in the sampled logits (entries' rows in order). ``ModelRunner.forward``'s rule,
    so it holds before the forward too: an entry samples when it reaches the end of its known
    tokens, one row plus one a draft token."""
    out = []
    row = 0
    for req, n in batch:
        # (req.num_known_tokens, inlined: a late step runs this over every entry)
        ends = req.num_computed_tokens + n == len(req.token_ids) + req.pending
        k = len(req.spec_token_ids) + 1 if ends else 0
        if k and req.matcher is not None:
            out.append((req.matcher, row, req.spec_token_ids if k > 1 else ()))
        row += k
    return out

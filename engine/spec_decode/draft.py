"""Draft-model proposer: a (smaller) model with the target's vocabulary runs ``k`` autoregressive
steps per engine step for every proposing request, batched, over its own paged KV cache.

Device memory (the draft's weights, its KV cache, its input buffers and per-request generators
(a :class:`ModelState`), its CUDA graphs on CUDA, the draft distributions of sampled requests
between propose and verify) lives in one :class:`DraftResources` adopted by the runner's owner
as ``"speculator"``; this object keeps host bookkeeping only.

Keeping the draft's cache in sync: per request we remember how many tokens the draft has cached
(``cached``), and which draft tokens were written past the real tokens (``tail``). Next step the
tail is compared with the tokens the target actually accepted and ``cached`` rolls back to the
common prefix; the tokens the draft lacks (the target's correction, the last accepted draft) are
fed as a small prefill chunk before drafting. A request that is preempted (it leaves the running
set, or its preemption count moves) or finishes loses its draft blocks.

``draft_model`` is any model spec (``"random:<preset>"``, a checkpoint directory, a .gguf file,
``"default"``); ``"...@seed=N"`` picks the seed of a random preset (default: the engine's seed,
so ``draft_model == model`` is the target itself).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from engine.errors import BadRequestError
from engine.forward import cuda_graphs
from engine.forward.device_stack import device_stack
from engine.forward.model_state import ModelState
from engine.forward.step_inputs import packed_forward
from engine.kv.kv_cache import BlockAllocator, KVCache, blocks_needed
from engine.loader.checkpoint import build_model, resolve_source
from engine.memory.owner import Resource, empty_in_place
from engine.memory.weights import offload_module, restore_module
from engine.sample.sampler import SamplingBatch, apply_penalty_free_filters

from .base import Speculator, race

log = logging.getLogger("enginecore.speculative")


_PARTS = {Resource.KV_CACHE: "kv", Resource.MODEL_STATE: "state", Resource.CUDA_GRAPHS: "graphs"}


class DraftResources:
    """Everything the draft allocates on the device; ``close()`` releases all of it (its CUDA
    graphs first, then its input buffers, its KV cache, its weights)."""

    def __init__(self, model, kv: KVCache, state: ModelState,
                 graphs: "Optional[cuda_graphs.CudaGraphs]"):
        self.model = model
        self.kv: Optional[KVCache] = kv
        self.state: Optional[ModelState] = state  # input buffers; generators of sampled requests
        self.graphs = graphs
        self.pending: dict[str, torch.Tensor] = {}  # request id -> draft probs [m, V]

    @property
    def nbytes(self) -> int:
        w = 0 if self.model is None else sum(p.numel() * p.element_size() for p in self.model.parameters())
        return w + (self.kv.nbytes if self.kv is not None else 0)

    def offload(self, pin: bool) -> int:
        """Sleep level 1 (``DeviceOwner.offload``): the cache, buffers and graphs released, the
        model moved to host memory in place. Returns the bytes now in host memory."""
        self.pending_clear()
        model, self.model = self.model, None
        self.close()  # everything but the model
        self.model = model
        return offload_module(model, pin)

    def restore(self, device) -> int:
        """``DeviceOwner.restore``: the model back on ``device``; the speculator rebuilds the
        rest (:meth:`DraftSpeculator.wake`)."""
        return restore_module(self.model, device)

    def close(self) -> None:
        self.pending_clear()
        if self.graphs is not None:
            self.graphs.close()
        self.graphs = None
        if self.state is not None:
            self.state.close()
        self.state = None
        if self.kv is not None:
            self.kv.close()
        self.kv = None
        if self.model is not None:
            empty_in_place(self.model)
        self.model = None

    def pending_clear(self) -> None:
        with torch.inference_mode():  # they were made in inference mode
            for t in self.pending.values():
                t.set_()
        self.pending.clear()


class _Seq:
    __slots__ = ("blocks", "cached", "base", "tail", "preemptions")

    def __init__(self, preemptions: int):
        self.blocks: list[int] = []
        self.cached = 0  # tokens whose K/V the draft holds (real tokens, then ``tail``)
        self.base = 0  # num_tokens when the tail was drafted
        self.tail: list[int] = []  # draft tokens written to the cache after ``base``
        self.preemptions = preemptions


def _parse_spec(spec: str, default_seed: int) -> tuple[str, int]:
    if "@seed=" in spec:
        source, seed = spec.rsplit("@seed=", 1)
        try:
            return source, int(seed)
        except ValueError:
            raise BadRequestError(f"draft_model {spec!r}: seed must be an integer") from None
    return spec, default_seed


class DraftSpeculator(Speculator):
    name = "draft"

    def __init__(self, config, runner):
        super().__init__(config, runner)
        source, seed = _parse_spec(config.draft_model, config.seed)
        dcfg, tensors, _tok = resolve_source(source)
        if dcfg.vocab_size != runner.model_config.vocab_size:
            raise BadRequestError(
                f"draft model {source!r} has vocabulary {dcfg.vocab_size}; the target has "
                f"{runner.model_config.vocab_size}")
        self.max_pos = dcfg.max_position_embeddings
        self.block_size = runner.block_size
        self.num_blocks = runner.num_blocks  # as many tokens as the target's cache
        self.budget = config.max_num_batched_tokens
        self.device = runner.device
        self.max_chunk = self.k + 1  # catch-up chunks up to this long run as decode rows
        self._source, self._seed, self._dcfg = source, seed, dcfg
        model = build_model(dcfg, tensors, runner.device, runner.dtype, seed, source,
                            runner.switches)
        res = runner.adopt(Resource.SPECULATOR, DraftResources(model, None, None, None))
        del model
        self._build_stack(res)
        log.info("draft model %s: %.1f MiB (weights + %d KV blocks)", source,
                 res.nbytes / 2**20, self.num_blocks)

    def _build_stack(self, res: DraftResources) -> None:
        """The draft's KV cache, buffers and graphs into ``res``; fresh host bookkeeping."""
        runner, config = self.runner, self.runner.config
        graphs = cuda_graphs.usable(runner.device, config.cuda_graphs and runner.switches.triton,
                                    self._dcfg.head_dim,
                                    self.block_size)
        max_rows = config.max_num_seqs * self.max_chunk
        for name, part in device_stack(
                self._dcfg, num_blocks=self.num_blocks, block_size=self.block_size,
                dtype=runner.dtype, device=runner.device, use_graphs=graphs,
                max_model_len=runner.max_model_len,
                max_tokens=config.max_num_batched_tokens + max_rows, max_rows=max_rows,
                # (its prompt steps stay eager: nothing captures them at load, and captured
                # on first use they would stall serving steps)
                mixed_graphs=False):
            setattr(res, _PARTS[name], part)
            del part
        self.allocator = BlockAllocator(self.num_blocks)
        self._seqs: dict[str, _Seq] = {}

    def wake(self) -> None:
        """After a sleep: the model is back (the runner restored it at level 1) or is rebuilt
        from its source (level 2: the resource was released); then the cache, buffers, graphs."""
        runner = self.runner
        try:
            res = self._res()
        except KeyError:  # released at level 2
            _cfg, tensors, _tok = resolve_source(self._source)
            model = build_model(self._dcfg, tensors, runner.device, runner.dtype, self._seed,
                                self._source)
            res = runner.adopt(Resource.SPECULATOR, DraftResources(model, None, None, None))
            del model
        self._build_stack(res)

    # -- bookkeeping ---------------------------------------------------------------------------
    def _res(self) -> DraftResources:
        return self.runner.resource(Resource.SPECULATOR)

    def _drop(self, request_id: str) -> None:
        st = self._seqs.pop(request_id, None)
        if st is not None and st.blocks:
            self.allocator.free(st.blocks)

    def forget(self, request_id: str) -> None:
        self._drop(request_id)
        try:
            res = self._res()
        except KeyError:  # already released
            return
        if res.state is not None:
            res.state.forget(request_id)
        t = res.pending.pop(request_id, None)
        if t is not None:
            with torch.inference_mode():
                t.set_()

    def num_cached(self, request_id: str) -> int:
        st = self._seqs.get(request_id)
        return 0 if st is None else st.cached

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def _resize(self, st: _Seq, tokens: int) -> bool:
        need = blocks_needed(tokens, self.block_size)
        have = len(st.blocks)
        if need < have:
            self.allocator.free(st.blocks[need:])
            del st.blocks[need:]
        elif need > have:
            if not self.allocator.can_allocate(need - have):
                return False
            st.blocks += self.allocator.allocate(need - have)
        return True

    # -- proposing -----------------------------------------------------------------------------
    def _propose(self, running, want) -> None:
        res = self._res()
        res.pending_clear()
        live = {r.request_id for r in running}
        for rid in [rid for rid in self._seqs if rid not in live]:
            self._drop(rid)  # preempted (back to waiting): its draft cache goes too
        plan: list[tuple] = []  # (req, seq, tokens to feed now, drafts to make)
        budget = self.budget
        for req, n in want:
            if budget <= 0:
                break
            st = self._seqs.get(req.request_id)
            if st is not None and st.preemptions != req.num_preemptions:
                self._drop(req.request_id)
                st = None
            if st is None:
                st = self._seqs[req.request_id] = _Seq(req.num_preemptions)
            if st.tail:  # roll back to what the target accepted
                real = req.token_ids[st.base:st.base + len(st.tail)]
                keep = 0
                while keep < len(real) and real[keep] == st.tail[keep]:
                    keep += 1
                st.cached = min(st.cached, st.base + keep)
                st.tail = []
            size = req.num_tokens
            if size > self.max_pos:  # past the draft's context: the target goes on alone
                continue
            n = min(n, self.max_pos - size + 1)
            take = min(size - st.cached, budget)
            if take <= 0:
                continue
            if take < size - st.cached or n <= 0:
                n = 0  # prefill the draft's cache this step, propose later
            if not self._resize(st, st.cached + take + max(n - 1, 0)):
                n = 0
                if not self._resize(st, st.cached + take):
                    continue
            plan.append((req, st, take, n))
            budget -= take
        if plan:
            self._run(res, plan)

    def _run(self, res: DraftResources, plan) -> None:
        model = res.model
        dev = self.device
        # round 0: catch up on the real tokens (a prefill chunk per request) and draft one
        seqs = [(req.token_ids[st.cached:st.cached + take], st) for req, st, take, _ in plan]
        hidden = self._forward(res, seqs)
        ends, row = [], 0
        for toks, _ in seqs:
            row += len(toks)
            ends.append(row - 1)
        for (_, st, take, _) in plan:
            st.cached += take
        active = [i for i, p in enumerate(plan) if p[3] > 0]
        if not active:
            return
        logits = model.logits(hidden[torch.tensor([ends[i] for i in active], device=dev)])
        drafts: dict[int, list[int]] = {i: [] for i in active}
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        r = 0
        while True:
            toks, probs = self._sample(res, [plan[i][0] for i in active], logits)
            for a, i in enumerate(active):
                drafts[i].append(toks[a])
                if probs is not None and plan[i][0].params.temperature > 0:
                    qs[i].append(probs[a])
            r += 1
            active = [i for i in active if plan[i][3] > r]
            if not active:
                break
            seqs = [([drafts[i][-1]], plan[i][1]) for i in active]
            hidden = self._forward(res, seqs)
            for i in active:
                plan[i][1].cached += 1
            logits = model.logits(hidden)
        for i, dr in drafts.items():
            req, st, _, n = plan[i]
            req.spec_token_ids = dr
            st.base = req.num_tokens
            st.tail = dr[: n - 1]
            if qs[i]:
                res.pending[req.request_id] = torch.stack(qs[i])

    def _forward(self, res: DraftResources, seqs) -> torch.Tensor:
        """One packed forward of ``(tokens, seq)`` pairs written at ``seq.cached`` onwards.
        Short chunks after some context are decode rows (one per token, each attending to its
        own prefix); a step of decode rows only replays a CUDA graph where there are graphs."""
        rows = [(toks, st.cached, st.blocks, st.cached > 0 and len(toks) <= self.max_chunk)
                for toks, st in seqs]
        return packed_forward(res.model, res.kv.tensor, res.state, res.graphs, self.device,
                              self.block_size, rows)

    def _sample(self, res: DraftResources, reqs, logits: torch.Tensor):
        """Draft tokens: the argmax for greedy requests, a sample from q (the request's
        temperature/top-k/top-p applied to the draft's logits) for the others."""
        params = [r.params for r in reqs]
        if all(p.temperature == 0 for p in params):
            return logits.argmax(-1).tolist(), None
        dev = self.device
        gens = []
        for r in reqs:
            seed = r.params.seed
            g = None
            if seed is not None and r.params.temperature > 0:
                # its own stream, not the target's: seeded from the request's seed
                g = res.state.generator(r.request_id, (seed * 0x9E3779B1 + 1) % 2**63)
            gens.append(g)
        sb = SamplingBatch(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            generators=gens, all_greedy=False, need_logprobs=False)
        probs = apply_penalty_free_filters(logits, sb).softmax(-1)
        tokens = torch.where(sb.temperature > 0, race(probs, gens), logits.argmax(-1))
        return tokens.tolist(), probs

    # -- verifying -------------------------------------------------------------------------------
    def _draft_probs(self, batch):
        pending = self._res().pending
        return [pending.get(req.request_id) for req, _ in batch]

    def _verified(self, batch, drafts, n_acc) -> None:
        self._res().pending_clear()

"""``EngineCore``: the synchronous heart. ``step()`` is propose → schedule → execute → update,
read top-down in :meth:`EngineCore.step`:

* schedule: ``Scheduler.schedule()`` picks the batch (engine/core/scheduler.py);
* execute: ``ModelRunner.launch`` runs it (engine/runner/); a batch with a constrained request
  whose token is still in flight runs in two halves instead (``_late_step``, late_step.py);
* update: the tokens read back become outputs -- stop checks, detokenization, the terminal
  output (``_update``; overlapped, ``_defer`` now and ``_complete`` during the next step).

It owns the requests, the scheduler and the runner; it knows nothing about async, processes or
lifecycles. The async engine calls ``step()`` on its step thread and applies adds/aborts only
between steps (engine/serving/loop.py), so nothing here needs a lock.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

from engine.errors import BadRequestError
from engine.kv.kv_cache import blocks_needed
from engine.params import Logprobs, RequestOutput, SamplingParams
from engine.request import DEFAULT_CLIENT, Request
from engine.runner.model_runner import ModelRunner
from engine.sample.bad_words import bad_word_sequences
from engine.sample.sampler import StepResult
from engine.spec_decode.base import SpecStats
from engine.structured.matcher import new_matcher

from .detokenizer import IncrementalDetokenizer
from .late_step import LateStep
from .scheduler import Scheduler
from .stats import CoreStats, EngineTimings


_NO_LIMIT: tuple[bool, Optional[str]] = (False, None)


class EngineCore(LateStep):
    def __init__(self, runner: ModelRunner, *, check_integrity: bool = False):
        self.runner = runner
        self.tokenizer = runner.tokenizer
        cfg = runner.config
        self.blocks = runner.block_manager
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.check_integrity = check_integrity
        self._eos = runner.tokenizer.eos_token_ids | set(runner.model_config.eos_token_ids)
        self._steps = 0
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._finished: dict[str, int] = {}
        # the one speculation counter is the speculator's (verification knows it exactly); kept
        # here so that the figures outlive the speculator, which the release drops
        spec = runner.speculator
        self._spec = spec.stats_ if spec is not None else SpecStats()
        self.timings = EngineTimings(runner.max_model_len)
        # overlapped scheduling: the step launched but not yet applied, (batch, Launched)
        self._inflight = None
        self._inflight_first = False  # a request's first token is in the step in flight
        self.early_completions = 0  # steps applied before the next launch (EngineCore.step)
        self.deferred_steps = 0  # steps whose tokens were read back during the next one
        self._init_late(runner)  # the late step's counters (late_step.py)
        overlap = cfg.overlap_scheduling
        if overlap is None:
            overlap = runner.device.type == "cuda"
        self._overlap = overlap and runner.speculator is None and not runner.tensor_parallel

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, grammar=None,
                    client: str = DEFAULT_CLIENT) -> Request:
        """Validated input only (the async engine checks ids, params and length first).

        The request's per-request state is prepared here, once (``ModelRunner.admit``): if that
        fails, nothing is added and the error is raised for this request alone. ``grammar``:
        the compiled grammar of ``params.structured`` (the async engine compiled it); the
        request gets its own matcher of it. ``client``: whose request (the waiting queue's turns)."""
        req = Request(request_id, prompt_token_ids, params, client)  # keeps its own copy of ids
        try:
            if params.structured is not None:
                if grammar is None:
                    raise BadRequestError("a structured output needs its compiled grammar")
                req.matcher = new_matcher(grammar)
            req.detok = IncrementalDetokenizer(self.tokenizer, req.token_ids, params.stop,
                                               params.skip_special_tokens,
                                               params.include_stop_str_in_output)
            if params.bad_words:
                req.bad_words = bad_word_sequences(self.tokenizer, params.bad_words)
            self.runner.admit(req)
        except Exception as exc:
            self.runner.forget(request_id)
            raise BadRequestError(f"request {request_id!r} cannot be prepared: "
                                  f"{type(exc).__name__}: {exc}") from exc
        # the fewest tokens at which _length_limit can say yes (its three limits, one number)
        req.token_limit = min(req.num_prompt_tokens + params.max_tokens, self.runner.max_model_len,
                              self.blocks.num_blocks * self.runner.block_size)
        self.timings.arrived(req.arrival, idle=not self.requests)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self._prompt_tokens += req.num_prompt_tokens
        return req

    def abort(self, request_id: str, reason: str) -> Optional[RequestOutput]:
        """Finish ``request_id`` with "abort"; returns its terminal output (None if unknown)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return self._finish(req, "abort", reason, RequestOutput(request_id=request_id))

    def abort_all(self, reason: str) -> list[RequestOutput]:
        return [o for rid in list(self.requests) if (o := self.abort(rid, reason)) is not None]

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    @property
    def in_flight(self) -> bool:
        """A deferred step is launched and not yet applied: the next ``step()`` waits for it."""
        return self._inflight is not None

    def settle(self) -> list[RequestOutput]:
        """Apply the step in flight (overlapped), launch none (a pause: nothing on the device)."""
        prev, self._inflight = self._inflight, None
        outputs = self._complete(*prev) if prev is not None else []
        self.timings.end_iteration(self._gen_tokens)
        return outputs

    def reset_kv(self, weights_version: Optional[int] = None) -> None:
        """The KV cache's contents are stale (new weights, or a cache rebuilt after a sleep):
        nothing cached may be reused. Only with no request in the engine, so it frees nothing
        in use. NOTE: prefix caching invalidates its cached blocks here."""
        if self.requests or self.scheduler.has_work():
            raise RuntimeError(f"reset_kv with {len(self.requests)} request(s) in the engine")
        self.blocks.reset_prefix_cache(weights_version)
        self.blocks.check_integrity([])

    # -- the step -----------------------------------------------------------------------------
    def step(self, on_launched: Optional[Callable[[], None]] = None) -> list[RequestOutput]:
        """Schedule, launch and apply one step. Overlapped (``overlap_scheduling``): when the
        step before was deferred, this one is scheduled and launched *before* that one's
        tokens are read back, so the device runs this step while the host applies the last
        one (stop checks, detokenization, outputs): the outputs returned are the previous
        step's, and this step's follow with the next call (``has_work`` stays true). A step
        with a constrained request whose token is in flight is launched in two halves: the
        forward, then -- once the step before is applied and its matchers took their tokens --
        the grammar masks and the sampling (``runner.forward`` / ``runner.sample_step``).

        ``on_launched()`` is called (on this thread) once this step is launched (its forward,
        in two halves), when the host is about to wait for the step before's tokens: the moment
        to let other host work run."""
        outputs = self._step(on_launched)
        self.timings.end_iteration(self._gen_tokens)  # the outputs' tokens, one observation
        return outputs

    def _step(self, on_launched: Optional[Callable[[], None]]) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        # the step before, still on the device (overlapped): applied now where it must be
        prev = self._inflight
        self._inflight = None
        if prev is not None and self.scheduler.blocks_short():
            # scheduling could preempt a request whose token is in flight: apply it first
            outputs += self._complete(*prev)
            prev = None
        elif (prev is not None and self._inflight_first and prev[1].ready
              and self.scheduler.prefill_pending()):
            # NOTE: the step in flight carries first tokens and the device is done with it,
            # while the next step is an eager one (prompt tokens) whose launch is long host
            # work (~30 ms on the H200): launched first, it would hold those first tokens back
            # that long. Applied now and returned at once, without a launch; the
            # next call launches (the device is idle either way: its step is done).
            self.early_completions += 1
            return self._complete(*prev)
        # propose, schedule
        if self.runner.speculator is not None:
            self.runner.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        # execute
        launched = None
        if batch:
            self.timings.scheduled(batch)
            defer = self._overlap and all(req.overlappable for req, _ in batch)
            if prev is not None and any(r.matcher is not None for r, _ in batch):
                launched, late = self._late_step(prev, batch, defer, on_launched)
                outputs += late
                prev = None
            else:
                launched = self.runner.launch(batch, defer)
        # update: the step before's tokens (overlapped), then this step's -- or, deferred,
        # only its bookkeeping, its tokens with the next step
        if prev is not None:
            if on_launched is not None:
                on_launched()
            outputs += self._complete(*prev)
        if launched is None:
            return outputs
        if launched.is_deferred:
            self._defer(batch, launched)
        else:
            outputs += self._update(batch, launched.result)
        self._steps += 1
        self._budget.prune(self.requests.values())  # (requests gone while their fill ran)
        self.timings.step_time.observe(time.perf_counter() - t0)
        if self.check_integrity:
            self.scheduler.check_integrity()
        return outputs

    def _defer(self, batch, launched) -> None:
        """A deferred step's bookkeeping that needs no token values: its computed tokens are
        in the cache; a request that samples has one token in flight (``pending``) and is
        held back from the next step if that token is certain to be its last."""
        rows = launched.rows
        first = False
        fed: list[int] = []  # the constrained entries whose matchers take the token (_fed)
        fed_matchers: list = []
        fed_rows: list[int] = []
        for k, (req, n) in enumerate(batch):
            if req.finished:  # finished while this step was being launched (the step before)
                continue
            self.scheduler.advance(req, req.num_computed_tokens + n)
            if k in rows:
                req.pending, req.pending_row = 1, rows[k]
                req.hold = self._last_token_pending(req)
                first = first or req.first_token_time is None
                if req.matcher is not None and req.params.max_tokens > 0:
                    fed.append(k)
                    fed_matchers.append(req.matcher)
                    fed_rows.append(rows[k])
        # (valid while no request leaves the scheduler: its count of removals is kept with it)
        launched.fed = ((fed, fed_matchers, fed_rows, self.scheduler.removed) if fed
                        else None)
        self._inflight = (batch, launched)
        self._inflight_first = first
        self.deferred_steps += 1

    def _last_token_pending(self, req: Request) -> bool:
        return self._length_limit(req, req.num_known_tokens)[0]

    def _length_limit(self, req: Request, num_tokens: int) -> tuple[bool, Optional[str]]:
        """Whether ``req`` with ``num_tokens`` tokens ends by length, and the reason given
        (None: its own max_tokens)."""
        if num_tokens < req.token_limit:  # (the three checks below, as one comparison)
            return _NO_LIMIT
        if num_tokens - req.num_prompt_tokens >= req.params.max_tokens:
            return True, None
        if num_tokens >= self.runner.max_model_len:
            return True, "context limit"
        if blocks_needed(num_tokens + 1, self.runner.block_size) > self.blocks.num_blocks:
            return True, "KV cache capacity"
        return False, None

    def _complete(self, batch, launched, verdicts: Optional[dict] = None) -> list[RequestOutput]:
        """Apply a deferred step: read its tokens back, then stop checks and outputs. Requests
        that finished or were aborted since it was launched are skipped (their terminal
        output was sent then). ``verdicts``: entry -> its matcher's verdict on its token,
        when :meth:`_advance_matchers` fed them already."""
        result = self.runner.collect(launched)
        outputs: list[RequestOutput] = []
        for k, (req, _) in enumerate(batch):
            if req.finished:
                req.pending, req.hold = 0, False
                continue
            new = result.tokens[k]
            self._prompt_lps(req, k, result)
            if new and req.pending:
                req.pending, req.hold = 0, False
                outputs.append(self._output(req, k, new, result,
                                            verdicts.get(k) if verdicts else None))
        return outputs

    def _update(self, batch, result: StepResult) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for k, (req, n) in enumerate(batch):
            if req.finished:  # by the deferred step applied just before this one
                continue
            new = result.tokens[k]
            self._prompt_lps(req, k, result)
            req.spec_token_ids = []
            if not new:
                self.scheduler.advance(req, req.num_computed_tokens + n)
                continue
            # accepted drafts are in the cache too; blocks only rejected ones used go back
            self.scheduler.advance(req, req.num_computed_tokens + n + len(new) - 1)
            outputs.append(self._output(req, k, new, result))
        return outputs

    @staticmethod
    def _prompt_lps(req: Request, k: int, result: StepResult) -> None:
        if k in result.prompt_lps:
            chunk = result.prompt_lps[k]
            req.prompt_lps.append(chunk)
            req.num_prompt_lps += len(chunk)

    def _output(self, req: Request, k: int, new: list[int], result: StepResult,
                verdict: Optional[tuple] = None) -> RequestOutput:
        out = self._append(req, new, result.logprobs[k] if result.logprobs else None, verdict)
        if result.token_lps is not None and req.params.logprobs:
            got = result.token_lps[k]  # a row per new token; a stop drops those after it
            if got is not None:
                out.token_logprobs = got if len(out.token_ids) == len(new) else got[: len(out.token_ids)]
        return out

    def _first_output(self, req: Request, out: RequestOutput) -> None:
        """The prompt's cached tokens, logprobs, text and ids go with a request's first output."""
        p = req.params
        req.prompt_sent = True
        out.num_cached_tokens = req.num_cached_tokens
        if p.return_prompt_token_ids:
            out.prompt_token_ids = req.token_ids[: req.num_prompt_tokens]
        if p.prompt_logprobs is not None:
            k = min(p.prompt_logprobs, self.runner.model_config.vocab_size)
            first = Logprobs.first_prompt_token(req.token_ids[0], k)
            rows = Logprobs.join([first, *req.prompt_lps])
            out.prompt_logprobs = rows[: req.num_prompt_tokens]
        if p.echo:  # the special tokens too: the text the prompt's tokens stand for
            out.prompt_text = self.tokenizer.decode(req.token_ids[: req.num_prompt_tokens],
                                                    skip_special_tokens=False)

    def _append(self, req: Request, new: list[int], logprobs,
                verdict: Optional[tuple] = None) -> RequestOutput:
        """``verdict``: the matcher's on ``new[0]``, when it was fed that token already."""
        p = req.params
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
            self.timings.iter_tokens += req.num_prompt_tokens
        finish: Optional[str] = None
        reason = None
        accepted: list[int] = []
        text = ""
        if p.max_tokens == 0:  # scoring only: the prompt's logprobs, no token
            finish, new = "length", []
        for tok in new:
            if req.matcher is not None:  # the grammar's verdict: complete, or a dead end
                finish, reason = verdict or self._budget.advance(req.matcher, tok)
                verdict = None
                if finish == "error":
                    break  # a token the grammar refuses is not part of the output
            req.token_ids.append(tok)
            accepted.append(tok)
            n_out = req.num_output_tokens
            if finish:
                pass
            elif n_out >= p.min_tokens and ((tok in self._eos and not p.ignore_eos)
                                          or tok in req.stop_ids):
                finish = "stop"
            elif (limit := self._length_limit(req, req.num_tokens))[0]:
                finish, reason = "length", limit[1]
            # token by token, so a stop string ends the output where it would without
            # speculation (accepted drafts after it are dropped)
            if not (tok in self._eos and finish == "stop"):
                text += req.detok.add([tok])
            if req.detok.stopped:
                finish = "stop"
            if finish:
                break
        if self._budget.pending and not finish:  # its grammar's work was over the budget
            finish, reason = self._budget.verdict(req.matcher, p.structured) or (finish, reason)
        self._gen_tokens += len(accepted)
        out = RequestOutput(request_id=req.request_id, token_ids=accepted, text=text)
        if p.logprobs:  # the accepted tokens' (a prefix of the step's new tokens)
            lps = logprobs or []
            out.logprobs = lps if len(lps) == len(accepted) else lps[: len(accepted)]
        if not req.prompt_sent:
            self._first_output(req, out)
        if finish:
            out.text += req.detok.flush()
            return self._finish(req, finish, reason, out)
        out.num_prompt_tokens = req.num_prompt_tokens
        out.num_output_tokens = req.num_output_tokens
        return out

    def _finish(self, req: Request, finish_reason: str, reason: Optional[str],
                out: RequestOutput) -> RequestOutput:
        self._budget.forget(req.matcher)
        self.scheduler.remove(req)
        self.runner.forget(req.request_id)
        del self.requests[req.request_id]
        self.timings.finished(req)
        self._finished[finish_reason] = self._finished.get(finish_reason, 0) + 1
        out.finished = True
        out.finish_reason = finish_reason  # type: ignore[assignment]
        out.reason = reason
        out.num_prompt_tokens = req.num_prompt_tokens
        out.num_output_tokens = req.num_output_tokens
        return out

    # -- introspection --------------------------------------------------------------------------
    num_running = property(lambda self: len(self.scheduler.running))
    num_waiting = property(lambda self: len(self.scheduler.waiting))
    kv_usage = property(lambda self: self.blocks.usage)
    spec_stats = property(lambda self: self._spec)

    def statistics(self) -> CoreStats:
        cache = self.blocks.statistics()
        return CoreStats(self._steps, self._prompt_tokens, self._gen_tokens, dict(self._finished),
                         self.scheduler.num_preemptions, self._spec.proposed, self._spec.accepted,
                         cache.queries, cache.hits)

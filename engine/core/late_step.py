"""A late step: :meth:`EngineCore.step`'s launch of a batch with a constrained request whose
token is still in flight (overlapped scheduling with output constraints).

The step's forward is launched first; the step before is read back meanwhile, its constrained
requests' matchers take their tokens and the next grammar masks are filled -- on the grammar
worker (``structured/native.py``, a C++ thread that never takes the GIL) when it can be had --
and only then are the masks applied and the step sampled. Kept apart from ``engine_core.py`` as the
one part of a step that exists for output constraints; :class:`EngineCore` inherits it (the
state it reads -- the runner, the scheduler, the counters -- is the core's).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from engine.params import RequestOutput
from engine.runner.launched import Launched
from engine.structured.bitmask import Filling
from engine.structured.matcher import ALL_GO_ON, verdicts_of


class LateStep:
    def _init_late(self, runner) -> None:
        """The late step's counters and choices, and the grammar budget (EngineCore's init)."""
        # steps sampled only after the step before was applied (a constrained request's token
        # was in flight: EngineCore.step)
        self.late_sampled_steps = 0
        # their host time by part: the forward's launch; reading the step before back and
        # feeding its tokens to the matchers; applying it (the masks fill meanwhile); waiting
        # for the masks, masking and launching the sampling
        self.late_seconds = dict.fromkeys(("forward", "read_back", "apply", "mask_sample"), 0.0)
        #: a step sampled late applies the step before after launching its sampling (an
        #: asynchronous device), or before it, beside the masks' fill (CPU): EngineCore.step
        self.apply_after_sampling = runner.device.type == "cuda"
        #: a late step's grammar work on the grammar worker, beside its forward's launch
        #: (EngineCore._grammar_job; structured/native.py), where the worker can be had;
        #: the ``grammar_worker`` kill switch (engine/envs.py) keeps it on the step thread
        self.grammar_overlap = runner.switches.grammar_worker
        self.grammar_jobs = 0  # late steps whose grammar work ran beside the forward
        self.grammar_jobs_after = 0  # of them, those started after the forward's launch
        self.grammar_jobs_refused = 0  # of them, those a token out of its mask undid (none fed)
        self.grammar_jobs_inside = 0  # of them, those started inside the forward's launch
        #: each constrained request's grammar work a step, bounded (structured/budget.py)
        self._budget = runner.grammar_budget

    def _late_step(self, prev, batch, defer: bool, on_launched: Optional[Callable[[], None]]
                   ) -> tuple[Launched, list[RequestOutput]]:
        """:meth:`step`'s launch of ``batch`` in two halves, with a constrained request whose
        token is in flight in ``prev`` (the step before, applied here): the launched step and
        the step before's outputs."""
        # a constrained request's mask needs its matcher to have taken the token in
        # flight (and the step before's copy of the mask rows to be done): the forward
        # first; while the device runs it, the step before is read back, its matchers
        # take their tokens, the masks are filled in the background while the rest of
        # that step is applied; then the masks go on and the step is sampled
        # NOTE: on an asynchronous device (``apply_after_sampling``) the step before
        # is applied after the sampling is launched: the device then has the sampling
        # queued behind the forward while the host applies, and the next step's
        # forward follows sooner (applied first, the host's whole apply is device idle
        # time on top of the next step's scheduling). The fill runs in the foreground
        # there (a helper thread's hand-over costs more than a fill of hundreds of
        # rows). On the CPU the fill runs beside the apply instead: the forward has run.
        outputs: list[RequestOutput] = []
        t0 = time.perf_counter()
        # the step before's tokens are back already: its matchers take them and this
        # step's masks are filled on the grammar worker (a C++ thread that never takes
        # the GIL), beside this forward's launch
        ready = self.grammar_overlap and prev[1].ready
        job = self._grammar_job(*prev, batch) if ready else None
        started: list = []  # the job started inside the forward's launch (poll)

        def poll() -> None:
            if not started and prev[1].ready:
                started.append(self._grammar_job(*prev, batch))

        # still on the device before the launch, the step before is looked for again inside
        # the forward's launch (``poll``: before the graph's replay, and before the logits):
        # the job then starts there and the worker runs beside the rest of the launch
        later = self.grammar_overlap and not ready and self.runner.has_grammar_worker
        fwd = self.runner.forward(batch, poll if later else None)
        if started:
            job = started[0]
            self.grammar_jobs_inside += job is not None
        elif later:
            # NOTE: still on the device before the launch (215 of 256 late steps on a fast
            # H100 host), its tokens are back, or nearly, once the forward is launched (~1 ms
            # of host work): the job starts now, the wait for them without the GIL, and runs
            # beside the loop's delivery of the outputs held (on_launched) instead of after
            # it on the step thread
            job = self._grammar_job(*prev, batch)
            self.grammar_jobs_after += job is not None
        t1 = time.perf_counter()
        if on_launched is not None:
            # NOTE: let in once the forward is launched, with a job too: let in after the
            # sampling's launch instead, the loop's delivery ran beside the next step's
            # forward (slower on a simulated device, no gain on the H100: bench/RESULTS.md)
            on_launched()
        after = self.apply_after_sampling
        done = self._grammar_done(*job) if job is not None else None
        if done is not None:
            verdicts, masks = done
        else:  # no job, or a token its mask refused (the job did nothing)
            self.grammar_jobs_refused += job is not None
            verdicts = self._advance_matchers(*prev)
            # the matchers just fed: terminated exactly when their verdict is a stop
            known = {id(prev[0][k][0].matcher): v[0] == "stop"
                     for k, v in verdicts.items()}
            masks = self.runner.fill_masks(fwd, background=not after, terminated=known)
        t2 = time.perf_counter()
        if not after:
            outputs += self._complete(*prev, verdicts)
        t3 = time.perf_counter()
        launched = self.runner.sample_step(fwd, defer, masks)
        del fwd
        t4 = time.perf_counter()
        if after:
            outputs += self._complete(*prev, verdicts)
        t5 = time.perf_counter()
        self.late_sampled_steps += 1
        part = self.late_seconds
        part["forward"] += t1 - t0
        part["read_back"] += t2 - t1
        part["apply"] += (t3 - t2) + (t5 - t4)
        part["mask_sample"] += t4 - t3
        return launched, outputs

    def _advance_matchers(self, batch, launched) -> dict[int, tuple]:
        """A deferred step's tokens read back and fed to the constrained requests' matchers
        (before the rest of the step is applied, so the next masks can be filled meanwhile):
        entry -> the verdict (``structured.matcher.advance``) that ``_append`` then uses."""
        fed, matchers, toks, rows = self._fed(batch, launched)
        verdicts = self._budget.advance_all(  # (each row's work timed: structured/budget.py)
            matchers, toks, self.runner.grammar_allows(rows, toks))
        return dict(zip(fed, verdicts))

    def _grammar_job(self, batch, launched, nxt):
        """The step before's constrained tokens (``batch``, ``launched``; read back here,
        waiting for the device if need be) and ``nxt``'s masks handed to the grammar worker
        (``runner.accept_then_fill``: it checks each token against its mask first, and does
        nothing if one is out), for :meth:`_grammar_done`. None where no job started (no
        worker, drafts): the usual path."""
        fed, matchers, toks, rows = self._fed(batch, launched)
        # (the worker checks each token against the row it was sampled from first)
        job = self.runner.accept_then_fill(matchers, toks, nxt, rows)
        if job is None:
            return None
        self.grammar_jobs += 1
        return fed, matchers, job

    @staticmethod
    def _grammar_done(fed, matchers, job):
        """A :meth:`_grammar_job`'s verdicts (entry of the step before -> verdict) and masks;
        None: a token was not in its mask, and the job did nothing (the usual path then)."""
        done = job.result()
        if done is None:
            return None
        ended, rows = done
        if not ended:  # the usual step: each entry with a matcher fed it (``_fed``'s rule:
            # pending, not finished, a token sampled, max_tokens > 0), and none ended
            return ALL_GO_ON, Filling(None, rows)
        return dict(zip(fed, verdicts_of(matchers, ended))), Filling(None, rows)

    def _fed(self, batch, launched) -> tuple[list[int], list, list[int], list[int]]:
        """A deferred step read back: the entries whose matcher takes the token it sampled,
        their matchers, those tokens, and the rows they were sampled from (whose masks are
        still in the bitmask's host rows: ``runner.grammar_allows``)."""
        tokens = self.runner.collect(launched).tokens
        plan = launched.fed
        if plan is not None and plan[3] == self.scheduler.removed:
            # none of the step's requests finished since _defer planned it: each entry it
            # planned is pending, and a deferred step samples one token an entry
            fed, matchers, rows = plan[0], plan[1], plan[2]
            return fed, matchers, list(map(launched.flat.__getitem__, rows)), rows
        fed = [k for k, (req, _) in enumerate(batch)
               if req.matcher is not None and req.pending and not req.finished and tokens[k]
               and req.params.max_tokens > 0]
        toks = [tokens[k][0] for k in fed]
        return (fed, [batch[k][0].matcher for k in fed], toks,
                list(map(launched.rows.__getitem__, fed)))


__all__ = ["LateStep"]

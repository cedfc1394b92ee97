"""Sleep, wake and weight updates across the ranks: the driver's side (a mixin of
:class:`~engine.tp.group.DriverGroup`; a worker's :class:`~engine.tp.link.WorkerLink` has the
same methods, running only its own part).

Each is one control frame to every worker (``channel.Sleep`` / ``Wake`` / ``Update``), the
driver's own part run meanwhile, then one ``Done`` from every worker. What a failure means:

* sleep and update: the ranks would no longer hold the same state (some asleep, some weights
  new), so an error on any rank fails the engine (``on_failure``, as a dead rank does). An
  update reaches the workers only after the driver checked it in full (names, shapes, dtypes):
  a refused update never gets here and changes nothing on any rank.
* wake: a rank that cannot wake (no memory for its cache, a checkpoint gone) releases what it
  brought back and is asleep again (``RunnerSleep.wake``); the ranks that did wake are put back
  to sleep too, and the caller gets the error with every rank asleep -- as with one rank.

A rank that does not answer within the collective timeout (``envs.tp_timeout_s``) after the
driver's own part is done is a failed rank.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from typing import Callable, Optional, Sequence

from engine import envs

from ..errors import EngineError
from .channel import Closed, Done, Failed, Sleep, Update, Wake

log = logging.getLogger("enginecore.tp")

ALL_TAGS = ["weights", "kv_cache"]


class RankFailed(EngineError):
    """A tensor-parallel rank died or failed; the engine cannot go on."""


class RankCallError(EngineError):
    """A sleep-mode call failed on another rank (every rank was left as it was before)."""


@dataclasses.dataclass
class Answers:
    value: object = None  # what the driver's own part returned
    local_error: Optional[BaseException] = None
    errors: dict[int, str] = dataclasses.field(default_factory=dict)  # by worker rank
    total: int = 0  # the workers' values, summed

    def first_error(self, what: str) -> BaseException:
        if self.local_error is not None:
            return self.local_error
        r, e = min(self.errors.items())
        return RankCallError(f"{what} failed on tensor-parallel rank {r}: {e}")


class DriverCalls:
    """Needs ``world``, ``_chans``, ``_inbox``, ``_procs``, ``_failed`` and ``on_failure``."""

    _seq = 0
    #: each worker's (resources held, parts asleep) after the last call it answered
    rank_states: dict[int, tuple[list[str], list[str]]] = {}

    def call(self, msg, local: Callable[[], object], ranks: Optional[Sequence[int]] = None) -> Answers:
        """``msg`` to every worker (or ``ranks``), ``local()`` here meanwhile, then each answer.
        A worker that is gone or does not answer fails the engine and raises ``RankFailed``."""
        self._seq += 1
        msg.seq = self._seq
        ranks = sorted(self._chans) if ranks is None else list(ranks)
        for r in ranks:
            try:
                self._chans[r].send(msg)
            except Closed as exc:
                raise self._fatal(f"tensor-parallel rank {r} is gone: {exc}") from None
        out = Answers()
        t0 = time.monotonic()
        try:
            out.value = local()
        except Exception as exc:  # the workers' answers first: they are mid-call too
            out.local_error = exc
        deadline = time.monotonic() + envs.tp_timeout_s() + (time.monotonic() - t0)
        pending = set(ranks)
        while pending:
            try:
                rank, got = self._inbox.get(timeout=0.1)
            except queue.Empty:
                dead = [r for r in pending if r in self._procs and self._procs[r].poll() is not None]
                if dead or time.monotonic() > deadline:
                    why = "exited" if dead else "did not answer"
                    raise self._fatal(f"tensor-parallel ranks {dead or sorted(pending)} {why} "
                                      f"({type(msg).__name__.lower()})")
                continue
            if isinstance(got, (Failed, Closed)):  # the reader reported it (on_failure) already
                self._failed = True
                why = got.error if isinstance(got, Failed) else f"connection lost ({got})"
                raise RankFailed(f"tensor-parallel rank {rank} failed: {why}")
            if isinstance(got, Done) and got.seq == self._seq and rank in pending:
                pending.discard(rank)
                self.rank_states = {**self.rank_states, rank: (got.resources, got.asleep)}
                out.total += got.value
                if got.error:
                    out.errors[rank] = got.error
        return out

    def _fatal(self, why: str) -> BaseException:
        self._failed = True
        exc = RankFailed(why)
        cb = self.on_failure
        if cb is not None:
            cb(exc)
        return exc

    def _all_or_fail(self, out: Answers, what: str) -> Answers:
        if out.local_error is None and not out.errors:
            return out
        err = out.first_error(what)
        failed = self._fatal(f"{what} failed across the tensor-parallel ranks "
                             f"(they no longer agree): {err}")
        raise failed from (out.local_error if out.local_error is not None else None)

    # -- what the runner calls (engine/runner/sleep.py) -------------------------------------------
    def sleep_all(self, level: int, tags: Sequence[str], local: Callable[[], int]) -> int:
        """Every rank frees its device memory; the host bytes kept on every rank, summed."""
        out = self._all_or_fail(self.call(Sleep(0, level, list(tags)), local), "sleep")
        return int(out.value or 0) + out.total

    def wake_all(self, tags: Sequence[str], local: Callable[[], None], rollback_level: int,
                 local_rollback: Callable[[], object]) -> None:
        """Every rank brings back ``tags``; if one cannot, every rank is asleep again (with
        everything freed, at ``rollback_level``, as a failed wake leaves one rank) and the
        first error raises."""
        out = self.call(Wake(0, list(tags)), local)
        if out.local_error is None and not out.errors:
            return
        woke = [r for r in self._chans if r not in out.errors]
        log.warning("tensor parallel: wake failed on ranks %s; ranks %s go back to sleep",
                    sorted(out.errors) + ([0] if out.local_error else []), woke)
        back = self.call(Sleep(0, rollback_level, ALL_TAGS),
                         local_rollback if out.local_error is None else (lambda: 0), woke)
        self._all_or_fail(back, "sleep after a failed wake")
        raise out.first_error("wake_up")

    def update_all(self, names: list[str], shapes: list[list[int]], bucket_bytes: int,
                   source: Optional[str], local: Callable[[], int]) -> int:
        """Every rank writes its slices of the update whose bytes ``local`` broadcasts."""
        out = self._all_or_fail(self.call(Update(0, names, shapes, bucket_bytes, source), local),
                                "update_weights")
        return int(out.value or 0)


class WorkerCalls:
    """A worker's side of the same calls: its own part only (the driver coordinates; an
    update's bytes are received by ``RunnerSleep.receive_weights``)."""

    @staticmethod
    def sleep_all(level, tags, local):
        return local()

    @staticmethod
    def wake_all(tags, local, rollback_level, local_rollback):
        return local()

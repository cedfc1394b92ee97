"""``GrammarBudget``: one constrained request's grammar work in a step, bounded.

A grammar can compile at once and still cost more with every token: an ambiguous one (``s ::=
"" | s s | [a-z]``, or a regex like ``([a-z]*[a-z]*){100}!``) makes xgrammar's parser carry more
states after each character, so that request's mask fill and token accept grow with its output
(measured on the default model's vocabulary with 10-15 byte lowercase tokens: the EBNF's fill
0.2 ms at its first token, 14 ms at its 6th, 100 ms at its 11th, 2 s at its 31st; the regex's
38 ms from its 2nd). That work sits on the step every other request waits for, and one fill
cannot be interrupted. So it is measured per request (per row), where it runs -- the fill on
the step thread or the bitmask's helper thread (``structured/bitmask.py``), the accept in the
core's update or a late step (``structured/matcher.py`` calls through :meth:`advance` and
:meth:`advance_all` here), both on the grammar worker (``grammar_worker.cc``) -- and a request
whose fill or accept took more than ``EngineConfig.grammar_row_budget_ms`` of its thread's CPU
time in one step is ended by the core with ``finish_reason="error"`` and a reason
(:meth:`verdict`), the way a grammar's dead end ends it. CPU time, not wall time: a row whose
thread was merely preempted (a busy host) did no more work and is not ended.

Batch calls (xgrammar's batch fill over threads, its batch accept) cannot be timed per row: their
whole work is compared with the budget instead, and one over it makes the next call of that kind
run row by row, timed (:meth:`batch`, :meth:`row_by_row`): a growing grammar is caught one step
later (its cost grows by steps, not by orders of magnitude).

A constraint whose request was ended this way is remembered (:meth:`remember`, by its cache key)
and refused at admission for :data:`REFUSE_S` (:meth:`refused`, a 400 before any step): a
client that sends the same grammar again and again -- an attack, or a retry loop -- would
otherwise put every copy's first, cheaper but still growing, steps on the shared path.

The ledger is read and written on the step thread and the bitmask's helper thread: single dict
operations, atomic under the GIL. An entry holds its matcher (so no other matcher can take its
id while it is there); the core drops a finished request's entry (:meth:`forget`) and the
entries of matchers no request holds any more (:meth:`prune`: a fill that ended after its
request did).
"""

from __future__ import annotations

from collections import OrderedDict
import time
from typing import Iterable, Optional, Sequence

from .matcher import Verdict, advance, advance_all

_cpu = time.thread_time  # this thread's CPU seconds
#: seconds a constraint ended over the budget stays refused at admission
REFUSE_S = 600.0
#: constraints remembered at most (least recently ended first out)
REMEMBERED = 4096


class GrammarBudget:
    """``budget_ms``: the most CPU milliseconds one row's fill, or one row's accept, may take in
    one step; 0: no limit (nothing is timed)."""

    def __init__(self, budget_ms: float) -> None:
        self.limit = max(0.0, float(budget_ms)) / 1e3
        #: id(matcher) -> (matcher, CPU seconds, "fill" or "accept"): rows over the limit
        self._over: dict[int, tuple[object, float, str]] = {}
        self._row_by_row = {"fill": False, "accept": False}  # the next batch call, per row
        #: requests ended over the budget (a statistic)
        self.ended = 0
        #: constraint key -> (monotonic time its request was ended, the reason); written on the
        #: step thread, read on the event loop's (single operations: atomic under the GIL)
        self._costly: OrderedDict[str, tuple[float, str]] = OrderedDict()

    @property
    def on(self) -> bool:
        return self.limit > 0

    @property
    def pending(self) -> bool:
        """Whether some row is over the limit and not yet ended."""
        return bool(self._over)

    def charge(self, matcher, seconds: float, what: str) -> None:
        """``matcher``'s ``what`` took ``seconds`` of CPU time in one step."""
        if self.limit and seconds > self.limit:
            old = self._over.get(id(matcher))
            if old is None or old[1] < seconds:
                self._over[id(matcher)] = (matcher, seconds, what)

    def batch(self, seconds: float, what: str) -> None:
        """A batch ``what`` (every row at once) took ``seconds`` of work: over the limit, the
        next one runs row by row (:meth:`row_by_row`)."""
        if self.limit and seconds > self.limit:
            self._row_by_row[what] = True

    def row_by_row(self, what: str) -> bool:
        """Whether this ``what`` must run row by row, timed (and the flag is taken)."""
        if self._row_by_row[what]:
            self._row_by_row[what] = False
            return True
        return False

    def fill_rows(self, live: Sequence[tuple], host) -> None:
        """Fill ``host``'s row of each ``(matcher, row, drafts)`` on this thread, one xgrammar
        call a row, each timed (unless there is no limit)."""
        for matcher, row, _ in live:
            if not self.limit:
                matcher.fill_next_token_bitmask(host, row)
                continue
            c0 = _cpu()
            matcher.fill_next_token_bitmask(host, row)
            self.charge(matcher, _cpu() - c0, "fill")

    def advance(self, matcher, token: int) -> Verdict:
        """:func:`structured.matcher.advance`, its CPU time charged to ``matcher``."""
        if not self.limit:
            return advance(matcher, token)
        c0 = _cpu()
        verdict = advance(matcher, token)
        self.charge(matcher, _cpu() - c0, "accept")
        return verdict

    def advance_all(self, matchers: Sequence, tokens: Sequence[int],
                    allowed: Optional[Sequence[bool]] = None) -> list[Verdict]:
        """:func:`structured.matcher.advance_all`, timed: row by row after a batch over the
        limit (or for one row), else as one batch whose whole work is compared."""
        if not self.limit or not matchers:
            return advance_all(matchers, tokens, allowed)
        if len(matchers) == 1 or self.row_by_row("accept"):
            return [self.advance(m, t) for m, t in zip(matchers, tokens)]
        c0 = _cpu()
        verdicts = advance_all(matchers, tokens, allowed)
        self.batch(_cpu() - c0, "accept")
        return verdicts

    def verdict(self, matcher, spec=None) -> Optional[tuple[str, str]]:
        """``("error", reason)`` when ``matcher``'s request ends for its grammar's work (its
        entry is then dropped, its constraint ``spec`` remembered: :meth:`remember`); None:
        within the budget (or no matcher)."""
        entry = self._over.get(id(matcher)) if self._over else None
        if entry is None or entry[0] is not matcher:
            return None
        del self._over[id(matcher)]
        self.ended += 1
        _, seconds, what = entry
        why = (f"the grammar's {what} of one token took {seconds * 1e3:.1f} ms of CPU, over the "
               f"per-step budget of {self.limit * 1e3:g} ms (grammar_row_budget_ms)")
        if spec is not None:
            self.remember(spec.key, why)
        return "error", f"structured output: {why}: the grammar is too ambiguous to follow"

    def remember(self, key: str, reason: str) -> None:
        """A request of the constraint ``key`` was ended over the budget (``reason``)."""
        self._costly[key] = (time.monotonic(), reason)
        self._costly.move_to_end(key)
        while len(self._costly) > REMEMBERED:
            self._costly.popitem(last=False)

    def refused(self, key: str) -> Optional[str]:
        """Why the constraint ``key`` is refused at admission (ended over the budget within
        :data:`REFUSE_S`), or None."""
        entry = self._costly.get(key)
        if entry is None:
            return None
        age = time.monotonic() - entry[0]
        if age > REFUSE_S:
            self._costly.pop(key, None)
            return None
        return (f"invalid structured output: a request with this constraint was ended "
                f"{age:.0f} s ago for its grammar's work ({entry[1]}); "
                f"the same constraint is refused for {REFUSE_S:g} s")

    def forget(self, matcher) -> None:
        """``matcher``'s request is gone (None: it had none): its entry, if any, too."""
        entry = self._over.get(id(matcher)) if self._over else None
        if entry is not None and entry[0] is matcher:
            del self._over[id(matcher)]

    def prune(self, requests: Iterable) -> None:
        """Drop the entries of matchers that none of ``requests`` (those in the engine) holds."""
        if not self._over:
            return
        live = {id(r.matcher) for r in requests}
        for key in [k for k in self._over if k not in live]:
            self._over.pop(key, None)


__all__ = ["GrammarBudget", "REFUSE_S", "REMEMBERED"]

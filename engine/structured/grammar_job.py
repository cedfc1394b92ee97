"""A late step's grammar work on the grammar worker (``structured/native.py``, a C++ thread that
never takes the GIL): the step before's tokens fed to their matchers, then the next step's rows
of a :class:`~engine.structured.bitmask.TokenBitmask` filled, while the step thread launches
the forward.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional, Sequence

_MATCHER, _ROW, _DRAFTS = (operator.itemgetter(i) for i in range(3))  # of an entry


def start(bits, matchers: Sequence, tokens: Sequence[int], entries: Sequence[tuple],
          check_rows: Optional[Sequence[int]] = None) -> Optional["GrammarJob"]:
    """Start on ``bits``' grammar worker (``structured/native.py``, a C++ thread that
    never takes the GIL): feed ``matchers`` their ``tokens``, then fill the rows of
    ``entries`` (the next step's, planned before its forward) whose matchers did not just
    end. Each token must be in its mask: known (:func:`structured.matcher.accept_allowed`),
    or -- with ``check_rows``, the rows the tokens were sampled from -- checked by the
    worker first against those rows (``TokenBitmask.allows``'s rule), the job then doing nothing
    if one is not (:meth:`GrammarJob.result` says so). The caller's Python -- the next
    step's forward launch -- runs meanwhile; it leaves these matchers alone until
    :meth:`GrammarJob.result`. ``None`` (nothing started) where the worker cannot be had
    or an entry has drafts (their rows are filled one draft at a time: ``TokenBitmask.fill``)."""
    if any(map(_DRAFTS, entries)):  # (C-level passes: 256 rows are ~10 us, not ~50)
        return None
    if not bits.has_worker:
        return None
    rows = list(map(_ROW, entries))
    bits._check_last(max(rows, default=-1))  # (no drafts: an entry's last row is its row)
    if check_rows is not None:
        bits._check_last(max(check_rows, default=-1))
    if bits._stops is None and matchers:  # the tokenizer's: every grammar's the same
        bits._stops = frozenset(matchers[0].stop_token_ids)
    stops = bits._stops or frozenset()
    if len(entries) == len(matchers) and all(map(operator.is_, map(_MATCHER, entries),
                                                 matchers)):
        # the usual step: the same requests, in the same order, fed then filled
        fill_matchers = fill_fed = None
    else:
        position = {id(m): i for i, m in enumerate(matchers)}
        fill_matchers, rows, fill_fed = [], [], []
        for m, row, _ in entries:
            i = position.get(id(m), -1)
            if i < 0 and m.is_terminated():  # not fed now: its state is known already
                continue
            fill_matchers.append(m)
            rows.append(row)
            fill_fed.append(i)
    # (most steps feed no stop token: counted at C level first)
    ask = ([i for i, t in enumerate(tokens) if t in stops]
           if sum(map(tokens.count, stops)) else [])
    budget = bits.budget  # each row's work timed on the worker (structured/budget.py); the
    # fill row by row on one thread (as xgrammar's batch fill then is), or after a batch over it
    by_row = budget.on and (bits._threads == 1 or budget.row_by_row("fill"))
    bits._worker.submit(bits._batch_matcher(bits._threads), matchers, tokens, ask,
                        fill_matchers, rows, fill_fed, bits.host,
                        check_rows=check_rows if check_rows is not None else (),
                        vocab=bits.grammar_vocab, budget_ns=int(budget.limit * 1e9),
                        fill_by_row=by_row)
    return GrammarJob(bits._worker, bits._job_done, matchers, rows,
                      fill_fed if fill_fed is not None else range(len(rows)),
                      fill_matchers if fill_matchers is not None else matchers, budget,
                      0 if by_row else bits._threads)



class GrammarJob:
    """A :meth:`TokenBitmask.accept_then_fill` running on the grammar worker."""

    def __init__(self, worker, on_done: Callable[[float], None], matchers: Sequence,
                 fill_rows: list[int], fill_fed: list[int], fill_matchers: Sequence,
                 budget, batch_threads: int) -> None:
        self._worker = worker
        self._on_done = on_done  # called with the fill's seconds
        self._matchers = matchers
        self._rows = fill_rows
        self._fed = fill_fed
        self._fill_matchers = fill_matchers  # entry k's matcher (the rows over the budget)
        self._budget = budget
        self._batch_threads = batch_threads  # a batch fill's threads; 0: filled row by row

    def result(self) -> Optional[tuple[set[int], list[int]]]:
        """(the ids of the fed matchers that ended, the rows filled), once the job is done
        (the GIL is given up meanwhile); None: a token failed the job's check, nothing was fed
        or filled. Raises the job's error."""
        done = self._worker.wait()
        if done is None:
            return None
        fill_seconds, ended, over = done
        self._on_done(fill_seconds)
        if self._batch_threads:  # (its work: wall x threads)
            self._budget.batch(fill_seconds * self._batch_threads, "fill")
        for pos, ns in zip(over[::2], over[1::2]):  # rows over the budget (few: usually none)
            if pos >= 0:
                self._budget.charge(self._matchers[pos], ns * 1e-9, "accept")
            else:
                self._budget.charge(self._fill_matchers[-1 - pos], ns * 1e-9, "fill")
        if not ended:  # the usual step: no fed matcher ended, every fill entry was filled
            return set(), self._rows
        gone = set(ended)
        rows = [r for r, i in zip(self._rows, self._fed) if i < 0 or i not in gone]
        return {id(self._matchers[i]) for i in ended}, rows


__all__ = ["GrammarJob", "start"]

"""``TokenBitmask``: the runner's one token-bitmask buffer (a device resource, owned by the
runner's :class:`engine.memory.owner.DeviceOwner` and released with it) and the per-step masking.

Each step, every constrained row's matcher fills its row of the host bitmask (xgrammar's
``fill_next_token_bitmask``, CPU). A request with draft tokens (speculative decoding) has one row
per draft position: its matcher fills the first row, takes draft 1, fills the next, ... and is
rolled back to where it was; at the first draft the grammar refuses it stops (that row's mask
refuses the draft, so verification rejects it there; the rows after it are never used). On CUDA
the filled rows are copied to the device buffer in one transfer (pinned host rows, non-blocking);
then xgrammar's kernel sets the disallowed logits to -inf on the logits' device (its Triton
kernel on CUDA, launched directly: ``_mask_packed``; its C++ path on CPU through
``apply_token_bitmask_inplace``), once for the whole batch,
before sampling -- so greedy, temperature, top-k/top-p and seeds all sample from the allowed set.
Rows without a constraint are left untouched (``indices``). The rows are filled together on
xgrammar's own threads (``BatchGrammarMatcher``); each row's fill is timed against a budget
(``structured/budget.py``) where a batch's was over it. The host rows
cover only the ids xgrammar knows (``grammars.grammar_vocab_size``: up to the last id with text
or an EOS id); the device rows are as wide as the logits, and their words past the host rows'
are zero, so the padding ids past them are refused too. The logits are
copied first only when the step reports logprobs (they are those of the raw distribution).

Overlapped scheduling (engine/core/engine_core.py) fills in the background: ``fill(background=True)`` runs
the fill on this bitmask's one helper thread while the step thread applies the step before
(detokenization, stop checks, outputs); xgrammar releases the GIL while it fills (both
``fill_next_token_bitmask`` and ``batch_fill_next_token_bitmask``: a Python loop beside a fill
loop ran at 0.5-0.65x its own speed, not stalled), so the two host costs overlap. ``mask``
waits for the rows, then copies and applies them. NOTE: the host rows are reused every step;
a fill may only start once the step before has been read back (its copy of them is done).
On an asynchronous device a late step's grammar work runs on the grammar worker instead
(``accept_then_fill``, engine/structured/grammar_job.py), beside the forward's launch.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
import threading
import time
from typing import Callable, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from engine.envs import Switches
from engine.ops.triton import fused_sample
from engine.ops.triton.fused_sample import GrammarRows

from . import grammar_job
from .budget import GrammarBudget
from .grammar_job import GrammarJob
from .kernels import direct_kernel, fill_threads, threads_for


class Filling(NamedTuple):
    """Rows of a :class:`TokenBitmask` being filled: on its helper thread (``future``) or
    done (``done``)."""

    future: Optional[Future]
    done: Optional[list[int]]

    def rows(self) -> list[int]:
        """The rows filled (waits for a background fill; re-raises its error)."""
        return self.done if self.future is None else self.future.result()


class TokenBitmask:
    """``grammar_vocab``: the ids the matchers' grammars know (``grammars.grammar_vocab_size``;
    a callable, resolved at the first fill), at most ``vocab_size``: the host rows xgrammar
    fills are that wide; the device rows are as wide as the logits, and their words past the
    host rows' stay zero, so the ids past ``grammar_vocab`` (padding) are refused."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device,
                 grammar_vocab: Union[int, Callable[[], int], None] = None,
                 switches: Switches = Switches(), budget: Optional[GrammarBudget] = None) -> None:
        self.vocab_size = vocab_size
        #: each row's fill timed against one budget (structured/budget.py)
        self.budget = budget if budget is not None else GrammarBudget(0)
        #: on a device, masks through xgrammar's Triton kernel launched directly
        #: (:meth:`_mask_packed`) unless the ``triton`` kill switch is off; and the one-pass
        #: sampler reads the masks itself (:meth:`grammar_rows`) unless ``fused`` is
        self._switches = switches
        self.device = torch.device(device)
        self._grammar_vocab = vocab_size if grammar_vocab is None else grammar_vocab
        self._max_rows = max_rows
        # the device rows (CPU: the rows masks are applied from); zero words refuse their ids.
        # With xgrammar's kernel launched directly (a device: _mask_packed) the rows are
        # packed at the front instead, ``grammar_vocab`` ids a row, and a fill refuses the rest
        self.dev = torch.zeros((max_rows, -(-vocab_size // 32)), dtype=torch.int32,
                               device=self.device)
        self._host: Optional[torch.Tensor] = None  # the rows xgrammar fills, made on first use
        # xgrammar's BatchGrammarMatcher by thread count, made on first use; the count the next
        # fill uses follows the last fill's work (_threads_for)
        self._batch: dict[int, object] = {}
        self._threads = 1
        #: the grammar worker's fills: their count and wall seconds in all (a statistic)
        self.worker_fills = 0
        self.worker_fill_seconds = 0.0
        self._pool: Optional[ThreadPoolExecutor] = None  # the background fill's one thread
        self._worker = None  # the grammar worker (structured/native.py), made on first use;
        # False where it cannot be had
        self._stops: Optional[frozenset] = None  # the matchers' stop tokens (the tokenizer's)
        # on a device: xgrammar's Triton kernel, launched by _mask_packed; the device rows are
        # then packed at the front of ``dev`` (``grammar_vocab`` ids a row), never full width
        self._direct: Optional[tuple] = None  # (kernel, programs), resolved at the first mask
        #: row count -> (the front of ``dev`` as [n, host words], ``host[:n]``): views made
        #: once (:meth:`_device_words`); dropped by close() with the buffers
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def max_rows(self) -> int:
        return self._max_rows

    @property
    def grammar_vocab(self) -> int:
        """The ids the host rows cover (resolved now if it was given as a callable)."""
        n = self._grammar_vocab
        if callable(n):
            n = self._grammar_vocab = min(int(n()), self.vocab_size)
        return n

    @property
    def host(self) -> torch.Tensor:
        """The host rows xgrammar fills: ``grammar_vocab`` ids wide (pinned on CUDA)."""
        if self._host is None:
            words = -(-self.grammar_vocab // 32)
            with torch.inference_mode(False):  # a plain tensor (close() empties it in place)
                self._host = torch.full((self._max_rows, words), -1, dtype=torch.int32,
                                        pin_memory=self.device.type == "cuda")
        return self._host

    def apply(self, logits: torch.Tensor, entries: Sequence[tuple], copy: bool = True
              ) -> torch.Tensor:
        """Mask ``logits`` [N, V] for ``entries``: ``(matcher, first row, drafts)`` per
        constrained request (its rows are ``first row .. first row + len(drafts)``). Returns
        ``logits`` masked in place, or with ``copy`` a masked copy (the raw logits kept for
        logprobs); ``logits`` itself when nothing is constrained. :meth:`fill` then
        :meth:`mask`."""
        return self.mask(logits, self.fill(entries), copy)

    def fill(self, entries: Sequence[tuple], background: bool = False,
             terminated: Optional[dict] = None) -> "Filling":
        """Fill the host rows of ``entries`` (the matchers' current states). With
        ``background`` the fill runs on this bitmask's helper thread (the caller must leave
        these matchers alone until :meth:`mask`). NOTE: the fill keeps the GIL
        (``structured/gil.py``), so the caller's Python waits for it rather than runs beside
        it; the helper thread still lets the caller's own GIL-free work (torch ops, device
        waits) overlap the fill. ``terminated``: ``id(matcher) -> whether it is terminated``
        for matchers whose state the caller knows (it just fed them: ``advance_all``'s
        verdicts); the others are asked (one xgrammar call each)."""
        known = terminated or {}
        live = [e for e in entries
                if not (known[id(e[0])] if id(e[0]) in known else e[0].is_terminated())]
        self._check_last(max((row + len(drafts) for _, row, drafts in live), default=-1))
        if not live:
            return Filling(None, [])
        host = self.host  # made here, not on the helper thread
        if not background:
            return Filling(None, self._fill(live, host))
        return Filling(self._submit(self._fill, live, host), None)

    def _check_last(self, last: int) -> None:
        if last >= self.max_rows:
            raise RuntimeError(f"sampled row {last}; the bitmask has {self.max_rows}")

    def _submit(self, fn, *args) -> Future:
        """``fn(*args, started)`` on this bitmask's one helper thread; returns once it has
        begun (``fn`` sets ``started`` first)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-fill")
        started = threading.Event()
        future = self._pool.submit(fn, *args, started)
        # NOTE: the caller goes on with Python (the step before's outputs) and would keep the
        # GIL from the helper thread until it blocks: the fill started only then, after the
        # work it was to overlap (measured: 1.6 ms of Python, the fill began 1.62 ms after it
        # was submitted; waited for here, 0.015 ms)
        started.wait()
        return future

    def accept_then_fill(self, matchers: Sequence, tokens: Sequence[int],
                         entries: Sequence[tuple], check_rows: Optional[Sequence[int]] = None
                         ) -> Optional[GrammarJob]:
        """Feed ``matchers`` their ``tokens`` and fill the rows of ``entries`` on the grammar
        worker, beside the caller's Python: :func:`engine.structured.grammar_job.start`."""
        return grammar_job.start(self, matchers, tokens, entries, check_rows)

    @property
    def has_worker(self) -> bool:
        """Whether the grammar worker can be had (made here on first use)."""
        if self._worker is None:
            from .native import new_worker

            self._worker = new_worker() or False
        return bool(self._worker)

    def _job_done(self, fill_seconds: float) -> None:
        if fill_seconds > 0:  # (a job with no row to fill is not a fill)
            self.worker_fills += 1
            self.worker_fill_seconds += fill_seconds
            # the fill's work (wall x threads) sets the next one's threads
            self._threads = threads_for(fill_seconds * self._threads, fill_threads())

    def _batch_matcher(self, n: int):
        """xgrammar's ``BatchGrammarMatcher`` that fills on ``n`` threads (made once)."""
        batch = self._batch.get(n)
        if batch is None:
            from xgrammar import BatchGrammarMatcher

            batch = self._batch[n] = BatchGrammarMatcher(max_threads=n)
        return batch

    def mask(self, logits: torch.Tensor, filling: "Filling", copy: bool = True) -> torch.Tensor:
        """Apply the rows of ``filling`` (waiting for it) to ``logits``: see :meth:`apply`."""
        rows = filling.rows()
        if not rows:
            return logits
        if logits.stride(-1) != 1:
            # xgrammar's kernels (and _mask_packed's launch of one) index a row's ids as
            # contiguous: a dense copy masked, written back unless ``copy``. (Never a fallback
            # to the public function here: once _mask_packed or grammar_rows ran, the device
            # rows' words past the host width hold packed words of other rows.)
            dense = self.mask(logits.clone(memory_format=torch.contiguous_format),
                              Filling(None, rows), copy=False)
            return dense if copy else logits.copy_(dense)
        n = max(rows) + 1
        host = self.host
        out = logits.clone() if copy else logits
        if self._packed():
            return self._mask_packed(out, rows, n, host)
        from xgrammar import apply_token_bitmask_inplace

        self.dev[:n, : host.shape[1]].copy_(host[:n], non_blocking=True)
        vocab = min(self.vocab_size, out.shape[-1])
        if len(rows) == n:  # rows 0 .. n-1 (unique): the first n logits rows, no index list
            apply_token_bitmask_inplace(out[:n], self.dev[:n], vocab_size=vocab)
        else:
            apply_token_bitmask_inplace(out, self.dev[:n], vocab_size=vocab,
                                        indices=self._indices(rows))
        return out

    def _mask_packed(self, out: torch.Tensor, rows: list[int], n: int,
                     host: torch.Tensor) -> torch.Tensor:
        """:meth:`mask` on a device: the host rows copied as they are (one contiguous copy
        into the front of the device buffer, rows ``grammar_vocab`` ids wide), the ids past
        them refused with one fill, and xgrammar's Triton kernel launched directly over the
        ids the rows cover.

        NOTE: xgrammar's ``apply_token_bitmask_inplace`` asks the device's properties twice
        and checks its arguments on every call, and the copy into the rows' first words of the
        full-width buffer is strided (a copy kernel after the transfer): the late step pays
        for those on the host's critical path, once a step."""
        words = host.shape[1]
        dev = self._device_words(n, host)
        vocab = min(self.vocab_size, out.shape[-1])
        covered = min(words * 32, vocab)
        if len(rows) == n:  # rows 0 .. n-1 (unique): the first n logits rows
            target, idx = out[:n], None
            if covered < vocab:
                target[:, covered:vocab] = float("-inf")
        else:
            idx = self._indices(rows)
            if not isinstance(idx, torch.Tensor):  # (the CPU, under Triton's interpreter)
                idx = torch.tensor(idx, dtype=torch.int32)
            if covered < vocab:
                out[:, covered:vocab].index_fill_(0, idx.long(), float("-inf"))
        kernel, programs = self._direct
        block = 4096  # (xgrammar's own choices)
        warps = block // 32 // max(1, 16 // out.element_size())
        kernel[(programs,)](target if idx is None else out, dev, idx, len(rows), covered,
                            out.stride(0), words, programs, block, num_warps=warps, num_stages=3)
        return out

    def _device_words(self, n: int, host: torch.Tensor) -> torch.Tensor:
        """The host rows ``0 .. n-1`` copied as they are (one contiguous, non-blocking copy)
        into the front of the device buffer: [n, host words] int32."""
        views = self._views.get(n)
        if views is None or views[1]._base is not host:
            words = host.shape[1]
            # (kept by row count, at most max_rows pairs: each torch call here lets the event
            # loop take the GIL, and a late step waits for it back: one call a step, not five)
            views = self._views[n] = (self.dev.view(-1)[: n * words].view(n, words), host[:n])
        views[0].copy_(views[1], non_blocking=True)
        return views[0]

    def grammar_rows(self, filling: "Filling") -> Optional[GrammarRows]:
        """The rows of ``filling`` (waiting for it) on the device, for the sampler to read in
        its pass over the logits (``fused_sample.sample``'s ``mask``) instead of a pass of
        their own that writes -inf into them: logits row r takes host row r. None: no row."""
        rows = filling.rows()
        if not rows:
            return None
        n = max(rows) + 1
        words = self._device_words(n, self.host)
        if len(rows) == n:  # rows 0 .. n-1 (unique): every row below n
            return GrammarRows(words, None)
        flags = torch.zeros(n, dtype=torch.int8, pin_memory=self.device.type == "cuda")
        flags[rows] = 1
        return GrammarRows(words, flags.to(self.device, non_blocking=True))

    def _packed(self) -> bool:
        """Whether the device rows are packed (``grammar_vocab`` ids a row, at the front of
        ``dev``): where xgrammar's kernel is launched directly. Otherwise its public function
        masks full-width rows whose words past the host's must stay zero (the padding ids
        refused), so nothing may pack rows into ``dev`` -- :meth:`grammar_rows` neither."""
        if self._direct is None:  # (xgrammar imported here, not at the runner's start)
            self._direct = direct_kernel(self.device) if self._switches.triton else (None, 0)
        return self._direct[0] is not None

    @property
    def fusable(self) -> bool:
        """Whether :meth:`grammar_rows` can stand for :meth:`mask` before the one-pass sampler:
        a device the sampler runs on, and packed device rows (:meth:`_packed`; a step that
        cannot be fused then masks through the same layout)."""
        return (self._switches.fused and fused_sample.usable_on(self.device)
                and self._packed())

    def allows(self, rows: Sequence[int], tokens: Sequence[int]) -> list[bool]:
        """Whether each token is allowed by its host row as last filled (the mask its step was
        sampled with, until the next :meth:`fill`): one vectorized read of the rows' words."""
        if not rows:
            return []
        return self._allowed(rows, tokens).tolist()

    def _allowed(self, rows: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        host = self.host.numpy()
        tok = np.asarray(tokens, dtype=np.int64)
        inside = (tok >= 0) & (tok < self.grammar_vocab)
        safe = tok if inside.all() else np.where(inside, tok, 0)  # (sampled: usually inside)
        words = host[np.asarray(rows, dtype=np.int64), safe >> 5]
        return inside & ((words >> (safe & 31)) & 1).astype(bool)

    def _indices(self, rows: list[int]):
        """``rows`` for xgrammar's kernel: on CUDA a device tensor copied from pinned memory
        (given a list, xgrammar copies it from pageable memory, which waits for the device
        to drain the stream)."""
        if self.device.type != "cuda":
            return rows
        idx = torch.tensor(rows, dtype=torch.int32).pin_memory()
        return idx.to(self.device, non_blocking=True)

    def _fill(self, live: list[tuple], host: torch.Tensor,
              started: Optional[threading.Event] = None) -> list[int]:
        if started is not None:
            started.set()
        rows = [row for _, row, _ in live]
        if len(live) == 1 or self.budget.row_by_row("fill"):  # (each row timed: budget.py)
            self.budget.fill_rows(live, host)
        else:  # the rows of the matchers' current states, filled on xgrammar's threads
            n = self._threads
            batch = self._batch_matcher(n)
            t0, c0 = time.perf_counter(), time.thread_time()
            batch.batch_fill_next_token_bitmask([m for m, _, _ in live], host, rows)
            # the work: on one thread xgrammar fills on this one, whose CPU time leaves out
            # waits for the GIL after the call (a helper thread beside the step thread's Python)
            work = time.thread_time() - c0 if n == 1 else (time.perf_counter() - t0) * n
            self._threads = threads_for(work, fill_threads())
            self.budget.batch(work, "fill")
        for matcher, row, drafts in live:
            if drafts:
                rows.extend(self._fill_drafts(matcher, row, drafts))
        return rows

    def _fill_drafts(self, matcher, row: int, drafts: Sequence[int]) -> list[int]:
        """``row`` is filled: fill one row per draft the grammar takes after it; the matcher
        ends where it started. Returns the rows filled."""
        filled = []
        taken = 0
        for tok in drafts:
            # the row just filled says whether the grammar takes this draft (asking the
            # matcher about a refused token costs more, and xgrammar logs each refusal)
            word = int(self.host[row + taken, tok >> 5]) if 0 <= tok < self.grammar_vocab else 0
            if not (word >> (tok & 31)) & 1 or not matcher.accept_token(tok):
                break
            taken += 1
            if matcher.is_terminated():
                break  # an EOS draft: what follows it is dropped if it is accepted
            matcher.fill_next_token_bitmask(self.host, row + taken)
            filled.append(row + taken)
        if taken:
            matcher.rollback(taken)
        return filled

    def offload(self, pin: bool) -> int:  # pragma: no cover - sleep releases it instead
        raise RuntimeError("the token bitmask is released at sleep, not offloaded")

    def close(self) -> None:
        """Give both buffers back (the owner's one release path calls this)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._worker:
            self._worker.close()
        self._worker = None
        self._batch = {}
        self._views = {}  # (views keep their storage: dropped before the buffers go)
        with torch.no_grad():
            self.dev.set_()
            if self._host is not None:
                self._host.set_()


__all__ = ["TokenBitmask", "Filling", "GrammarJob"]

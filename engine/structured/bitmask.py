"""``TokenBitmask``: the runner's one token-bitmask buffer (a device resource, owned by the
runner's :class:`engine.owner.DeviceOwner` and released with it) and the per-step masking.

Each step, every constrained row's matcher fills its row of the host bitmask (xgrammar's
``fill_next_token_bitmask``, CPU). A request with draft tokens (speculative decoding) has one row
per draft position: its matcher fills the first row, takes draft 1, fills the next, ... and is
rolled back to where it was; at the first draft the grammar refuses it stops (that row's mask
refuses the draft, so verification rejects it there; the rows after it are never used). On CUDA
the filled rows are copied to the device buffer in one transfer; then ``apply_token_bitmask_inplace`` sets the disallowed logits to -inf on the logits'
device (xgrammar's own kernels: Triton on CUDA, its C++ path on CPU), once for the whole batch,
before sampling -- so greedy, temperature, top-k/top-p and seeds all sample from the allowed set.
Rows without a constraint are left untouched (``indices``). The rows of the matchers' current
states are filled together on xgrammar's own threads (``BatchGrammarMatcher``). The logits are
copied first only when the step reports logprobs (they are those of the raw distribution).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch


def _fill_threads() -> int:
    """Threads xgrammar may use to fill a batch's rows: the CPUs this process may use, less
    one (the step's own thread), at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n - 1))


class TokenBitmask:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        words = -(-vocab_size // 32)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.host = torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=cuda)
        self.dev = torch.full((max_rows, words), -1, dtype=torch.int32, device=self.device) \
            if cuda else self.host
        self._batch = None  # xgrammar's BatchGrammarMatcher (host threads), made on first use

    @property
    def max_rows(self) -> int:
        return self.host.shape[0]

    def apply(self, logits: torch.Tensor, entries: Sequence[tuple], copy: bool = True
              ) -> torch.Tensor:
        """Mask ``logits`` [N, V] for ``entries``: ``(matcher, first row, drafts)`` per
        constrained request (its rows are ``first row .. first row + len(drafts)``). Returns
        ``logits`` masked in place, or with ``copy`` a masked copy (the raw logits kept for
        logprobs); ``logits`` itself when nothing is constrained."""
        live = [e for e in entries if not e[0].is_terminated()]
        for _, row, drafts in live:
            if row + len(drafts) >= self.max_rows:
                raise RuntimeError(f"sampled row {row + len(drafts)}; the bitmask has "
                                   f"{self.max_rows}")
        if not live:
            return logits
        rows = [row for _, row, _ in live]
        if len(live) == 1:
            live[0][0].fill_next_token_bitmask(self.host, rows[0])
        else:  # the rows of the matchers' current states, filled on xgrammar's threads
            if self._batch is None:
                from xgrammar import BatchGrammarMatcher

                self._batch = BatchGrammarMatcher(max_threads=_fill_threads())
            self._batch.batch_fill_next_token_bitmask([m for m, _, _ in live], self.host, rows)
        for matcher, row, drafts in live:
            if drafts:
                rows.extend(self._fill_drafts(matcher, row, drafts))
        from xgrammar import apply_token_bitmask_inplace

        n = max(rows) + 1
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        out = logits.clone() if copy else logits
        apply_token_bitmask_inplace(out, self.dev[:n], vocab_size=min(self.vocab_size,
                                                                       out.shape[-1]),
                                    indices=rows)
        return out

    def _fill_drafts(self, matcher, row: int, drafts: Sequence[int]) -> list[int]:
        """``row`` is filled: fill one row per draft the grammar takes after it; the matcher
        ends where it started. Returns the rows filled."""
        filled = []
        taken = 0
        for tok in drafts:
            # the row just filled says whether the grammar takes this draft (asking the
            # matcher about a refused token costs more, and xgrammar logs each refusal)
            word = int(self.host[row + taken, tok >> 5]) if 0 <= tok < self.vocab_size else 0
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
        self._batch = None
        with torch.no_grad():
            if self.dev is not self.host:
                self.dev.set_()
            self.host.set_()


__all__ = ["TokenBitmask"]

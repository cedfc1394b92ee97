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
Rows without a constraint are left untouched (``indices``).
"""

from __future__ import annotations

from typing import Sequence

import torch


class TokenBitmask:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        words = -(-vocab_size // 32)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.host = torch.full((max_rows, words), -1, dtype=torch.int32, pin_memory=cuda)
        self.dev = torch.full((max_rows, words), -1, dtype=torch.int32, device=self.device) \
            if cuda else self.host

    @property
    def max_rows(self) -> int:
        return self.host.shape[0]

    def apply(self, logits: torch.Tensor, entries: Sequence[tuple]) -> torch.Tensor:
        """Mask ``logits`` [N, V] for ``entries``: ``(matcher, first row, drafts)`` per
        constrained request (its rows are ``first row .. first row + len(drafts)``); returns a
        masked copy (the raw logits stay for logprobs), or ``logits`` when nothing is
        constrained."""
        rows: list[int] = []
        for matcher, row, drafts in entries:
            if row + len(drafts) >= self.max_rows:
                raise RuntimeError(f"sampled row {row + len(drafts)}; the bitmask has "
                                   f"{self.max_rows}")
            rows.extend(self._fill(matcher, row, drafts))
        if not rows:
            return logits
        from xgrammar import apply_token_bitmask_inplace

        n = max(rows) + 1
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        out = logits.clone()
        apply_token_bitmask_inplace(out, self.dev[:n], vocab_size=min(self.vocab_size,
                                                                       out.shape[-1]),
                                    indices=rows)
        return out

    def _fill(self, matcher, row: int, drafts: Sequence[int]) -> list[int]:
        """Fill ``row`` and one row per draft the grammar takes; the matcher ends where it
        started. Returns the rows filled."""
        if matcher.is_terminated():
            return []
        matcher.fill_next_token_bitmask(self.host, row)
        filled = [row]
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
        with torch.no_grad():
            if self.dev is not self.host:
                self.dev.set_()
            self.host.set_()


__all__ = ["TokenBitmask"]

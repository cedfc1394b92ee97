"""N-gram (prompt lookup) proposer: the tokens that followed the most recent earlier occurrence
of the request's last n tokens, for n from ``ngram_max`` down to ``ngram_min``. When fewer than
k tokens follow that occurrence (it is recent: the text repeats with a short period), the repeat
is continued, so a loop of period p < k still gets k proposals.

Per request the tokens are mirrored in a growable int32 array (4 bytes a token, extended with
the new tokens each step). A lookup is one vectorized comparison with the last token over the
whole history, then the few candidate positions are extended backwards to ``ngram_max``. Host
memory only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.request import Request

from .base import Speculator


def _follow(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """``k`` tokens from ``start`` on; past the end the repeat goes on (the tokens from the
    match to the end are a period of the sequence), so a recent match still proposes k."""
    out = list(tokens[start:start + k])
    period = len(tokens) - start
    while len(out) < k and period > 0:
        out.append(out[len(out) - period] if len(out) >= period else tokens[start + len(out)])
    return out


def ngram_lookup(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Reference implementation (a linear scan): the ``k`` tokens that followed the most recent
    earlier occurrence of the last n tokens, longest n first (continuing the repeat when fewer
    than k tokens follow it)."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = list(tokens[size - n:])
        for i in range(size - n - 1, -1, -1):
            if list(tokens[i:i + n]) == pattern:
                return _follow(tokens, i + n, k)
    return []


class _History:
    __slots__ = ("buf", "size")

    def __init__(self):
        self.buf = np.empty(64, dtype=np.int32)
        self.size = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        if n < self.size:  # cannot happen (tokens only grow); start over to be safe
            self.size = 0
        if n > self.buf.shape[0]:
            grown = np.empty(max(n, 2 * self.buf.shape[0]), dtype=np.int32)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        if n > self.size:
            self.buf[self.size:n] = tokens[self.size:n]
            self.size = n
        return self.buf[:n]


def lookup_array(toks: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """:func:`ngram_lookup` on an int array, vectorized."""
    size = toks.shape[0]
    if size < n_min + 1:
        return []
    ends = np.flatnonzero(toks[: size - 1] == toks[size - 1])  # occurrence ends, a follower after
    if ends.size == 0:
        return []
    match = np.ones(ends.shape[0], dtype=np.int64)  # matched length (backwards), up to n_max
    ok = np.ones(ends.shape[0], dtype=bool)
    for j in range(1, min(n_max, size - 1)):
        back = ends - j
        valid = back >= 0
        ok &= valid
        ok[valid] &= toks[back[valid]] == toks[size - 1 - j]
        if not ok.any():
            break
        match += ok
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        hit = np.flatnonzero(match >= n)
        if hit.size:
            e = int(ends[hit[-1]])
            if e + 1 + k <= size:
                return toks[e + 1:e + 1 + k].tolist()
            return _follow(toks[e + 1:].tolist(), 0, k)
    return []


class NgramSpeculator(Speculator):
    name = "ngram"

    def __init__(self, config, runner):
        super().__init__(config, runner)
        self.n_min, self.n_max = config.ngram_min, config.ngram_max
        self._hist: dict[str, _History] = {}

    def lookup(self, req: Request, k: int) -> list[int]:
        h = self._hist.get(req.request_id)
        if h is None:
            h = self._hist[req.request_id] = _History()
        return lookup_array(h.sync(req.token_ids), k, self.n_min, self.n_max)

    def _propose(self, running, want) -> None:
        for req, n in want:
            req.spec_token_ids = self.lookup(req, n)

    def forget(self, request_id: str) -> None:
        self._hist.pop(request_id, None)

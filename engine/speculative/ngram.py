"""N-gram (prompt lookup) proposer: the tokens that followed the most recent earlier occurrence
of the request's last n tokens, for n from ``ngram_max`` down to ``ngram_min``.

Per request an index maps each n-gram to the latest position it started at (only occurrences
followed by at least one token count); it is extended with the new tokens each step, so a
lookup costs O(k) however long the request is. Host memory only.
"""

from __future__ import annotations

from typing import Sequence

from ..request import Request
from .base import Speculator


def ngram_lookup(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Reference implementation (a linear scan): up to ``k`` tokens that followed the most
    recent earlier occurrence of the last n tokens, longest n first."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = list(tokens[size - n:])
        for i in range(size - n - 1, -1, -1):
            if list(tokens[i:i + n]) == pattern:
                return list(tokens[i + n:i + n + k])
    return []


class _Index:
    __slots__ = ("last", "upto")

    def __init__(self, n_min: int, n_max: int):
        self.last: dict[int, dict[tuple, int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.upto = 0  # tokens[:upto] indexed (as followers-capable positions)


class NgramSpeculator(Speculator):
    name = "ngram"

    def __init__(self, config, runner):
        super().__init__(config, runner)
        self.n_min, self.n_max = config.ngram_min, config.ngram_max
        self._index: dict[str, _Index] = {}

    def lookup(self, req: Request, k: int) -> list[int]:
        toks = req.token_ids
        size = len(toks)
        idx = self._index.get(req.request_id)
        if idx is None or idx.upto > size:
            idx = self._index[req.request_id] = _Index(self.n_min, self.n_max)
        # an n-gram starting at i qualifies once a token follows it: i + n <= size - 1
        for n, table in idx.last.items():
            for i in range(max(0, idx.upto - n), size - n):
                table[tuple(toks[i:i + n])] = i
        idx.upto = size
        for n in range(self.n_max, self.n_min - 1, -1):
            if n >= size:
                continue
            i = idx.last[n].get(tuple(toks[size - n:]))
            if i is not None:
                return toks[i + n:i + n + k]
        return []

    def _propose(self, running, want) -> None:
        for req, n in want:
            req.spec_token_ids = self.lookup(req, n)

    def forget(self, request_id: str) -> None:
        self._index.pop(request_id, None)

"""Speculative decoding: cheap proposers guess up to ``k`` tokens; the target verifies them in
one forward and keeps the longest acceptable prefix plus one token of its own.

* ``ngram``: prompt lookup in the request's own tokens (host only, no device memory).
* ``draft``: a smaller model with the same vocabulary and its own paged KV cache; its device
  memory is one resource adopted by the runner's owner under the name ``"speculator"``.

Verification (:meth:`Speculator.verify`) is exact for greedy requests (the output equals plain
greedy decoding) and preserves the target distribution for sampled ones (the standard
accept/reject rule of speculative sampling).
"""

from __future__ import annotations

from .base import SpecStats, Speculator, verify_tokens
from .draft import DraftResources, DraftSpeculator
from .ngram import NgramSpeculator, ngram_lookup


def build_speculator(config, runner) -> Speculator:
    """The speculator ``config.speculator`` names, bound (weakly) to ``runner``."""
    if config.speculator == "ngram":
        return NgramSpeculator(config, runner)
    if config.speculator == "draft":
        return DraftSpeculator(config, runner)
    raise ValueError(f"unknown speculator {config.speculator!r}")


__all__ = ["build_speculator", "Speculator", "SpecStats", "NgramSpeculator", "DraftSpeculator",
           "DraftResources", "ngram_lookup", "verify_tokens"]

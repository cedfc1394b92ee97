"""A request's grammar matcher: made from its compiled grammar when the request enters the
engine core, owned by the :class:`engine.request.Request` (dropped with it), advanced by the
core's update with each token the request keeps."""

from __future__ import annotations

import functools
from typing import Optional, Sequence

from .gil import keep_gil_on_step_calls


def new_matcher(compiled):
    import xgrammar as xgr

    keep_gil_on_step_calls()  # its calls are made on the step thread (engine/structured/gil.py)
    return xgr.GrammarMatcher(compiled)


Verdict = tuple[Optional[str], Optional[str]]
_GO_ON: Verdict = (None, None)
_STOP: Verdict = ("stop", None)


def _dead_end(token: int) -> Verdict:
    return "error", f"structured output: token {token} is not allowed by the grammar (dead end)"


def advance(matcher, token: int) -> Verdict:
    """Feed ``token`` to ``matcher``: ``(None, None)`` to go on, ``("stop", None)`` when the
    grammar is complete (the EOS token ended it), ``("error", reason)`` on a dead end (a token
    the grammar does not allow: the request ends, the engine serves on)."""
    if not matcher.accept_token(token):
        return _dead_end(token)
    return _STOP if matcher.is_terminated() else _GO_ON


def advance_all(matchers: Sequence, tokens: Sequence[int],
                allowed: Optional[Sequence[bool]] = None) -> list[Verdict]:
    """:func:`advance` of each matcher with its token, asking ``is_terminated`` only after a
    stop token: a matcher (made without ``terminate_without_stop_token``) ends only by taking
    one of its stop tokens.

    ``allowed``: whether each token is in its matcher's mask of this state (the host row its
    step was masked with: :meth:`engine.structured.bitmask.TokenBitmask.allows`). xgrammar's
    mask is exactly the set of tokens ``accept_token`` takes, so when every token is in its
    mask, all are fed in one batch call whose result is not read back (256 matchers: 0.07 ms,
    against 0.19 for one ``accept_token`` call each and 0.19 for the public batch call, which
    reads its result back one element at a time). Otherwise (a dead end: a token the mask
    refused, e.g. a row whose mask allowed nothing) each matcher is fed and asked on its own."""
    if not matchers:
        return []
    if allowed is not None and all(allowed):
        return verdicts_of(matchers, accept_allowed(matchers, tokens))
    stops = frozenset(matchers[0].stop_token_ids)  # one tokenizer's: every grammar's the same
    out: list[Verdict] = []
    for m, t in zip(matchers, tokens):
        if not m.accept_token(t):
            out.append(_dead_end(t))
        elif t in stops and m.is_terminated():
            out.append(_STOP)
        else:
            out.append(_GO_ON)
    return out


def accept_allowed(matchers: Sequence, tokens: Sequence[int]) -> set[int]:
    """Feed each matcher its token, every one known to be in its matcher's mask (the batch
    path of :func:`advance_all`); the ids of the matchers that took a stop token and ended."""
    if not matchers:
        return set()
    _accept_unread(matchers, tokens)
    stops = frozenset(matchers[0].stop_token_ids)  # one tokenizer's: every grammar's the same
    return {id(m) for m, t in zip(matchers, tokens) if t in stops and m.is_terminated()}


class _AllGoOn:
    """Verdicts by entry (``.get(k)``, as a dict of them) of a step none of whose fed matchers
    ended: every one goes on. Only for a step whose every entry with a matcher was fed
    (entries without one ignore their verdict)."""

    __slots__ = ()

    @staticmethod
    def get(_k: int) -> Verdict:
        return _GO_ON


ALL_GO_ON = _AllGoOn()


def verdicts_of(matchers: Sequence, ended: set[int]) -> list[Verdict]:
    """The verdicts of :func:`accept_allowed`'s matchers: complete (``ended``) or go on."""
    return [_STOP if id(m) in ended else _GO_ON for m in matchers]


def _accept_unread(matchers: Sequence, tokens: Sequence[int]) -> None:
    """Feed each matcher its token in one xgrammar call, its result not read back (the caller
    knows every token is allowed). Written against xgrammar 0.2's own binding (pinned in
    pyproject.toml): its public ``BatchGrammarMatcher.batch_accept_token`` converts the result
    element by element, which costs more than the accepts; on another layout, one call each."""
    raw = _raw_batch_accept()
    if raw is None:
        for m, t in zip(matchers, tokens):
            m.accept_token(t)
        return
    raw([m._handle for m in matchers], list(tokens), False)


@functools.cache
def _raw_batch_accept():
    try:
        from xgrammar.matcher import _core

        fn = _core.BatchGrammarMatcher.batch_accept_token
    except (ImportError, AttributeError):  # pragma: no cover - another xgrammar layout
        return None
    return fn


__all__ = ["new_matcher", "advance", "advance_all", "accept_allowed", "verdicts_of"]

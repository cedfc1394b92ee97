"""A request's grammar matcher: made from its compiled grammar when the request enters the
engine core, owned by the :class:`engine.request.Request` (dropped with it), advanced by the
core's update with each token the request keeps."""

from __future__ import annotations

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


def advance_all(matchers: Sequence, tokens: Sequence[int]) -> list[Verdict]:
    """:func:`advance` of each matcher with its token, asking ``is_terminated`` only after a
    stop token: a matcher (made without ``terminate_without_stop_token``) ends only by taking
    one of its stop tokens. A step's 256 verdicts thus cost one xgrammar call per matcher
    instead of two, and no read-back of a batch result element by element (measured with
    256 matchers: 0.19 ms against 0.31 for ``batch_accept_token`` plus the checks)."""
    if not matchers:
        return []
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


__all__ = ["new_matcher", "advance", "advance_all"]

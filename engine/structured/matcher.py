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
    """:func:`advance` of each matcher with its token, the tokens taken in one xgrammar call
    (``batch_accept_token``) instead of one call per matcher."""
    if len(matchers) < 2:
        return [advance(m, t) for m, t in zip(matchers, tokens)]
    from xgrammar import BatchGrammarMatcher

    taken = BatchGrammarMatcher.batch_accept_token(list(matchers), list(tokens))
    return [(_STOP if m.is_terminated() else _GO_ON) if ok else _dead_end(t)
            for m, t, ok in zip(matchers, tokens, taken)]


__all__ = ["new_matcher", "advance", "advance_all"]

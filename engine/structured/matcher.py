"""A request's grammar matcher: made from its compiled grammar when the request enters the
engine core, owned by the :class:`engine.request.Request` (dropped with it), advanced by the
core's update with each token the request keeps."""

from __future__ import annotations

from typing import Optional


def new_matcher(compiled):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def advance(matcher, token: int) -> tuple[Optional[str], Optional[str]]:
    """Feed ``token`` to ``matcher``: ``(None, None)`` to go on, ``("stop", None)`` when the
    grammar is complete (the EOS token ended it), ``("error", reason)`` on a dead end (a token
    the grammar does not allow: the request ends, the engine serves on)."""
    if not matcher.accept_token(token):
        return "error", (f"structured output: token {token} is not allowed by the grammar "
                         f"(dead end)")
    if matcher.is_terminated():
        return "stop", None
    return None, None


__all__ = ["new_matcher", "advance"]

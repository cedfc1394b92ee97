"""``HttpLimits``: what one HTTP frontend process lets a stranger cost it, and its flags.

Every limit is enforced before the expensive step it protects (see README, "Limits"):

* connections: ``max_connections`` open at once; beyond it a connection's request is answered
  503 (OpenAI-shaped) and closed; beyond twice it, or near the process's file-descriptor limit,
  a connection is closed at once (``server.py``);
* the request head must be complete within ``header_timeout`` seconds of the connection opening
  (or of the previous response, on a kept-alive connection), else the connection is closed;
  an idle kept-alive connection is closed after ``keep_alive_timeout`` seconds;
* the body: at most ``max_body_bytes`` (413 from the ``Content-Length`` header, or as soon as the
  bytes received pass it), complete within ``body_timeout`` seconds (408) (``guards.py``);
* requests in flight (``/v1/completions`` and ``/v1/chat/completions``, streaming or not):
  ``max_requests_in_flight``; beyond it 429 with ``Retry-After``;
* a prompt's size in characters (text prompt, or the sum of the chat messages' contents):
  ``max_prompt_chars`` (0: ``max_model_len`` x :data:`CHARS_PER_TOKEN_BOUND`), checked before it
  is rendered or tokenized.
"""

from __future__ import annotations

import argparse
from typing import Optional

import msgspec

#: No token of any vocabulary we serve is longer than this many characters, so a prompt of more
#: than ``max_model_len`` x this cannot fit the context (the engine's own bound is tighter).
CHARS_PER_TOKEN_BOUND = 64
#: Bodies up to this size are parsed on the event loop (well under a millisecond).
INLINE_PARSE_BYTES = 64 * 1024


class HttpLimits(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    max_body_bytes: int = 8 * 2**20
    max_prompt_chars: int = 0
    max_requests_in_flight: int = 1024
    max_connections: int = 2048
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0

    def validate(self) -> "HttpLimits":
        for name in ("max_body_bytes", "max_requests_in_flight", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_prompt_chars < 0:
            raise ValueError("--max-prompt-chars must be >= 0 (0: from the context length)")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not (0 < getattr(self, name) <= 3600):
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 3600] seconds")
        return self

    def prompt_chars(self, max_model_len: Optional[int]) -> int:
        """The effective prompt limit in characters."""
        if self.max_prompt_chars:
            return self.max_prompt_chars
        return (max_model_len or 4096) * CHARS_PER_TOKEN_BOUND

    def to_argv(self) -> list[str]:
        """The flags that give a frontend process these limits."""
        out = []
        for name in self.__struct_fields__:
            out += [f"--{name.replace('_', '-')}", str(getattr(self, name))]
        return out


_HELP = {
    "max_body_bytes": "largest request body accepted (413 beyond; default 8 MiB)",
    "max_prompt_chars": "largest prompt in characters, checked before tokenizing "
                        f"(0: max_model_len x {CHARS_PER_TOKEN_BOUND})",
    "max_requests_in_flight": "generation requests open at once per API server (429 beyond)",
    "max_connections": "open HTTP connections per API server (503 beyond)",
    "header_timeout": "seconds a client has to send a request's head (then closed)",
    "body_timeout": "seconds a client has to send a request's body (408 beyond)",
    "keep_alive_timeout": "seconds an idle kept-alive connection stays open",
}


def add_http_limit_args(p: argparse.ArgumentParser) -> None:
    defaults = HttpLimits()
    for name in HttpLimits.__struct_fields__:
        value = getattr(defaults, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value,
                       metavar="N" if isinstance(value, int) else "SECONDS", help=_HELP[name])


def limits_from_args(a: argparse.Namespace) -> HttpLimits:
    """``HttpLimits`` from the flags of :func:`add_http_limit_args` (``ValueError`` if bad)."""
    return HttpLimits(**{name: getattr(a, name) for name in HttpLimits.__struct_fields__}).validate()


__all__ = ["HttpLimits", "add_http_limit_args", "limits_from_args", "CHARS_PER_TOKEN_BOUND",
           "INLINE_PARSE_BYTES"]

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
* large bodies (over ``large_body_bytes``, by ``Content-Length`` or as a chunked one grows):
  at most ``large_body_slots`` received and parsed at once, their CPU paced to
  ``large_body_cpu_share`` of one core; a connection waiting for a slot reads nothing (TCP
  pushes back on its sender), for at most ``body_timeout`` seconds (then 503 and closed); small
  requests never wait (``body_gate.py``);
* requests in flight (``/v1/completions`` and ``/v1/chat/completions``, streaming or not):
  ``max_requests_in_flight``; beyond it 429 with ``Retry-After``;
* a prompt's size in characters (text prompt, or the sum of the chat messages' contents):
  ``max_prompt_chars`` (0: ``max_model_len`` x :data:`CHARS_PER_TOKEN_BOUND`), checked before it
  is rendered or tokenized.

And the cross-origin policy (CORS), off unless ``allowed_origins`` is set: without it no response
carries an ``Access-Control-*`` header and no preflight is granted, so a web page of another
origin cannot read an answer nor send what needs a preflight (a JSON body, an ``Authorization``
header). The flags are vLLM's (``--allowed-origins '["https://ui.example"]'``, also
comma-separated), but vLLM allows every origin by default. ``--allow-credentials`` with ``*``
is refused: it would grant every site a credentialed request.

And the ``Host`` names served (``allowed_hosts``, against DNS rebinding; ``hosts.py``): when bound
to a loopback address, or when given, a request naming another host gets 400.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Optional

import msgspec

#: No token of any vocabulary we serve is longer than this many characters, so a prompt of more
#: than ``max_model_len`` x this cannot fit the context (the engine's own bound is tighter).
CHARS_PER_TOKEN_BOUND = 64
#: Bodies up to this size are parsed on the event loop (well under a millisecond).
INLINE_PARSE_BYTES = 64 * 1024
#: ``--http-impl``: auto (httptools, with uvloop, when importable; else h11), or one forced.
HTTP_IMPLS = ("auto", "h11", "httptools")


class HttpLimits(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    max_body_bytes: int = 8 * 2**20
    max_prompt_chars: int = 0
    max_requests_in_flight: int = 1024
    max_connections: int = 2048
    large_body_bytes: int = 256 * 1024
    large_body_slots: int = 2
    large_body_cpu_share: float = 0.2
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    allowed_origins: tuple[str, ...] = ()  # empty: CORS off
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_hosts: tuple[str, ...] = ()  # empty: loopback names when bound to loopback, else any
    http_impl: str = "auto"  # one of HTTP_IMPLS: the HTTP/1.1 parser (server.py)

    def validate(self) -> "HttpLimits":
        for name in ("max_body_bytes", "max_requests_in_flight", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.large_body_bytes < 0 or self.large_body_slots < 1:
            raise ValueError("--large-body-bytes must be >= 0 and --large-body-slots >= 1")
        if not (0 < self.large_body_cpu_share <= 1):
            raise ValueError("--large-body-cpu-share must be in (0, 1] (of one core)")
        if self.max_prompt_chars < 0:
            raise ValueError("--max-prompt-chars must be >= 0 (0: from the context length)")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            if not (0 < getattr(self, name) <= 3600):
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 3600] seconds")
        self._validate_impl()
        self._validate_cors()
        from .hosts import check_allowed_host

        for host in self.allowed_hosts:
            check_allowed_host(host)  # ValueError naming it
        return self

    def _validate_impl(self) -> None:
        if self.http_impl not in HTTP_IMPLS:
            raise ValueError(f"--http-impl must be one of {', '.join(HTTP_IMPLS)}")
        if self.http_impl == "httptools":
            import importlib.util

            if importlib.util.find_spec("httptools") is None:
                raise ValueError("--http-impl httptools: the httptools package is not installed "
                                 "(auto falls back to h11)")

    def _validate_cors(self) -> None:
        for origin in self.allowed_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin (scheme://host"
                                 "[:port] in lower case, no path, as a browser's Origin header "
                                 "has it; or *)")
        for name, token in (("allowed_methods", _METHOD), ("allowed_headers", _HEADER)):
            for value in getattr(self, name):
                if value != "*" and not token.fullmatch(value):
                    raise ValueError(f"--{name.replace('_', '-')}: {value!r} is not a valid name")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("--allow-credentials with --allowed-origins '*' would let every web "
                             "site send credentialed requests: name the origins")

    @property
    def cors(self) -> bool:
        """Whether a CORS policy is on (some origin allowed)."""
        return bool(self.allowed_origins)

    def prompt_chars(self, max_model_len: Optional[int]) -> int:
        """The effective prompt limit in characters."""
        if self.max_prompt_chars:
            return self.max_prompt_chars
        return (max_model_len or 4096) * CHARS_PER_TOKEN_BOUND

    def to_argv(self) -> list[str]:
        """The flags that give a frontend process these limits."""
        out = []
        for name in self.__struct_fields__:
            flag, value = f"--{name.replace('_', '-')}", getattr(self, name)
            if isinstance(value, bool):
                out += [flag] if value else []
            elif isinstance(value, tuple):
                out += [flag, json.dumps(list(value))]
            else:
                out += [flag, str(value)]
        return out


#: A serialized origin, as a browser's Origin header holds it: lower case, no path, no trailing
#: slash (the header is compared as a string). "null" (sandboxed frames, file: pages: any site
#: can make one) is not an origin one may allow.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(:[0-9]{1,5})?")
_METHOD = re.compile(r"[A-Za-z]{1,32}")
_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}")


def name_list(text: str) -> tuple[str, ...]:
    """A list flag's value: a JSON list of strings, as vLLM takes it, or comma-separated names."""
    text = text.strip()
    if text.startswith("["):
        try:
            got = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not all(isinstance(v, str) for v in got):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return tuple(v.strip() for v in got)
    return tuple(v.strip() for v in text.split(",") if v.strip())


_HELP = {
    "max_body_bytes": "largest request body accepted (413 beyond; default 8 MiB)",
    "max_prompt_chars": "largest prompt in characters, checked before tokenizing "
                        f"(0: max_model_len x {CHARS_PER_TOKEN_BOUND})",
    "large_body_bytes": "a body larger than this (default 256 KiB) needs a large-body slot "
                        "before it is read; waits at most --body-timeout (503 beyond)",
    "large_body_slots": "large bodies received and parsed at once per API server",
    "large_body_cpu_share": "the share of one core that large bodies' receiving and parsing may "
                            "take over time per API server (paced; default 0.2)",
    "max_requests_in_flight": "generation requests open at once per API server (429 beyond)",
    "max_connections": "open HTTP connections per API server (503 beyond)",
    "header_timeout": "seconds a client has to send a request's head (then closed)",
    "body_timeout": "seconds a client has to send a request's body (408 beyond)",
    "keep_alive_timeout": "seconds an idle kept-alive connection stays open",
    "allowed_origins": "origins a browser page may call this server from (CORS), as a JSON list "
                       "or comma-separated (e.g. https://ui.example:8443; * for any); default "
                       "none: CORS off, no Access-Control-* headers, no preflight granted",
    "allowed_methods": "with --allowed-origins: the methods a preflight grants (default *)",
    "allowed_headers": "with --allowed-origins: the request headers a preflight grants (default *)",
    "allow_credentials": "with --allowed-origins: let pages send cookies or HTTP auth (not with *)",
    "allowed_hosts": "the Host names served (against DNS rebinding), as a JSON list or "
                     "comma-separated: names, addresses, *.example.com, or * for any; loopback "
                     "names and the bound address are always served. Default: when bound to a "
                     "loopback address only those; otherwise any",
    "http_impl": "the HTTP/1.1 parser: httptools (C, with uvloop when installed), h11 (pure "
                 "Python), or auto: httptools when installed, else h11",
}


def add_http_limit_args(p: argparse.ArgumentParser) -> None:
    defaults = HttpLimits()
    for name in HttpLimits.__struct_fields__:
        flag, value = f"--{name.replace('_', '-')}", getattr(defaults, name)
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true", default=value, help=_HELP[name])
        elif isinstance(value, tuple):
            p.add_argument(flag, type=name_list, default=value, metavar="LIST", help=_HELP[name])
        elif name == "http_impl":
            p.add_argument(flag, choices=HTTP_IMPLS, default=value, help=_HELP[name])
        else:
            p.add_argument(flag, type=type(value), default=value,
                           metavar="N" if isinstance(value, int) else
                           "SHARE" if name.endswith("_share") else "SECONDS", help=_HELP[name])


def limits_from_args(a: argparse.Namespace) -> HttpLimits:
    """``HttpLimits`` from the flags of :func:`add_http_limit_args` (``ValueError`` if bad)."""
    return HttpLimits(**{name: getattr(a, name) for name in HttpLimits.__struct_fields__}).validate()


__all__ = ["HttpLimits", "add_http_limit_args", "limits_from_args", "name_list", "CHARS_PER_TOKEN_BOUND",
           "INLINE_PARSE_BYTES", "HTTP_IMPLS"]

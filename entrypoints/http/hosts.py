"""The ``Host`` header allow-list, against DNS rebinding.

A web page on ``http://evil.example`` can have its own name answer with ``127.0.0.1`` a moment
after the page loaded (DNS rebinding): its requests to ``http://evil.example:8000`` then reach a
server on this machine's loopback as same-origin requests, which no CORS policy stops, and the
page reads the answers. The one trace of it the server sees is the ``Host`` header, which still
names ``evil.example``. So when the policy is on, a request whose ``Host`` names anything but

* a loopback name or address (``localhost``, ``*.localhost``, ``127.0.0.0/8``, ``::1``),
* the address the server is bound to,
* or one of ``--allowed-hosts`` (names, addresses, ``*.example.com`` for the names under
  ``example.com``; ``*`` for any),

gets 400 ``invalid_host`` from its head alone, before its body is read. The port is not compared
(a rebinding page can use the server's port).

The policy is on when the server is bound to a loopback address (only this machine's clients,
so only names of this machine are expected) or when ``--allowed-hosts`` is given. Bound to
``0.0.0.0`` or another address without ``--allowed-hosts`` -- behind a load balancer or an
ingress, which send whatever name their clients used -- every ``Host`` is served, as vLLM
serves them. A request without ``Host`` (HTTP/1.0) passes: browsers always send one.

Why by hand: Starlette's ``TrustedHostMiddleware`` splits the header at the first ``:`` (an IPv6
literal never matches), knows no address ranges, and answers in plain text, not OpenAI's shape.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Callable, Optional, Sequence

from .errors import send_error

#: an allowed-hosts entry: a DNS name (``*.`` for the names under it), or an IP address
_NAME = re.compile(r"(\*\.)?([a-z0-9_]([a-z0-9_-]{0,62})?)(\.[a-z0-9_]([a-z0-9_-]{0,62})?)*\.?")


def _address(text: str) -> Optional[ipaddress._BaseAddress]:
    try:
        return ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None


def check_allowed_host(entry: str) -> str:
    """``entry`` of ``--allowed-hosts`` normalised (lower case, no trailing dot), or
    ``ValueError``."""
    e = entry.strip().lower()
    if e == "*":
        return e
    addr = _address(e)
    if addr is not None:
        return str(addr)
    if not _NAME.fullmatch(e) or len(e) > 253:
        raise ValueError(f"--allowed-hosts: {entry!r} is not a host name or address (no port; "
                         "*.example.com for the names under example.com, * for any)")
    return e.rstrip(".")


def host_of(header: bytes) -> Optional[str]:
    """The host a ``Host`` header value names, lower case, without its port or a trailing
    dot; an IP address in its normal form. None if the value is not a host."""
    try:
        text = header.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if text.startswith("["):  # [v6]:port
        end = text.find("]")
        if end < 0 or (text[end + 1:] and not re.fullmatch(r":[0-9]{1,5}", text[end + 1:])):
            return None
        addr = _address(text[1:end])
        return str(addr) if addr is not None and addr.version == 6 else None
    name, sep, port = text.rpartition(":")
    if not sep:
        name = text
    elif not port.isdigit() or len(port) > 5:
        return None
    addr = _address(name)
    if addr is not None:
        return str(addr)
    name = name.rstrip(".")
    return name if name and _NAME.fullmatch(name) and "*" not in name else None


def is_loopback(host: str) -> bool:
    """A name or address only this machine answers to (RFC 6761 reserves ``.localhost``)."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    addr = _address(host)
    if addr is None:
        return False
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


class HostPolicy:
    """Which ``Host`` values a server answers (module docstring); ``bound``: the address of
    its listening socket (None: not known, as for an app not served from a socket)."""

    def __init__(self, allowed: Sequence[str] = (), bound: Optional[str] = None) -> None:
        entries = [check_allowed_host(e) for e in allowed]
        self.any = "*" in entries
        self.on = not self.any and (bool(entries) or (bound is not None and is_loopback(
            str(_address(bound) or bound).lower())))
        self.names = {e for e in entries if not e.startswith("*.")}
        self.suffixes = tuple(e[1:] for e in entries if e.startswith("*."))  # ".example.com"
        addr = _address(bound) if bound else None
        if addr is not None and not addr.is_unspecified:
            self.names.add(str(addr))

    def allows(self, host: str) -> bool:
        return (not self.on or host in self.names or is_loopback(host)
                or any(host.endswith(s) for s in self.suffixes))


class HostGuard:
    """ASGI middleware: a request whose ``Host`` the policy does not allow gets 400
    ``invalid_host`` (its body left unread: the server discards it)."""

    def __init__(self, app, policy: HostPolicy, on_reject: Optional[Callable[[str], None]] = None):
        self.app = app
        self.policy = policy
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        values = [v for k, v in scope["headers"] if k == b"host"]
        if not values:  # HTTP/1.0 without Host (h11 requires one for HTTP/1.1)
            return await self.app(scope, receive, send)
        host = host_of(values[0]) if len(values) == 1 else None
        if host is not None and self.policy.allows(host):
            return await self.app(scope, receive, send)
        if self.on_reject is not None:
            self.on_reject("bad_request")
        shown = values[0][:100].decode("latin-1") if len(values) == 1 else f"{len(values)} values"
        await send_error(send, 400, f"this server does not answer to the Host {shown!r}: it "
                         "serves its loopback names and addresses, the address it is bound to and "
                         "the names of --allowed-hosts (a guard against DNS rebinding)",
                         code="invalid_host")


__all__ = ["HostPolicy", "HostGuard", "host_of", "is_loopback", "check_allowed_host"]

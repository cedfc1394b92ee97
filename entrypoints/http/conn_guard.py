"""The per-connection protections both of our uvicorn protocols share (``server.py`` picks one).

:class:`ConnectionGuard` is a mixin over a uvicorn HTTP protocol (h11's or httptools'):

* a head timer: the request head must be complete within ``header_timeout`` seconds of the
  connection opening, or of the previous response on a kept-alive connection; else the
  connection is closed (slowloris);
* a connection cap: beyond ``max_connections`` open connections, the connection's request is
  answered 503 (OpenAI-shaped) and the connection closed; beyond twice that, or within
  :data:`FD_RESERVE` descriptors of the process's limit, it is closed at once, unread -- so
  connections alone never exhaust the descriptors.

The protocol supplies ``_head_complete()`` (is a request's head in?) and
``_close_unfinished_head()`` (how to close the connection when it is not in time).
"""

from __future__ import annotations

import logging
import resource
import time
from typing import Any

from .errors import send_error
from .limits import HttpLimits

log = logging.getLogger("enginecore.http")

#: Descriptors kept free for everything but client connections (IPC socket, logs, threads).
FD_RESERVE = 64
#: The largest request head (request line and headers; with httptools also a chunked body's
#: trailers) either protocol buffers: h11's ``max_incomplete_event_size``, counted by hand for
#: httptools (``httptools_guard.py``).
MAX_HEAD_BYTES = 16 * 1024
FLOOD_INTERVAL = 10.0


async def _too_many_connections(scope, receive, send) -> None:
    await send_error(send, 503, "too many connections to this server; retry later",
                     "service_unavailable", "too_many_connections",
                     headers=((b"retry-after", b"1"),), close=True)


def fd_soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class ConnectionGuard:
    """The head timer and the connection cap (module docstring), before a uvicorn protocol in
    the bases; ``server.make_server`` subclasses the result with the server's ``limits``."""

    limits: HttpLimits = HttpLimits()
    _head_timer: Any = None
    # supplied by the uvicorn protocol
    connections: Any
    transport: Any
    loop: Any
    app: Any
    cycle: Any

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        n = len(self.connections)
        hard_cap = min(2 * self.limits.max_connections, fd_soft_limit() - FD_RESERVE)
        if n > hard_cap:
            refusals.note("closed unread")
            transport.abort()
            return
        if n > self.limits.max_connections:
            refusals.note("answered 503")
            self.app = _too_many_connections
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing() and not self._head_complete():
            self._arm()  # the next request's head is due (a pipelined one may be here already)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _head_complete(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._head_complete():
            return
        refusals.note("head timeout")
        self._close_unfinished_head()

    def _close_unfinished_head(self) -> None:
        self.transport.close()


class _Refusals:
    """Counts connection-level refusals; logs them at most once per FLOOD_INTERVAL."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._logged = 0.0

    def note(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        now = time.monotonic()
        if now - self._logged >= FLOOD_INTERVAL:
            self._logged = now
            log.warning("connections refused so far: %s", self.counts)


refusals = _Refusals()

__all__ = ["ConnectionGuard", "FD_RESERVE", "MAX_HEAD_BYTES", "FLOOD_INTERVAL", "fd_soft_limit",
           "refusals"]

"""uvicorn, hardened for strangers: the connection-level half of ``limits.py``.

uvicorn 0.55 (h11, no httptools here) has an idle keep-alive timeout but no timeout for a request
head, and its ``limit_concurrency`` answers plain-text 503s while keeping every connection open.
:class:`GuardedH11` adds, per connection:

* a head timer: the request head must be complete within ``header_timeout`` seconds of the
  connection opening, or of the previous response on a kept-alive connection; else the
  connection is closed (slowloris);
* a connection cap: beyond ``max_connections`` open connections, the connection's request is
  answered 503 (OpenAI-shaped) and the connection closed; beyond twice that, or within
  :data:`FD_RESERVE` descriptors of the process's limit, it is closed at once, unread -- so
  connections alone never exhaust the descriptors.

asyncio's accept loop (CPython 3.11) logs "socket.accept() out of system resource" once per
*pending connection* on every retry when descriptors run out (the 11.7 M-line flood);
:class:`FloodFilter` lets one such line through per :data:`FLOOD_INTERVAL` seconds with a count
of the ones it swallowed. :func:`raise_fd_limit` (the frontend process's entry point calls it)
lifts the soft descriptor limit to the hard one.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import send_error
from .limits import HttpLimits

log = logging.getLogger("enginecore.http")

#: Descriptors kept free for everything but client connections (IPC socket, logs, threads).
FD_RESERVE = 64
FLOOD_INTERVAL = 10.0
GRACEFUL_TIMEOUT = 10.0


class Server(uvicorn.Server):
    """uvicorn without its signal handlers: the engine process decides when we stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _too_many_connections(scope, receive, send) -> None:
    await send_error(send, 503, "too many connections to this server; retry later",
                     "service_unavailable", "too_many_connections",
                     headers=((b"retry-after", b"1"),), close=True)


def fd_soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit(cap: int = 1 << 16) -> int:
    """Lift this process's soft descriptor limit towards the hard one; returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return fd_soft_limit()


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the head timer and the connection cap (module docstring).
    ``make_server`` subclasses it with the server's ``limits``."""

    limits: HttpLimits = HttpLimits()
    _head_timer: Any = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        n = len(self.connections)
        hard_cap = min(2 * self.limits.max_connections, fd_soft_limit() - FD_RESERVE)
        if n > hard_cap:
            _refusals.note("closed unread")
            transport.abort()
            return
        if n > self.limits.max_connections:
            _refusals.note("answered 503")
            self.app = _too_many_connections
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_complete():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._head_complete():
            self._arm()  # the next request's head is due (a pipelined one may be here already)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

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
        _refusals.note("head timeout")
        if self.conn.our_state is not h11.ERROR:
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
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


_refusals = _Refusals()


class FloodFilter(logging.Filter):
    """Lets one record of each message template through per ``interval`` seconds; the next
    one that passes says how many were swallowed."""

    def __init__(self, interval: float = FLOOD_INTERVAL) -> None:
        super().__init__("flood")
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)[:200]
        now = time.monotonic()
        last, swallowed = self._last.get(key, (-self.interval, 0))
        if now - last < self.interval:
            self._last[key] = (last, swallowed + 1)
            return False
        if len(self._last) > 1000:  # many distinct templates: forget the old ones
            self._last.clear()
        self._last[key] = (now, 0)
        if swallowed:
            record.msg = f"{record.msg} ({swallowed} similar lines swallowed)"
        return True


def install_flood_filter() -> None:
    """Idempotent: the flood filter on asyncio's and uvicorn's error loggers."""
    for name in ("asyncio", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, FloodFilter) for f in logger.filters):
            logger.addFilter(FloodFilter())


def make_server(app, limits: HttpLimits = HttpLimits(), **kw: Any) -> Server:
    """A :class:`Server` for ``app`` with ``limits`` (``kw``: more uvicorn options)."""
    install_flood_filter()
    protocol = type("GuardedH11", (GuardedH11,), {"limits": limits})
    options = dict(log_config=None, access_log=False, lifespan="off", http=protocol,
                   timeout_graceful_shutdown=GRACEFUL_TIMEOUT, log_level="warning",
                   timeout_keep_alive=limits.keep_alive_timeout,
                   h11_max_incomplete_event_size=16 * 1024)
    options.update(kw)
    return Server(uvicorn.Config(app, **options))


__all__ = ["Server", "GuardedH11", "FloodFilter", "make_server", "raise_fd_limit",
           "install_flood_filter", "FD_RESERVE"]

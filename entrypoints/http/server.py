"""uvicorn, hardened for strangers: the connection-level half of ``limits.py``.

uvicorn 0.55 has an idle keep-alive timeout but no timeout for a request head, and its
``limit_concurrency`` answers plain-text 503s while keeping every connection open.
``conn_guard.ConnectionGuard`` adds the head timer and the connection cap to either of its HTTP
protocols: :class:`GuardedH11` (h11, pure Python) or ``httptools_guard.GuardedHttpTools``
(llhttp in C, with the head-size bound that h11 has and httptools lacks). ``--http-impl``
(``HttpLimits.http_impl``) picks one: ``auto`` (the default) takes httptools when it is
importable, else h11; the frontend process's entry point also runs uvloop under httptools
(:func:`event_loop_factory`), when it is importable.

asyncio's accept loop (CPython 3.11) logs "socket.accept() out of system resource" once per
*pending connection* on every retry when descriptors run out (the 11.7 M-line flood);
:class:`FloodFilter` lets one such line through per :data:`FLOOD_INTERVAL` seconds with a count
of the ones it swallowed. :func:`raise_fd_limit` (the frontend process's entry point calls it)
lifts the soft descriptor limit to the hard one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import resource
import time
from typing import Any, Callable, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .conn_guard import FD_RESERVE, FLOOD_INTERVAL, MAX_HEAD_BYTES, ConnectionGuard, refusals
from .limits import HttpLimits

log = logging.getLogger("enginecore.http")

GRACEFUL_TIMEOUT = 10.0


class Server(uvicorn.Server):
    """uvicorn without its signal handlers: the engine process decides when we stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def raise_fd_limit(cap: int = 1 << 16) -> int:
    """Lift this process's soft descriptor limit towards the hard one; returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def resolve_impl(impl: str) -> str:
    """``h11`` or ``httptools`` for ``--http-impl`` ``impl`` (``auto``: httptools if importable)."""
    if impl == "auto":
        return "httptools" if has_module("httptools") else "h11"
    return impl


def event_loop_factory(limits: HttpLimits) -> Optional[Callable[[], Any]]:
    """uvloop's loop factory when ``limits`` resolve to httptools and uvloop is importable, else
    None (asyncio's own loop). Only a process's entry point may choose its event loop."""
    if resolve_impl(limits.http_impl) != "httptools" or not has_module("uvloop"):
        return None
    import uvloop

    return uvloop.new_event_loop


class GuardedH11(ConnectionGuard, H11Protocol):
    """uvicorn's h11 protocol with the head timer and the connection cap (``conn_guard.py``);
    its head size is bounded by h11's ``max_incomplete_event_size`` (``make_server``)."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_complete():
            self._disarm()

    def _close_unfinished_head(self) -> None:
        if self.conn.our_state is not h11.ERROR:
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
        self.transport.close()


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


def protocol_class(limits: HttpLimits) -> type:
    """The guarded protocol ``limits.http_impl`` resolves to, carrying ``limits``."""
    if resolve_impl(limits.http_impl) == "httptools":
        from .httptools_guard import GuardedHttpTools as base
    else:
        base = GuardedH11
    return type(base.__name__, (base,), {"limits": limits})


def make_server(app, limits: HttpLimits = HttpLimits(), **kw: Any) -> Server:
    """A :class:`Server` for ``app`` with ``limits`` (``kw``: more uvicorn options)."""
    install_flood_filter()
    protocol = protocol_class(limits)
    log.info("HTTP protocol: %s", protocol.__name__)
    options = dict(log_config=None, access_log=False, lifespan="off", http=protocol,
                   timeout_graceful_shutdown=GRACEFUL_TIMEOUT, log_level="warning",
                   timeout_keep_alive=limits.keep_alive_timeout,
                   h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    options.update(kw)
    return Server(uvicorn.Config(app, **options))


__all__ = ["Server", "GuardedH11", "FloodFilter", "make_server", "raise_fd_limit",
           "install_flood_filter", "FD_RESERVE", "resolve_impl", "event_loop_factory",
           "protocol_class", "refusals"]

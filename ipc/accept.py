"""The server's accept loop: never stops on a failed ``accept``, backs off, and logs floods as
summaries.

anyio's ``Listener.serve`` ends at the first failed ``accept``; out of file descriptors
(EMFILE) that took the whole engine down, and every retry was logged. Here a failed ``accept``
-- EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED or anything else -- waits ``min_backoff``
seconds, doubling to ``max_backoff`` while it keeps failing, and tries again; only closing the
listener (or cancellation) ends the loop. :class:`SummaryLog` logs the first occurrence of a
kind of event, then at most one line per interval saying how often it happened meanwhile.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import Counter
from typing import Callable

import anyio
from anyio.abc import ByteStream, Listener
from anyio.streams.stapled import MultiListener

#: Errors that mean "no resources right now" (the listener itself is fine).
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                              errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EAGAIN})


class SummaryLog:
    """``note(key, text)``: logs the first ``key`` at once; later ones are counted and logged
    as one summary line per ``interval`` seconds ("<what> 12,345 times in the last 10 s: ...")."""

    def __init__(self, logger: logging.Logger, what: str, *, interval: float = 10.0,
                 level: int = logging.WARNING, clock=time.monotonic) -> None:
        self.logger = logger
        self.what = what
        self.interval = interval
        self.level = level
        self._clock = clock
        self._since = -float("inf")
        self._counts: Counter[str] = Counter()
        self._seen: set[str] = set()
        self.lines = 0  # lines logged (for tests and statistics)

    def note(self, key: str, text: str = "") -> None:
        now = self._clock()
        if key not in self._seen:
            self._seen.add(key)
            self._emit(f"{self.what}: {text or key}")
            self._since = now
            return
        self._counts[key] += 1
        if now - self._since >= self.interval:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        """Log the summary of what was counted since the last line (if anything)."""
        now = self._clock() if now is None else now
        if self._counts:
            parts = ", ".join(f"{k} x{n:,}" for k, n in self._counts.most_common(5))
            total = sum(self._counts.values())
            self._emit(f"{self.what} {total:,} times in the last "
                       f"{min(now - self._since, 1e6):.0f} s: {parts}")
            self._counts.clear()
        self._since = now

    def _emit(self, line: str) -> None:
        self.lines += 1
        self.logger.log(self.level, "%s", line)


def _errno_of(exc: BaseException) -> int | None:
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
    return None


def describe_accept_error(exc: BaseException) -> str:
    code = _errno_of(exc)
    if code is not None:
        return errno.errorcode.get(code, str(code))
    return type(exc).__name__


async def accept_forever(listener: Listener[ByteStream], on_accept: Callable[[ByteStream], None],
                         summary: SummaryLog, *, min_backoff: float = 0.01,
                         max_backoff: float = 1.0) -> None:
    """Call ``on_accept(stream)`` (synchronously) for every accepted connection, until the
    listener is closed or the caller cancels. A ``MultiListener`` (TCP on several families) gets
    one loop per listener."""
    if isinstance(listener, MultiListener):
        async with anyio.create_task_group() as tg:
            for sub in listener.listeners:
                tg.start_soon(_accept_one, sub, on_accept, summary, min_backoff, max_backoff)
    else:
        await _accept_one(listener, on_accept, summary, min_backoff, max_backoff)


async def _accept_one(listener, on_accept, summary: SummaryLog, min_backoff: float,
                      max_backoff: float) -> None:
    delay = 0.0
    while True:
        try:
            stream = await listener.accept()
        except anyio.ClosedResourceError:
            return
        except (OSError, anyio.BrokenResourceError) as exc:
            code = _errno_of(exc)
            name = describe_accept_error(exc)
            hint = "" if code in TRANSIENT_ERRNOS else " (unexpected)"
            summary.note(name, f"{name}{hint}: {exc.__cause__ or exc}; retrying with back-off")
            delay = min(max_backoff, delay * 2 if delay else min_backoff)
            await anyio.sleep(delay)
            continue
        delay = 0.0
        on_accept(stream)


__all__ = ["accept_forever", "SummaryLog", "TRANSIENT_ERRNOS", "describe_accept_error"]

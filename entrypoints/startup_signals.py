"""SIGTERM and SIGINT from the first line of ``enginecore`` on, before ``serve`` has its own.

SIGTERM's default action ends a process without running anything (exit -15), and the process
spends its first seconds importing torch and the engine, long before ``serve.run`` installs the
handlers that turn a signal during startup into exit 128+N. :func:`install` is the first thing
``cli.main`` does, before any heavy import, and covers that time in two phases:

* while the entry point is still importing and parsing, the handler itself says so on stderr
  and leaves at once with ``os._exit(128 + N)`` -- nothing is allocated yet, and an import that
  is cut short does not matter to a process that is leaving. (Raising an exception there
  instead reached a C++ frame of torch's import now and then, which aborted: exit -6.);
* from :func:`defer` on (``cli.main``, once the imports are done), a signal is only recorded, so
  no code that owns something (a bound socket, a temporary directory) is interrupted;
  ``serve.run`` asks :func:`pending` as soon as its own handlers are in place, and exits 128+N
  before anything is bound or loaded.

Only the process entry point calls :func:`install`; nothing here runs on import.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_pending: Optional[int] = None  # the first signal that arrived
_interrupt = False  # exit at once (True) or only record (False)


def _handler(signum: int, frame) -> None:
    global _pending
    if _pending is None:
        _pending = signum
    if _interrupt:
        try:
            sys.stderr.write(f"enginecore: stopped by signal {signum} during startup\n")
            sys.stderr.flush()
        finally:
            os._exit(128 + signum)  # not the interpreter's teardown of half-made imports


def install() -> None:
    """Catch SIGTERM and SIGINT, exiting 128+N at once until :func:`defer`."""
    global _interrupt
    _interrupt = True
    for s in SIGNALS:
        signal.signal(s, _handler)


def defer() -> None:
    """From now on a signal is only recorded, for :func:`pending`."""
    global _interrupt
    _interrupt = False


def restore() -> None:
    """Python's defaults again (a command that does not serve): SIGTERM ends the process,
    SIGINT raises ``KeyboardInterrupt``."""
    defer()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pending() -> Optional[int]:
    """The signal that arrived since :func:`install` (the first, if several), or None."""
    return _pending


__all__ = ["install", "defer", "restore", "pending", "SIGNALS"]

"""glibc malloc settings for enginecore's HTTP frontend processes: one arena
(:func:`one_arena`, from entrypoints/http/frontend.py) and :class:`Trimmer`, which gives freed
memory back after large request bodies. Process-wide, so only that entry point calls them,
never the library.

NOTE: written by hand because no library does it: ``mallopt`` and ``malloc_trim`` through ctypes.

The engine process keeps glibc's defaults. It used to set a 64 MiB ``M_TOP_PAD`` here (its step
thread faulted 160k-250k times a CPU benchmark run with the defaults, 6.7k with the pad, when
measured). Since the load moved to the step thread, the pad does the opposite. Measured again
(2-core box, ``bench.throughput``'s CPU workload over IPC, random:tiny-llama), the
engine process with the pad faulted 667k times and ran 7,100-8,300 tok/s; with glibc's defaults
it faulted 115k-180k times and ran 13,900-14,300. Every other setting tried was as bad as the pad
(a 1 or 16 MiB pad, ``M_TRIM_THRESHOLD``, ``M_MMAP_THRESHOLD``: 720k-950k faults), and one arena
matched the defaults. On the default GGUF the engine allocates little a step and the two were
alike.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import platform
import time

from engine import envs

log = logging.getLogger("enginecore.malloc")

M_ARENA_MAX = -8  # a mallopt parameter number from glibc's <malloc.h>


def _mallopt():
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - unusual libc
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def _ours_to_set(env) -> bool:
    """Not when disabled (the ``malloc_tuning`` kill switch, engine/envs.py), when the user set a ``MALLOC_*``
    variable or a ``glibc.malloc`` tunable (theirs win), or off glibc."""
    if not envs.on(envs.MALLOC_TUNING, env):
        return False
    if any(k.startswith("MALLOC_") for k in env) or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return False
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _set(environ, param: int, value: int, name: str) -> bool:
    """``mallopt(param, value)`` unless :func:`_ours_to_set` says no; True if set."""
    env = os.environ if environ is None else environ
    if not _ours_to_set(env):
        return False
    mallopt = _mallopt()
    if mallopt is None:  # pragma: no cover
        return False
    if mallopt(param, value) != 1:  # pragma: no cover
        log.warning("mallopt(%s) refused; glibc defaults stay", name)
        return False
    return True


def one_arena(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """Make every thread of this process allocate from glibc's main arena (``M_ARENA_MAX`` 1);
    True if set. For an HTTP frontend, which parses large bodies on worker threads: each
    worker's own arena kept what pydantic-core had allocated there. Measured here (Python 3.11,
    glibc 2.36): 8 refused bodies with 200,000 stop_token_ids each, parsed on a worker thread,
    left a process 12 MB up even after ``malloc_trim`` (34.0 -> 46.3 MB; 2 arenas: the same),
    and 0 MB with one arena (34.0 -> 34.1 MB); on the main thread: 0 MB. The frontend's threads
    are few and hold the GIL for most of their work, so one arena costs little contention.
    Skipped (False) off glibc, with the ``malloc_tuning`` kill switch off, or when the user already set
    a ``MALLOC_*`` variable or a ``glibc.malloc`` tunable (their settings win)."""
    return _set(environ, M_ARENA_MAX, 1, "M_ARENA_MAX")


class Trimmer:
    """Give freed heap memory back to the system (glibc ``malloc_trim(0)``), at most once per
    ``min_interval`` seconds. For an HTTP frontend after a large request body: its JSON was
    parsed on a worker thread, whose arena keeps the freed pages otherwise (a frontend's RSS
    stayed 20-40 MB above its start after a few refused multi-MB bodies, measured here).

    A call within ``min_interval`` of the last trim is not dropped: one trim is scheduled on the
    running asyncio loop for the end of the interval (the last of a burst of large bodies is
    trimmed too; without it, measured here, a frontend stayed at 76 MB after 32 refused bodies
    against 54 MB after a trim, from 52 MB before them)."""

    def __init__(self, min_interval: float = 1.0) -> None:
        self.min_interval = min_interval
        self._last = -float("inf")
        self._pending = False
        self._trim = None
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                self._trim = ctypes.CDLL(None).malloc_trim
                self._trim.argtypes = [ctypes.c_size_t]
                self._trim.restype = ctypes.c_int
            except (OSError, AttributeError):  # pragma: no cover - unusual libc
                self._trim = None

    def __call__(self) -> bool:
        """Trim now unless it was done less than ``min_interval`` ago (then once, later, if an
        asyncio loop is running); True if it trimmed now."""
        if self._trim is None:
            return False
        wait = self._last + self.min_interval - time.monotonic()
        if wait > 0:
            if not self._pending:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    return False
                self._pending = True
                loop.call_later(wait, self._later)
            return False
        self._now()
        return True

    def _later(self) -> None:
        self._pending = False
        self._now()

    def _now(self) -> None:
        self._last = time.monotonic()
        self._trim(0)


async def trim_every(interval: float) -> None:
    """Trim the heap every ``interval`` seconds, forever (a frontend process's background task).

    Why, beyond the trims after large bodies: under the soak's load (64 clients, hostile bodies
    among them) the frontend's heap kept 4-5 MB of freed memory that only a later trim gave back
    (62.4 -> 57.8 MB, from 53.4 before the attack). One ``malloc_trim`` took 1.5 ms of the event
    loop on a fragmented 50 MB heap here: every 10 s, nothing."""
    import anyio

    trim = Trimmer(min_interval=0.0)
    while True:
        await anyio.sleep(interval)
        trim()

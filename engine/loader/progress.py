"""``LoadProgress``: how far loading is — tensors and bytes done, the rate — as a tqdm bar on an
interactive terminal (stderr is a TTY) and as periodic INFO lines otherwise (logs, containers).
The last line says how long the stage took. Nothing here touches process-wide settings."""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

from engine.memory.owner import format_bytes

log = logging.getLogger("enginecore.loader")

#: Seconds between progress lines when stderr is not a terminal.
LOG_INTERVAL = 5.0


def _tqdm_bar(desc: str, total_bytes: int):
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - a dependency; a log line is still written
        return None
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                leave=False, file=sys.stderr, dynamic_ncols=True)


class LoadProgress:
    """``advance(nbytes)`` after each tensor; ``close()`` once (also on failure: no last line)."""

    def __init__(self, what: str, total_tensors: int, total_bytes: int, *,
                 interval: float = LOG_INTERVAL, bar: Optional[bool] = None) -> None:
        self.what = what
        self.total_tensors = total_tensors
        self.total_bytes = total_bytes
        self.interval = interval
        self.tensors = 0
        self.bytes = 0
        self.t0 = self._last = time.monotonic()
        self._bar = _tqdm_bar(what, total_bytes) if bar is None or bar else None

    def advance(self, nbytes: int, tensors: int = 1) -> None:
        self.tensors += tensors
        self.bytes += nbytes
        if self._bar is not None:
            self._bar.update(nbytes)
            return
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            log.info("%s: %s", self.what, self._figures(now),
                     extra={"tensors": self.tensors, "bytes": self.bytes})

    def _figures(self, now: float) -> str:
        rate = self.bytes / max(1e-9, now - self.t0)
        return (f"{self.tensors}/{self.total_tensors} tensors, {format_bytes(self.bytes)}/"
                f"{format_bytes(self.total_bytes)} ({format_bytes(int(rate))}/s)")

    def close(self, ok: bool = True) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if ok:
            now = time.monotonic()
            log.info("%s: done, %s in %.2f s", self.what, self._figures(now), now - self.t0,
                     extra={"tensors": self.tensors, "bytes": self.bytes,
                            "seconds": round(now - self.t0, 3)})

    def __enter__(self) -> "LoadProgress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)


__all__ = ["LoadProgress", "LOG_INTERVAL"]

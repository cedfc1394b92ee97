"""Authentication helpers: reading a token file, and throttling failed authentications.

:class:`AuthThrottle` counts failed handshakes per peer (and over all peers) in a sliding
window. Past ``free_failures`` (or ``global_free_failures`` over all peers) every further
handshake of that peer -- right token or wrong -- first waits ``base_delay`` seconds, doubling
with each failure up to ``max_delay``; at most ``max_waiting`` handshakes wait at once, beyond
that they are refused without looking at the token. Guessing is thereby bounded to about
``max_waiting / max_delay`` tries a second in all, while a client with the right token is at
worst delayed, never locked out. The table of peers is bounded (oldest forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict, deque
import logging
import os
import stat
import time
from typing import Optional

import anyio

from engine import envs

log = logging.getLogger("enginecore.ipc")

#: The environment variable ``enginecore serve`` / ``generate`` read a token from.
TOKEN_ENV = envs.TOKEN


def read_token_file(path: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped). Raises ``ValueError`` for an
    empty file and ``OSError`` if it cannot be read; warns if group or others may read it."""
    with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        data = f.read(64 * 1024)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("token file %s is accessible by group/others (mode %o); chmod 600 it",
                    path, stat.S_IMODE(mode))
    token = data.decode("utf-8").strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


class AuthThrottle:
    """See the module docstring. ``clock`` is for tests."""

    def __init__(self, *, free_failures: int = 5, global_free_failures: int = 50,
                 window: float = 60.0, base_delay: float = 0.25, max_delay: float = 10.0,
                 max_waiting: int = 32, max_peers: int = 4096, clock=time.monotonic) -> None:
        self.free_failures = free_failures
        self.global_free_failures = global_free_failures
        self.window = window
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.max_waiting = max_waiting
        self.max_peers = max_peers
        self._clock = clock
        self._peers: OrderedDict[str, deque[float]] = OrderedDict()
        self._all: deque[float] = deque(maxlen=max(1, 4 * global_free_failures))
        self.waiting = 0

    def _recent(self, times: deque) -> int:
        horizon = self._clock() - self.window
        while times and times[0] < horizon:
            times.popleft()
        return len(times)

    def failures(self, peer: str) -> int:
        """Failures of ``peer`` in the window."""
        times = self._peers.get(peer)
        return self._recent(times) if times is not None else 0

    def delay(self, peer: str) -> float:
        """How long a handshake of ``peer`` waits before its token is looked at (0: none)."""
        excess = max(self.failures(peer) - self.free_failures,
                     self._recent(self._all) - self.global_free_failures)
        if excess < 0:
            return 0.0
        return min(self.max_delay, self.base_delay * 2.0 ** min(excess, 60))

    async def wait_turn(self, peer: str) -> bool:
        """Wait the peer's :meth:`delay`; False (at once) if too many handshakes wait already."""
        d = self.delay(peer)
        if d <= 0:
            return True
        if self.waiting >= self.max_waiting:
            return False
        self.waiting += 1
        try:
            await anyio.sleep(d)
        finally:
            self.waiting -= 1
        return True

    def failed(self, peer: str) -> int:
        """Record a failure of ``peer``; its failures in the window."""
        now = self._clock()
        self._all.append(now)
        times = self._peers.pop(peer, None)
        if times is None:
            times = deque(maxlen=max(1, 2 * self.free_failures + 64))
            while len(self._peers) >= self.max_peers:
                self._peers.popitem(last=False)
        self._peers[peer] = times  # most recent last
        times.append(now)
        return self._recent(times)

    def retry_after(self, peer: str) -> Optional[float]:
        d = self.delay(peer)
        return d if d > 0 else None


__all__ = ["AuthThrottle", "read_token_file", "TOKEN_ENV"]

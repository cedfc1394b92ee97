"""Authentication helpers: reading a token file, and throttling failed authentications.

A token is compared first, in constant time (``transport.check_token``), and a right one is
admitted at once, whatever failures came before it from the same peer: it never meets the
throttle, so it is never locked out nor delayed. Only failures wait. :class:`AuthThrottle`
counts failed authentications per peer (the IPC server keys them by TCP host or Unix user, the
HTTP admin endpoints by client address) and over all peers, in a sliding ``window``. Past
``free_failures`` of a peer (or ``global_free_failures`` over all peers) the answer to each
further failure is held ``base_delay`` seconds, doubling with each failure up to ``max_delay``.
``max_delay`` stays under half of :data:`~ipc.handshake.HANDSHAKE_TIMEOUT` (a client's default
wait for its answer), so a wrong token gets its answer, not a timeout. At most ``max_waiting``
failures are held at once; beyond that a failure is answered at once ("try later", with a
retry-after) and its connection closed: held failures cost at most ``max_waiting`` tasks and
connections. The table of peers is bounded (oldest forgotten first).

What the throttle bounds, and what it does not: it slows a client that guesses one try after
another to one every ``max_delay`` seconds, and it makes failures hold their sender's
connections for a while. It does not bound the rate of guesses made over many connections at
once (the failures beyond ``max_waiting`` are answered at once, and a right token must be
admitted at once, so a refusal cannot be withheld without locking its owner out too). What
bounds guessing is the token's entropy -- use a long random one (``secrets.token_urlsafe(32)``:
256 bits; a token under :data:`SHORT_TOKEN` characters is warned about) -- and the connection
limits (``--max-ipc-connections``; HTTP ``--max-connections`` per API server).
"""

from __future__ import annotations

from collections import OrderedDict, deque
import logging
import os
import stat
import time
from typing import NamedTuple, Optional

import anyio

from engine import envs

from .handshake import HANDSHAKE_TIMEOUT

log = logging.getLogger("enginecore.ipc")

#: The environment variable ``enginecore serve`` / ``generate`` read a token from.
TOKEN_ENV = envs.TOKEN
#: Tokens shorter than this many characters are warned about (guessing is bounded by entropy).
SHORT_TOKEN = 16


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


def warn_if_short(token: Optional[str]) -> None:
    """Warn about a token too short to resist guessing (see the module docstring)."""
    if token and len(token) < SHORT_TOKEN:
        log.warning("the token has only %d characters; nothing bounds how fast a client with many "
                    "connections can guess it but its length: use at least %d random characters "
                    "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')",
                    len(token), SHORT_TOKEN)


class Denied(NamedTuple):
    """How a failed authentication was answered (:meth:`AuthThrottle.deny`)."""
    failures: int  #: the peer's failures in the window, this one included
    held: float  #: seconds the answer was held
    #: set when the answer was not held because ``max_waiting`` failures were held already:
    #: the delay the failure would have had (a retry-after hint)
    retry_after: Optional[float]


class AuthThrottle:
    """See the module docstring. ``clock`` and ``sleep`` are for tests."""

    def __init__(self, *, free_failures: int = 5, global_free_failures: int = 50,
                 window: float = 60.0, base_delay: float = 0.25, max_delay: float = 4.0,
                 max_waiting: int = 32, max_peers: int = 4096, clock=time.monotonic,
                 sleep=anyio.sleep) -> None:
        if not 0 < base_delay <= max_delay <= HANDSHAKE_TIMEOUT / 2:
            raise ValueError(f"need 0 < base_delay <= max_delay <= {HANDSHAKE_TIMEOUT / 2:g} s "
                             f"(half the handshake timeout), got {base_delay}, {max_delay}")
        if min(free_failures, global_free_failures, max_waiting) < 0 or max_peers < 1 or window <= 0:
            raise ValueError("AuthThrottle: counts must be >= 0, max_peers >= 1, window > 0")
        self.free_failures = free_failures
        self.global_free_failures = global_free_failures
        self.window = window
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.max_waiting = max_waiting
        self.max_peers = max_peers
        self._clock = clock
        self._sleep = sleep
        self._peers: OrderedDict[str, deque[float]] = OrderedDict()
        self._all: deque[float] = deque(maxlen=max(1, 4 * global_free_failures))
        self.waiting = 0  # failures whose answer is being held now

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
        """How long the answer to ``peer``'s next failure is held (0: none). Never applies to
        a right token: that is admitted before the throttle is asked."""
        excess = max(self.failures(peer) - self.free_failures,
                     self._recent(self._all) - self.global_free_failures)
        if excess < 0:
            return 0.0
        return min(self.max_delay, self.base_delay * 2.0 ** min(excess, 60))

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

    async def deny(self, peer: str) -> Denied:
        """A failed authentication of ``peer``: record it, then hold its answer for the peer's
        :meth:`delay` -- or, when ``max_waiting`` answers are held already, return at once, with
        the delay it would have had as ``retry_after``."""
        d = self.delay(peer)
        n = self.failed(peer)  # counted at once: failures held side by side escalate too
        if d <= 0:
            return Denied(n, 0.0, None)
        if self.waiting >= self.max_waiting:
            return Denied(n, 0.0, d)
        self.waiting += 1
        try:
            await self._sleep(d)
        finally:
            self.waiting -= 1
        return Denied(n, d, None)


__all__ = ["AuthThrottle", "Denied", "read_token_file", "warn_if_short", "TOKEN_ENV", "SHORT_TOKEN"]

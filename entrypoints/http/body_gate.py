"""``LargeBodyGate``: how much of a frontend process large request bodies may take at once.

Receiving a body and scanning its JSON cost the process CPU by the byte: 7.7 MiB took ~11 ms
to receive (httptools; ~16 ms with h11) and 20-40 ms to scan (``raw_limits``, then pydantic),
all under the GIL, measured here. Sixteen clients uploading such bodies at once kept the
process busy, taking CPU from whatever shares the host with it (the engine's own process on a
small box, with the token rate of every stream) and the event loop from small requests.

So a body over ``large_body_bytes`` (by its ``Content-Length``, or once a chunked one grows past
it) needs one of ``large_body_slots`` slots before any more of it is read (``guards.BodyGuard``):
a connection without one reads nothing (uvicorn pauses its transport once 64 KiB wait unread:
TCP pushes back on the sender, and nothing piles up here), for at most ``body_timeout``
seconds (then 503 and the connection closed). A slot is held while the body is received and
parsed (``app.parse_body`` gives it back with the parse's CPU time), not while its request
is generated. And slots are granted at a pace: large bodies may take ``large_body_cpu_share``
of one core over time (a generic cell rate algorithm over their CPU cost, with a burst of
:data:`BURST_S` seconds, so an occasional large body never waits). Small requests never wait.
"""

from __future__ import annotations

import time
from typing import Optional

import anyio

#: Wall seconds of pacing a burst may run ahead (at the default share: 0.1 s of CPU at once,
#: a few 8 MiB bodies), so that large bodies arriving now and then are admitted at once.
BURST_S = 0.5
#: The receiving side of a large body's cost, estimated per byte (its parse is measured): the
#: event loop thread spent 1.4 ms a MiB receiving with httptools and 2.0 with h11, measured; a
#: frontend under a flood of 7.7 MiB bodies spent ~1 ms a MiB more than that and their parse
#: (the buffers' page faults, freeing them).
RECEIVE_CPU_PER_BYTE = 3e-3 / 2**20
_now = time.monotonic  # the pacing clock (a module global: tests move it)


class LargeBodyGate:
    """At most ``slots`` large bodies received or parsed at once, their CPU cost paced to
    ``share`` of one core (module docstring). Waiters are served in order."""

    def __init__(self, slots: int, share: float, burst_s: float = BURST_S) -> None:
        self.slots = slots
        self.free = slots
        self.share = share
        self.burst_s = burst_s
        self.due = 0.0  # the pacing clock: where the admitted bodies' cost has brought it
        self.waiting = 0  # connections waiting for a slot now
        self.granted = 0  # slots granted so far
        # made on first use, in the event loop: FIFO among waiters; set when a slot frees
        self._turn: Optional[anyio.Lock] = None
        self._freed: Optional[anyio.Event] = None

    async def acquire(self) -> "Slot":
        """A slot, once one is free and the pace allows (cancel to give up waiting)."""
        if self._turn is None:
            self._turn, self._freed = anyio.Lock(), anyio.Event()
        if not self._turn.locked() and self.free and self._wait() <= 0:
            return self._grant()
        self.waiting += 1
        try:
            async with self._turn:
                while True:
                    if not self.free:
                        assert self._freed is not None
                        await self._freed.wait()
                        continue
                    wait = self._wait()
                    if wait <= 0:
                        return self._grant()
                    await anyio.sleep(wait)  # the clock only moves on: check again
        finally:
            self.waiting -= 1

    def _wait(self) -> float:
        return self.due - self.burst_s - _now()

    def _grant(self) -> "Slot":
        self.free -= 1
        self.granted += 1
        return Slot(self)

    def _release(self, cost: float) -> None:
        self.due = max(self.due, _now()) + cost / self.share
        self.free += 1
        if self._freed is not None:
            self._freed.set()
            self._freed = anyio.Event()


class Slot:
    """One large body's hold on the gate; :meth:`release` (idempotent) gives it back."""

    def __init__(self, gate: LargeBodyGate) -> None:
        self._gate: Optional[LargeBodyGate] = gate
        self.cost = 0.0  # CPU seconds spent on the body so far (estimated or measured)

    def add(self, seconds: float) -> None:
        self.cost += seconds

    def release(self) -> None:
        if self._gate is not None:
            gate, self._gate = self._gate, None
            gate._release(self.cost)


#: The ASGI scope's key under which ``BodyGuard`` hands a large body's slot to the app.
SCOPE_KEY = "enginecore.large_body_slot"


def slot_of(scope) -> Optional[Slot]:
    return scope.get(SCOPE_KEY)


__all__ = ["LargeBodyGate", "Slot", "BURST_S", "RECEIVE_CPU_PER_BYTE", "SCOPE_KEY", "slot_of"]

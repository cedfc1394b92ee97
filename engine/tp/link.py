"""A worker's side of the driver's :class:`~engine.tp.group.DriverGroup` calls, as the runner
makes them (the same names on both sides keep ``ModelRunner`` free of rank checks)."""

from __future__ import annotations

from .channel import Blocks, Channel, Closed, Loaded, Ready, Released
from .control import WorkerCalls


class WorkerLink(WorkerCalls):
    def __init__(self, rank: int, world: int, ch: Channel):
        self.rank, self.world, self._ch = rank, world, ch
        self._closed = False
        self.on_failure = None

    def start(self, should_stop) -> None:
        pass  # connected and in the process group already (entrypoints.tp_worker)

    def agree_blocks(self, mine: int) -> int:
        self._ch.send(Loaded(self.rank, mine))
        msg = self._ch.recv()
        if not isinstance(msg, Blocks):
            raise Closed(f"expected Blocks, got {type(msg).__name__}")
        return msg.num_blocks

    def wait_ready(self) -> None:
        self._ch.send(Ready(self.rank))

    def close(self, released: list[str], own: tuple[int, int], reachable) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._ch.send(Released(self.rank, released, own[0], own[1], reachable()))
        except Closed:
            pass

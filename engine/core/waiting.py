"""``WaitingQueue``: the scheduler's waiting requests, admitted round-robin across clients.

A client is whoever a request came from (``Request.client``: one IPC connection, one user of an
HTTP frontend, or the in-process callers that name none, who share one). Each client's requests
wait in arrival order (FIFO); the clients take turns, one admission each, in the order they
first had something waiting. One client's flood of thousands of requests then delays another's
by one admission, not by the flood. A request preempted by recompute is taken before any other
(it had its turn: it resumes first, the last preempted first), as with a single queue.

With one client this is the single FIFO queue it replaces, admission for admission. Every
operation is O(1) but ``remove`` (an abort: O(that client's waiting requests)); iterating gives
the admission order if nothing else arrived.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Hashable, Iterator

from engine.request import Request


class WaitingQueue:
    __slots__ = ("_resumed", "_queues", "_turns", "_n")

    def __init__(self) -> None:
        self._resumed: deque[Request] = deque()  # preempted: before everyone, newest first
        self._queues: dict[Hashable, deque[Request]] = {}  # client -> its requests, in order
        # the clients in turn order, each exactly once while it has a queue here; a queue
        # emptied by aborts stays until its turn comes round (then it is dropped)
        self._turns: deque[Hashable] = deque()
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def append(self, req: Request) -> None:
        """``req`` waits behind its client's earlier requests."""
        q = self._queues.get(req.client)
        if q is None:
            q = self._queues[req.client] = deque()
            self._turns.append(req.client)
        q.append(req)
        self._n += 1

    def appendleft(self, req: Request) -> None:
        """``req`` (preempted) is the next admitted."""
        self._resumed.appendleft(req)
        self._n += 1

    def peek(self) -> Request:
        """The next request to admit (the queue is not empty)."""
        if self._resumed:
            return self._resumed[0]
        turns, queues = self._turns, self._queues
        while True:
            q = queues[turns[0]]
            if q:
                return q[0]
            del queues[turns.popleft()]  # emptied by aborts

    def popleft(self) -> Request:
        """Take the next request (``peek``'s); its client's turn passes to the next client."""
        self._n -= 1
        if self._resumed:
            return self._resumed.popleft()
        turns, queues = self._turns, self._queues
        while True:
            client = turns[0]
            q = queues[client]
            if q:
                break
            del queues[turns.popleft()]  # emptied by aborts
        req = q.popleft()
        if q:
            turns.rotate(-1)
        else:
            turns.popleft()
            del queues[client]
        return req

    def remove(self, req: Request) -> None:
        """Take ``req`` out wherever it waits (ValueError if it does not)."""
        if self._resumed and req in self._resumed:
            self._resumed.remove(req)
        else:
            q = self._queues.get(req.client)
            if q is None:
                raise ValueError(f"{req!r} is not waiting")
            q.remove(req)
        self._n -= 1

    def move(self, req: Request, client: Hashable) -> None:
        """File ``req`` (waiting, not preempted) under ``client``, behind its requests."""
        if client == req.client:
            return
        q = self._queues[req.client]
        if q[-1] is req:  # (just added: the usual case)
            q.pop()
        else:
            q.remove(req)
        if not q and self._turns[-1] == req.client:  # its queue was new: as if never made
            self._turns.pop()
            del self._queues[req.client]
        self._n -= 1
        req.client = client
        self.append(req)

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests in the order they would be admitted."""
        yield from self._resumed
        pending = [iter(self._queues[c]) for c in self._turns]
        while pending:
            alive = []
            for it in pending:
                req = next(it, None)
                if req is not None:
                    yield req
                    alive.append(it)
            pending = alive

    def __getitem__(self, i: int) -> Request:
        if i == 0 and self._n:
            return self.peek()
        if not 0 <= i < self._n:
            raise IndexError(i)
        return next(islice(iter(self), i, None))

    def clients(self) -> int:
        """How many clients have requests waiting (preempted ones aside)."""
        return sum(1 for q in self._queues.values() if q)


__all__ = ["WaitingQueue"]

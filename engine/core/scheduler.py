"""Continuous batching with chunked prefill, a token budget, and preemption by recompute.

There are no prefill/decode phases: each step brings every scheduled request's
``num_computed_tokens`` closer to its ``num_tokens``. Running requests go first (oldest first),
then waiting ones: in arrival order within one client, round-robin across clients
(:class:`~engine.core.waiting.WaitingQueue`; with one client, FCFS). When KV blocks run out,
the newest running request is preempted: its blocks are freed (their full blocks stay in the
prefix cache, so its resume may hit them) and it returns to the front of the waiting queue to
be recomputed later — it is never failed. A waiting request is admitted with the longest
cached prefix of its tokens already computed. Only the scheduler (through its
:class:`BlockManager`) changes ``block_ids``.
"""

from __future__ import annotations

from typing import Hashable

from engine.kv.block_manager import BlockManager
from engine.kv.kv_cache import blocks_needed
from engine.request import Request, Status

from .waiting import WaitingQueue


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self._running_of: dict[Hashable, int] = {}  # client -> its running requests (> 0)
        self.num_preemptions = 0
        #: requests finished or aborted so far (a step planned before sees none left if equal)
        self.removed = 0

    # -- queue ---------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def move(self, req: Request, client: Hashable) -> None:
        """``req``, just added, is ``client``'s: it waits behind that client's requests."""
        self.waiting.move(req, client)

    def running_of(self, client: Hashable) -> int:
        """How many of ``client``'s requests are running."""
        return self._running_of.get(client, 0)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the queues and free its blocks (finish or abort)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self._stopped(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req)
        req.status = Status.FINISHED
        self.removed += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def advance(self, req: Request, num_computed: int) -> None:
        """After a step: ``req`` has ``num_computed`` tokens in its cache. Blocks only rejected
        draft tokens used go back; newly full blocks are sealed into the prefix cache."""
        self.blocks.advance(req, num_computed)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Request, int]]:
        budget = self.token_budget
        out: list[tuple[Request, int]] = []
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.hold:  # its last token is in flight (overlapped scheduling)
                i += 1
                continue
            n = min(req.num_known_tokens - req.num_computed_tokens, budget)
            spec = len(req.spec_token_ids) if req.num_computed_tokens + n == req.num_tokens else 0
            if not self._reserve(req, n + spec, scheduled):
                if req.status is not Status.RUNNING:  # it preempted itself
                    continue
                break
            if req.num_computed_tokens + n != req.num_tokens:
                req.spec_token_ids = []
            if n > 1:  # a prompt chunk: the requests admitted after it share the blocks it
                # fills (a decode row's block is sealed after its step, as before: per row
                # here, the check alone cost ~0.25 us, 64 us a step of 256 rows)
                self.blocks.seal_ahead(req, req.num_computed_tokens + n)
            out.append((req, n))
            scheduled.add(id(req))
            budget -= n + spec
            i += 1
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = waiting.peek()
            hit = [] if req.skips_prefix_cache else self.blocks.lookup(req)
            start = len(hit) * self.block_size
            n = min(req.num_tokens - start, budget)
            need = blocks_needed(start + n, self.block_size) - len(hit)
            if not self.blocks.can_admit(hit, need):
                break
            self.blocks.admit(req, hit, need)
            if not req.num_preemptions:  # (a resume re-reads its own prefix)
                req.num_cached_tokens = start
            waiting.popleft()
            req.status = Status.RUNNING
            req.spec_token_ids = []
            self.running.append(req)
            self._running_of[req.client] = self._running_of.get(req.client, 0) + 1
            # the blocks this chunk fills are found by the requests admitted after it
            self.blocks.seal_ahead(req, start + n)
            out.append((req, n))
            budget -= n
        return out

    def prefill_pending(self) -> bool:
        """Whether the next step will compute prompt tokens (a waiting request, or a running
        one with more than its next token to compute): an eager step, not a graph replay."""
        return bool(self.waiting) or any(
            r.num_known_tokens - r.num_computed_tokens > 1 for r in self.running)

    def blocks_short(self) -> bool:
        """Whether scheduling the running requests now could preempt one: their next tokens
        (within the token budget, in schedule order) need more blocks than are free."""
        # a bound first (no loop): a request's next n tokens need at most n // block_size + 1
        # new blocks, and the step's tokens are at most the budget (draft tokens aside)
        if not any(r.spec_token_ids for r in self.running) and self.blocks.can_allocate(
                len(self.running) + self.token_budget // self.block_size + 1):
            return False
        budget, need = self.token_budget, 0
        for req in self.running:
            if budget <= 0:
                break
            if req.hold:
                continue
            n = min(req.num_known_tokens - req.num_computed_tokens, budget)
            need += max(0, blocks_needed(req.num_computed_tokens + n + len(req.spec_token_ids),
                                         self.block_size) - len(req.block_ids))
            budget -= n
        return not self.blocks.can_allocate(need)

    def _reserve(self, req: Request, n: int, scheduled: set[int]) -> bool:
        """Make sure ``req`` has blocks for ``n`` more tokens, preempting the newest running
        requests that are not yet scheduled this step. False if ``req`` itself was preempted."""
        need = blocks_needed(req.num_computed_tokens + n, self.block_size) - len(req.block_ids)
        if need <= 0:  # (most decodes: the last block has room)
            return True
        while not self.blocks.can_allocate(need):
            victim = self.running[-1]
            if id(victim) in scheduled:  # never undo work already in this step's batch
                return False
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            self.blocks.grow(req, need)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._stopped(req)
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _stopped(self, req: Request) -> None:
        """``req`` left ``running``."""
        n = self._running_of[req.client] - 1
        if n:
            self._running_of[req.client] = n
        else:
            del self._running_of[req.client]

    # -- bookkeeping -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Waiting requests hold nothing; the block manager's counts, lists and index agree with
        the running requests' blocks."""
        for r in self.waiting:
            assert not r.block_ids and r.num_computed_tokens == 0, f"waiting {r} holds blocks"
        assert sum(self._running_of.values()) == len(self.running), "running counts per client"
        self.blocks.check_integrity(self.running)

"""Continuous batching with chunked prefill, a token budget, and preemption by recompute.

There are no prefill/decode phases: each step brings every scheduled request's
``num_computed_tokens`` closer to its ``num_tokens``. Running requests go first (oldest first),
then waiting ones in arrival order (FCFS). When KV blocks run out, the newest running request is
preempted: its blocks are freed and it returns to the front of the waiting queue to be
recomputed later — it is never failed.
"""

from __future__ import annotations

from collections import deque

from .kv_cache import BlockAllocator, blocks_needed
from .request import Request, Status


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, lookahead: int = 0):
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.lookahead = lookahead  # extra slots per decode for speculative tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take ``req`` out of the queues and free its blocks (finish or abort)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self._free(req)
        req.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _free(self, req: Request) -> None:
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> list[tuple[Request, int]]:
        budget = self.token_budget
        out: list[tuple[Request, int]] = []
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            spec = len(req.spec_token_ids) if req.num_computed_tokens + n == req.num_tokens else 0
            if not self._reserve(req, n + spec, scheduled):
                if req.status is not Status.RUNNING:  # it preempted itself
                    continue
                break
            if req.num_computed_tokens + n != req.num_tokens:
                req.spec_token_ids = []
            out.append((req, n))
            scheduled.add(id(req))
            budget -= n + spec
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = blocks_needed(req.num_computed_tokens + n, self.block_size) - len(req.block_ids)
            if not self.allocator.can_allocate(need):
                break
            req.block_ids += self.allocator.allocate(need)
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.spec_token_ids = []
            self.running.append(req)
            out.append((req, n))
            budget -= n
        return out

    def _reserve(self, req: Request, n: int, scheduled: set[int]) -> bool:
        """Make sure ``req`` has blocks for ``n`` more tokens, preempting the newest running
        requests that are not yet scheduled this step. False if ``req`` itself was preempted."""
        need = blocks_needed(req.num_computed_tokens + n, self.block_size) - len(req.block_ids)
        while not self.allocator.can_allocate(need):
            victim = self.running[-1]
            if id(victim) in scheduled:  # never undo work already in this step's batch
                return False
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.block_ids += self.allocator.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # -- bookkeeping -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Blocks are exactly those held by running requests, plus the free list."""
        self.allocator.check_integrity()
        held = [b for r in self.running for b in r.block_ids]
        held += [b for r in self.waiting for b in r.block_ids]
        assert len(held) == len(set(held)), "a KV block is held by two requests"
        assert len(held) == self.allocator.num_blocks - self.allocator.num_free, "leaked KV blocks"
        for r in self.running:
            assert len(r.block_ids) * self.block_size >= r.num_computed_tokens, f"{r} lacks blocks"

"""The block manager on its own (no model, milliseconds): reference counts, the prefix cache's
hits, LRU eviction, invalidation, and a property test over random operation sequences."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st
import pytest

from engine.kv.block_manager import BlockManager
from engine.kv.kv_cache import BlockAllocator, blocks_needed
from engine.ops.host_arrays import block_table
from engine.params import SamplingParams
from engine.request import Request

BS = 4


def req(tokens, rid="r") -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def run_prompt(bm: BlockManager, r: Request) -> list[int]:
    """Admit ``r`` with its cached prefix, compute its whole prompt in one chunk; the hit."""
    hit = bm.lookup(r)
    start = len(hit) * BS
    need = blocks_needed(r.num_tokens, BS) - len(hit)
    assert bm.can_admit(hit, need)
    bm.admit(r, hit, need)
    assert r.num_computed_tokens == start
    bm.advance(r, r.num_tokens)
    return hit


def test_hit_is_the_longest_cached_chain_and_leaves_the_last_token():
    bm = BlockManager(16, BS)
    a = req(range(1, 13), "a")  # 3 full blocks
    assert run_prompt(bm, a) == []
    bm.free(a)
    same = req(range(1, 13), "same")  # all cached: the last block is recomputed
    assert len(run_prompt(bm, same)) == 2 and same.num_sealed_blocks == 3
    longer = req(list(range(1, 13)) + [99], "longer")  # one token more: every block hits
    assert len(run_prompt(bm, longer)) == 3
    bm.check_integrity([same, longer])
    mid = req(list(range(1, 7)) + [50, 51, 52], "mid")  # diverges inside block 2
    assert len(run_prompt(bm, mid)) == 1
    other = req([7] + list(range(2, 13)), "other")  # first token differs: chain broken
    assert run_prompt(bm, other) == []
    bm.check_integrity([same, longer, mid, other])
    shared = same.block_ids[0]
    assert bm.ref_count(shared) == 3 and bm.is_cached(shared)  # same, longer, mid
    assert bm.statistics().queries == 12 + 12 + 13 + 9 + 12
    assert bm.statistics().hits == 0 + 8 + 12 + 4 + 0


def test_a_block_is_cached_only_once_and_equal_prompts_in_one_step_both_compute():
    bm = BlockManager(16, BS)
    a, b = req(range(9), "a"), req(range(9), "b")
    for r in (a, b):  # both admitted before either computed: no hit
        hit = bm.lookup(r)
        assert hit == []
        bm.admit(r, hit, 3)
    bm.advance(a, 9)
    bm.advance(b, 9)
    bm.check_integrity([a, b])
    assert [bm.is_cached(x) for x in a.block_ids[:2]] == [True, True]
    assert [bm.is_cached(x) for x in b.block_ids[:2]] == [False, False]  # duplicates stay private
    bm.free(b)
    bm.free(a)
    bm.check_integrity([])
    assert bm.num_free == 16 and bm.statistics().cached_blocks == 2


def test_freed_blocks_are_evicted_least_recently_used_after_empty_ones():
    bm = BlockManager(6, BS)
    a = req(range(100, 109), "a")  # blocks: 2 full + 1 partial
    run_prompt(bm, a)
    bm.free(a)
    assert bm.statistics().cached_blocks == 2 and bm.num_free == 6
    filler = req(range(200, 212), "f")  # needs 3 blocks: the 4 empty ones come first
    run_prompt(bm, filler)
    assert bm.statistics().evictions == 0
    again = req(range(100, 109), "again")
    assert len(bm.lookup(again)) == 2
    more = req(range(300, 304), "m")
    bm.admit(more, [], 2)  # 1 empty + 1 evicted: the *last* block of "a" (freed first)
    assert bm.statistics().evictions == 1
    assert len(bm.lookup(again)) == 1
    bm.check_integrity([filler, more])


def test_a_referenced_block_is_never_handed_out():
    bm = BlockManager(4, BS)
    a = req(range(16), "a")
    run_prompt(bm, a)
    assert not bm.can_allocate(1)
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.allocate(1)
    b = req(range(13), "b")
    hit = bm.lookup(b)
    assert len(hit) == 3 and not bm.can_admit(hit, 1)  # the hit costs nothing, the rest does


def test_rolled_back_draft_blocks_go_back_and_sealed_ones_stay():
    bm = BlockManager(8, BS)
    r = req(range(7), "r")
    run_prompt(bm, r)  # 7 tokens computed in 2 blocks
    r.token_ids.append(7)  # the sampled token
    bm.grow(r, blocks_needed(8 + 4, BS) - len(r.block_ids))  # 1 real + 4 draft rows
    assert len(r.block_ids) == 3
    bm.advance(r, 8 + 1)  # one draft accepted: 9 computed, keep blocks for 10 tokens
    assert len(r.block_ids) == 3 and r.num_sealed_blocks == 2
    bm.check_integrity([r])
    bm.advance(r, 9)
    bm.check_integrity([r])
    with pytest.raises(AssertionError):
        bm.advance(r, 8)  # computed tokens never go back


def test_a_block_table_read_before_a_rollback_follows_it():
    """host_arrays.block_table's mirror, read with draft blocks, then rolled back, the freed
    blocks taken by another request, and grown past its old length: the blocks it holds now."""
    bm = BlockManager(16, BS, enable_caching=False)
    r = req(range(7), "r")
    run_prompt(bm, r)
    r.token_ids.append(7)
    bm.grow(r, 3)  # draft rows
    assert block_table(r).tolist() == r.block_ids and len(r.block_ids) == 5
    bm.advance(r, 8)  # no draft accepted: blocks past 9 tokens go back
    other = req(range(100, 120), "o")
    run_prompt(bm, other)  # takes the blocks r gave back (and more)
    bm.grow(r, 4)
    assert len(r.block_ids) == 7
    assert block_table(r).tolist() == r.block_ids
    bm.check_integrity([r, other])


def test_reset_drops_every_entry_and_old_requests_never_register():
    bm = BlockManager(16, BS, weights_version=3)
    a = req(range(9), "a")
    run_prompt(bm, a)
    bm.free(a)
    old = req(range(50, 62), "old")
    hit = bm.lookup(old)
    bm.admit(old, hit, 1)
    bm.advance(old, 4)  # one block computed under the old weights
    bm.grow(old, 2)
    bm.reset_prefix_cache(weights_version=4)
    assert bm.weights_version == 4 and bm.statistics().cached_blocks == 0
    assert bm.lookup(req(range(9))) == []
    bm.advance(old, 12)  # sealed, never registered: its K/V mixes both weights
    bm.check_integrity([old])
    assert not any(bm.is_cached(b) for b in old.block_ids)
    bm.free(old)
    assert bm.statistics().cached_blocks == 0 and bm.num_free == 16
    bm.check_integrity([])


def test_weights_version_is_part_of_the_hash():
    a, b = BlockManager(4, BS, weights_version=0), BlockManager(4, BS, weights_version=1)
    ra, rb = req(range(9)), req(range(9))
    run_prompt(a, ra)
    run_prompt(b, rb)
    assert ra.block_hashes and ra.block_hashes != rb.block_hashes
    assert BlockManager(4, BS).lookup(req(range(9))) == []  # deterministic, but nothing cached


def test_lookup_hashes_nothing_and_a_hit_continues_the_chain(monkeypatch):
    """A lookup walks the index by (parent hash, token ids) keys: no hash is computed for the
    blocks it finds; the request's chain starts from their registered hashes, and the blocks
    it computes get exactly the hashes a chain over its own tokens gives."""
    from engine.kv.block_hash import chain_hashes, root_hash
    import engine.kv.block_manager as bmod

    bm = BlockManager(32, BS)
    a = req(range(1, 30), "a")  # 7 full blocks
    run_prompt(bm, a)
    bm.free(a)
    b = req(list(range(1, 30)) + [77] * 6, "b")  # 8 full blocks, the first 7 cached
    real = bmod.chain_hashes
    calls = []
    monkeypatch.setattr(bmod, "chain_hashes", lambda *a: calls.append(len(a[1])) or real(*a))
    hit = bm.lookup(b)
    assert len(hit) == 7 and calls == []
    bm.admit(b, hit, blocks_needed(b.num_tokens, BS) - len(hit))
    bm.advance(b, b.num_tokens)
    assert calls == [BS]  # only the one block it computed was hashed
    root = root_hash(0, bm.epoch, BS)
    assert b.block_hashes == chain_hashes(root, b.token_ids, BS)
    bm.check_integrity([b])
    # a block of equal tokens under another parent is another key: no hit past a difference
    c = req([9] + list(range(2, 30)) + [77] * 6, "c")
    assert bm.lookup(c) == []


def test_caching_off_never_hits_or_registers():
    bm = BlockManager(8, BS, enable_caching=False)
    for name in "ab":
        r = req(range(9), name)
        assert run_prompt(bm, r) == []
        bm.free(r)
    assert bm.statistics() == (0, 0, 0, 0)


def test_close_forgets_everything():
    bm = BlockManager(8, BS)
    r = req(range(9))
    run_prompt(bm, r)
    bm.free(r)
    bm.close()
    assert bm.closed and bm.statistics().cached_blocks == 0 and bm.lookup(req(range(9))) == []


def test_double_free_is_refused():
    bm = BlockManager(4, BS)
    r = req(range(5))
    run_prompt(bm, r)
    blocks = list(r.block_ids)
    bm.free(r)
    r.block_ids = blocks  # a bug elsewhere that keeps stale blocks
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(r)


def test_plain_allocator_integrity_after_random_alloc_free():
    import random

    rng = random.Random(0)
    al = BlockAllocator(32)
    held: list[list[int]] = []
    for _ in range(500):
        if held and (rng.random() < 0.5 or not al.can_allocate(1)):
            al.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 4)
            if al.can_allocate(n):
                held.append(al.allocate(n))
        al.check_integrity()
        flat = [b for h in held for b in h]
        assert len(flat) == len(set(flat)) and al.num_free == 32 - len(flat)
    with pytest.raises(RuntimeError, match="double free"):
        al.free([next(iter(set(range(32)) - {b for h in held for b in h}))])


# -- the property test ------------------------------------------------------------------------
class Sim:
    """Drives a BlockManager like the scheduler and the runner would, and keeps a shadow of
    every block's content so a cache hit can be checked against what was really written."""

    PREFIXES = [list(range(1, 30)), list(range(40, 70)), [5] * 30]

    def __init__(self):
        self.bm = BlockManager(10, BS)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.written: dict[int, tuple] = {}  # block -> (epoch, tokens before it, its tokens)
        self.n = 0

    def _write(self, r: Request, start: int, tokens: list[int], ahead: frozenset = frozenset()) -> None:
        """The runner writes K/V of ``tokens`` at ``start`` on into ``r``'s blocks; ``ahead``:
        blocks ``r`` registered for this step (``seal_ahead``), which others may hold."""
        seq = r.token_ids[:start] + tokens
        for p in range(start, len(seq)):
            tok = seq[p]
            b = r.block_ids[p // BS]
            assert b in ahead or (self.bm.ref_count(b) == 1 and not self.bm.is_cached(b)), \
                "a second writer"
            ep, before, toks = self.written.get(b, (None, None, None))
            if p % BS == 0 or ep is None:
                ep, before, toks = r.cache_epoch, tuple(seq[:p - p % BS]), {}
            toks = dict(toks)
            toks[p % BS] = tok
            self.written[b] = (ep, before, toks)

    def new(self, x: int) -> None:
        base = self.PREFIXES[x % 3][: 1 + (x // 3) % 29]
        tail = [100 + (x // 97 + i) % 7 for i in range((x // 7) % 6)]
        self.n += 1
        self.waiting.append(Request(f"q{self.n}", base + tail, SamplingParams(max_tokens=8)))

    def _check_hit(self, r: Request, hit: list[int]) -> None:
        for i, b in enumerate(hit):  # what the hit serves was written for exactly this prefix
            ep, before, toks = self.written[b]
            assert ep == self.bm.epoch, "stale K/V served"
            assert before == tuple(r.token_ids[:i * BS])
            assert [toks[o] for o in range(BS)] == r.token_ids[i * BS:(i + 1) * BS]

    def _admit_first(self, chunk: int):
        """Admit the first waiting request with a chunk of at most ``chunk`` tokens after its
        hit, as the scheduler does: ``(request, hit, n)``, or None (nothing waits, no room)."""
        if not self.waiting:
            return None
        r = self.waiting[0]
        hit = self.bm.lookup(r)
        start = len(hit) * BS
        n = min(r.num_tokens - start, chunk)
        need = blocks_needed(start + n, BS) - len(hit)
        if not self.bm.can_admit(hit, need):
            return None
        others = {b for q in self.running for b in q.block_ids}
        self.bm.admit(r, hit, need)
        assert not (set(r.block_ids[len(hit):]) & others), "a held block was handed out"
        self.waiting.pop(0)
        self.running.append(r)
        return r, hit, n

    def admit(self, x: int) -> None:
        got = self._admit_first(1 + x % 9)
        if got is not None:
            r, hit, n = got
            self._check_hit(r, hit)
            self._compute(r, n, [])

    def together(self, x: int) -> None:
        """Up to three admissions in one step, as the scheduler makes them: each chunk's
        blocks are registered when it is scheduled (``seal_ahead``), so a later one may hit
        blocks an earlier one fills in this step; then the step runs (every chunk's K/V is
        written before any hit is read) and each chunk is advanced."""
        step = []
        for k in range(3):
            got = self._admit_first(1 + (x >> (4 * k)) % 13)
            if got is None:
                break
            r, hit, n = got
            self.bm.seal_ahead(r, len(hit) * BS + n)
            step.append((r, hit, n, frozenset(r.block_ids[len(hit):r.num_sealed_blocks])))
        for r, hit, n, ahead in step:
            c = r.num_computed_tokens
            self._write(r, c, r.token_ids[c:c + n], ahead)
        for r, hit, n, ahead in step:
            self._check_hit(r, hit)
            self._compute(r, n, [], written=True)

    def _compute(self, r: Request, n: int, drafts: list[int], accepted: int = 0,
                 written: bool = False) -> None:
        c = r.num_computed_tokens
        toks = r.token_ids[c:c + n] + drafts
        if not written:
            self._write(r, c, toks)
        if c + n < r.num_tokens:
            self.bm.advance(r, c + n)
            return
        self.bm.advance(r, c + n + accepted)
        r.token_ids += drafts[:accepted] + [200 + len(r.token_ids) % 5]  # the sampled token

    def step(self, x: int) -> None:
        if not self.running:
            return
        r = self.running[x % len(self.running)]
        n = min(r.num_tokens - r.num_computed_tokens, 1 + (x // 5) % 6)
        decoding = r.num_computed_tokens + n == r.num_tokens
        d = (x // 31) % 4 if decoding else 0
        need = blocks_needed(r.num_computed_tokens + n + d, BS) - len(r.block_ids)
        if not self.bm.can_allocate(need):
            return
        if need > 0:
            others = {b for q in self.running for b in q.block_ids}
            self.bm.grow(r, need)
            assert not (set(r.block_ids[-need:]) & others), "a held block was handed out"
        drafts = [200 + (x + i) % 5 for i in range(d)]
        self._compute(r, n, drafts, (x // 131) % (d + 1))

    def finish(self, x: int) -> None:
        if self.running:
            self.bm.free(self.running.pop(x % len(self.running)))

    def preempt(self, x: int) -> None:
        if self.running:
            r = self.running.pop()  # the newest, as the scheduler does
            self.bm.free(r)
            r.num_computed_tokens = 0
            r.num_preemptions += 1
            self.waiting.insert(0, r)

    def reset(self, x: int) -> None:
        if x % 4 == 0:
            self.bm.reset_prefix_cache(weights_version=x)

    OPS = ("new", "admit", "step", "step", "finish", "preempt", "reset", "new", "together")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(Sim.OPS) - 1), st.integers(0, 10**6)), max_size=80))
def test_random_operations_keep_every_invariant(ops):
    sim = Sim()
    for op, x in ops:
        getattr(sim, Sim.OPS[op])(x)
        sim.bm.check_integrity(sim.running)
        assert all(not r.block_ids for r in sim.waiting)
        # the decode rows' block tables (host_arrays.block_table), read after some operations
        # only: a mirror must follow every change made while it was not read
        for i, r in enumerate(sim.running + sim.waiting):
            if (x >> i) & 1:
                assert block_table(r).tolist() == r.block_ids, (Sim.OPS[op], r)
    for r in sim.running:
        sim.bm.free(r)
    sim.bm.check_integrity([])
    assert sim.bm.num_free == sim.bm.num_blocks

"""The scheduler on its own (no model, milliseconds): admission, chunked prefill, the token
budget, preemption order, prefix hits at admission and draft-block rollback."""

from __future__ import annotations

from engine.core.scheduler import Scheduler
from engine.kv.block_manager import BlockManager
from engine.params import SamplingParams
from engine.request import Request, Status

BS = 4


def make(num_blocks=64, max_num_seqs=8, budget=64, caching=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, enable_caching=caching), max_num_seqs, budget)


def req(rid: str, n: int, first: int = 1) -> Request:
    return Request(rid, list(range(first, first + n)), SamplingParams(max_tokens=100))


def step(s: Scheduler, accepted: dict | None = None) -> list[tuple[str, int]]:
    """One schedule plus what the core's update does: a request that reaches the end of its
    tokens gets one new token (plus its accepted drafts)."""
    batch = s.schedule()
    for r, n in batch:
        end = r.num_computed_tokens + n == r.num_tokens
        if not end:
            s.advance(r, r.num_computed_tokens + n)
            continue
        acc = (accepted or {}).get(r.request_id, 0)
        drafts, r.spec_token_ids = r.spec_token_ids, []
        s.advance(r, r.num_computed_tokens + n + acc)
        r.token_ids += drafts[:acc] + [500 + r.num_tokens]
    s.check_integrity()
    return [(r.request_id, n) for r, n in batch]


def test_fcfs_admission_up_to_max_num_seqs():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 5, first=10 * i + 1))
    assert step(s) == [("r0", 5), ("r1", 5)]
    assert [r.request_id for r in s.waiting] == ["r2"]
    assert step(s) == [("r0", 1), ("r1", 1)]  # running first, still no room for r2


def test_chunked_prefill_within_the_token_budget():
    s = make(budget=16)
    s.add(req("long", 40))
    s.add(req("short", 3, first=100))
    assert step(s) == [("long", 16)]
    assert step(s) == [("long", 16)]
    assert step(s) == [("long", 8), ("short", 3)]  # the rest of the budget goes to waiting
    assert step(s) == [("long", 1), ("short", 1)]


def test_budget_counts_draft_tokens():
    s = make(budget=6)
    a, b, c = req("a", 2), req("b", 2, first=50), req("c", 2, first=60)
    for r in (a, b, c):
        s.add(r)
    assert step(s) == [("a", 2), ("b", 2), ("c", 2)]
    for r in (a, b, c):
        r.spec_token_ids = [7, 7, 7, 7]
    # a: 1 + 4 rows of 6; b starts in the last slot, its drafts ride along (ModelState leaves
    # room for k rows a sequence); nothing is left for c
    assert step(s, {"a": 2, "b": 4}) == [("a", 1), ("b", 1)]
    assert a.num_tokens == 3 + 2 + 1 and b.num_tokens == 3 + 4 + 1 and c.spec_token_ids
    assert len(a.block_ids) == 2 and len(b.block_ids) == 2  # 6 and 8 tokens -> 2 blocks each


def test_preemption_takes_the_newest_and_puts_it_first_in_line():
    s = make(num_blocks=6, caching=False)  # 24 token slots
    for i, n in enumerate([8, 7, 7]):
        s.add(req(f"r{i}", n, first=20 * i + 1))
    s.add(req("late", 4, first=90))
    step(s)  # r0: 2 blocks, r1: 2, r2: 2 -> all 6 blocks; "late" waits
    assert [r.request_id for r in s.running] == ["r0", "r1", "r2"]
    step(s)  # r0 needs a third block: r2, the newest, is preempted
    assert [r.request_id for r in s.running] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "late"]
    r2 = s.waiting[0]
    assert r2.status is Status.WAITING and r2.num_preemptions == 1 and s.num_preemptions == 1
    assert r2.num_computed_tokens == 0 and r2.block_ids == []


def test_a_request_that_cannot_grow_preempts_itself_last():
    s = make(num_blocks=2, caching=False)
    s.add(req("a", 7))
    step(s)  # 2 blocks, 8 tokens after the sample
    step(s)  # 9 tokens
    step(s)  # token 9 needs a third block, nobody else to preempt: it preempts itself
    assert s.running == [] and [r.request_id for r in s.waiting] == ["a"]


def test_admission_starts_after_the_cached_prefix():
    s = make(budget=64)
    s.add(req("a", 14))
    step(s)
    first = s.running[0]
    s.remove(first)
    assert first.status is Status.FINISHED
    s.add(req("b", 14))  # the same prompt: 3 full blocks cached, the last token recomputed
    s.add(req("c", 10))  # the first 8 tokens of it: 2 blocks, but 9 is the cap -> 2 blocks
    assert step(s) == [("b", 2), ("c", 2)]
    b, c = s.running
    assert b.num_computed_tokens == 14 and b.block_ids[:2] == c.block_ids[:2]
    assert s.blocks.statistics().hits == 12 + 8


def test_requests_admitted_in_one_step_share_the_blocks_it_fills():
    """A chunk's full blocks are registered when it is scheduled (``seal_ahead``): a request
    admitted after it in the same step hits them and computes only its own tail; one admitted
    before the chunk covers them finds nothing."""
    s = make(budget=64)
    s.add(req("a", 14))
    s.add(req("b", 14))  # the same prompt: 3 full blocks, filled by a's chunk in this step
    s.add(req("c", 10))  # its first 8 tokens: 2 of them
    batch = s.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 14), ("b", 2), ("c", 2)]
    a, b, c = s.running
    assert b.block_ids[:3] == a.block_ids[:3] and c.block_ids[:2] == a.block_ids[:2]
    assert [s.blocks.ref_count(x) for x in a.block_ids] == [3, 3, 2, 1]
    assert s.blocks.statistics().hits == 12 + 8
    for r, n in batch:  # the step ran: every chunk computed
        s.advance(r, r.num_computed_tokens + n)
    s.check_integrity()
    # a budget that ends a's chunk mid-block: only its full blocks are shared
    s = make(budget=10)
    s.add(req("a", 14))
    s.add(req("b", 14))
    batch = s.schedule()
    assert [(r.request_id, n) for r, n in batch] == [("a", 10)]  # b waits: no budget left
    s.advance(batch[0][0], 10)
    s.check_integrity()
    batch = s.schedule()  # a's last 4 tokens fill its 3rd and 4th block; b shares all 3 full ones
    assert [(r.request_id, n) for r, n in batch] == [("a", 4), ("b", 2)]
    assert s.running[1].block_ids[:3] == s.running[0].block_ids[:3]


def test_preempted_request_resumes_on_its_own_cached_prefix():
    s = make(num_blocks=6)
    s.add(req("old", 9))
    s.add(req("new", 12, first=40))
    step(s)  # old: 3 blocks (9 tokens), new: 3 blocks
    step(s)  # old has 10 tokens: fits; new has 13 tokens, needs a 4th block -> preempts itself
    new = s.waiting[0]
    assert new.request_id == "new" and new.num_preemptions == 1
    s.remove(s.running[0])  # old finishes: room again
    assert step(s) == [("new", 1)]  # 12 of its 13 tokens were still cached
    assert new.num_computed_tokens == 13


def test_rejected_draft_blocks_are_rolled_back_by_the_scheduler():
    s = make()
    a = req("a", 7)
    s.add(a)
    step(s)  # 8 tokens, 2 blocks
    a.spec_token_ids = [1, 2, 3, 4, 5, 6]  # 1 + 6 rows: positions 7..13 -> 4 blocks
    batch = s.schedule()
    assert batch == [(a, 1)] and len(a.block_ids) == 4
    s.advance(a, 7 + 1 + 1)  # one draft accepted: 9 computed, room for 10 tokens
    assert len(a.block_ids) == 3
    s.check_integrity()


def _blocks_short_by_loop(s: Scheduler) -> bool:
    """The definition, request by request (what the bound in ``blocks_short`` must agree with)."""
    from engine.kv.kv_cache import blocks_needed

    budget, need = s.token_budget, 0
    for r in s.running:
        if budget <= 0:
            break
        if r.hold:
            continue
        n = min(r.num_known_tokens - r.num_computed_tokens, budget)
        need += max(0, blocks_needed(r.num_computed_tokens + n + len(r.spec_token_ids), BS)
                    - len(r.block_ids))
        budget -= n
    return not s.blocks.can_allocate(need)


def test_blocks_short_agrees_with_its_definition_on_random_states():
    """``blocks_short`` answers from a bound when free blocks plainly suffice; on random mixes of
    prefills, decodes, held requests and nearly full caches it says what the loop says."""
    import random

    rng = random.Random(5)
    for trial in range(300):
        s = make(num_blocks=rng.choice([8, 16, 32, 64]), max_num_seqs=8, budget=rng.choice([8, 16, 64]))
        for i in range(rng.randint(1, 8)):
            s.add(req(f"r{i}", rng.randint(1, 30), first=40 * i + 1))
        for _ in range(rng.randint(0, 6)):
            step(s)
            for r in s.running:
                r.hold = rng.random() < 0.2
            assert s.blocks_short() == _blocks_short_by_loop(s), trial
            for r in s.running:
                r.hold = False

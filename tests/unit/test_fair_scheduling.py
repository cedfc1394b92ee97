"""Waiting requests across clients (no model, milliseconds): round-robin between clients, FIFO
within one, preempted requests first, aborts anywhere; one client is the plain FIFO queue."""

from __future__ import annotations

from collections import deque
import random

import pytest

from engine.core.scheduler import Scheduler
from engine.core.waiting import WaitingQueue
from engine.kv.block_manager import BlockManager
from engine.params import SamplingParams
from engine.request import DEFAULT_CLIENT, Request

BS = 4


def make(num_blocks=256, max_num_seqs=64, budget=4096) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, enable_caching=False), max_num_seqs, budget)


def req(rid: str, client: str = DEFAULT_CLIENT, n: int = 3) -> Request:
    return Request(rid, [1 + hash(rid) % 300] * n, SamplingParams(max_tokens=8), client)


def admitted(s: Scheduler) -> list[str]:
    """The requests one step admits (in order)."""
    waiting = set(map(id, s.waiting))
    return [r.request_id for r, _ in s.schedule() if id(r) in waiting]


def test_clients_take_turns_and_each_keeps_its_order():
    s = make()
    for rid, client in [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("a4", "A"),
                        ("c1", "C"), ("b2", "B")]:
        s.add(req(rid, client))
    assert [r.request_id for r in s.waiting] == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]
    assert admitted(s) == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]
    assert s.running_of("A") == 4 and s.running_of("B") == 2 and s.running_of("Z") == 0
    s.check_integrity()


def test_a_flood_delays_another_client_by_one_admission():
    s = make(max_num_seqs=1)
    for i in range(1000):
        s.add(req(f"f{i}", "flood"))
    assert admitted(s) == ["f0"]
    s.add(req("v", "victim"))  # arrives behind 999 waiting requests of the flood
    order = []
    for _ in range(3):
        s.remove(s.running[0])  # the running request finishes: one slot
        order += admitted(s)
    assert order == ["f1", "v", "f2"]
    assert s.running_of("victim") == 0 and s.running_of("flood") == 1
    s.check_integrity()


def test_a_preempted_request_resumes_before_every_client():
    s = Scheduler(BlockManager(6, BS, enable_caching=False), 8, 64)  # 24 token slots
    s.add(req("a", "A", n=8))
    s.add(req("b", "B", n=7))
    s.add(req("c", "A", n=7))
    s.add(req("late", "B", n=4))
    s.schedule()  # a, b, c take all 6 blocks; "late" waits
    for r, n in list(zip(s.running, [8, 7, 7])):
        s.advance(r, n)
        r.token_ids.append(9)
    s.schedule()  # a needs a third block: c (the newest) is preempted
    assert [r.request_id for r in s.waiting] == ["c", "late"]
    assert s.waiting[0].request_id == "c" and s.running_of("A") == 1
    s.check_integrity()


def test_aborts_anywhere_in_the_queue():
    s = make(max_num_seqs=2)
    a = [req(f"a{i}", "A") for i in range(3)]
    b = req("b0", "B")
    for r in a + [b]:
        s.add(r)
    for r in a:  # every request of the client whose turn it is
        s.remove(r)
    assert len(s.waiting) == 1 and list(s.waiting) == [b]
    assert admitted(s) == ["b0"]
    s.add(req("a3", "A"))  # a client whose queue was emptied comes back
    assert admitted(s) == ["a3"] and not s.waiting
    with pytest.raises(ValueError):
        s.waiting.remove(a[0])
    s.check_integrity()


def test_move_files_a_request_under_its_client():
    s = make()
    x, y = req("x"), req("y")
    s.add(req("a1", "A"))
    s.add(req("a2", "A"))
    s.add(x)
    s.move(x, "B")  # just added: the usual case
    s.add(y)
    s.move(s.waiting[3], "A")  # not last in its queue
    assert x.client == "B" and y.client == DEFAULT_CLIENT
    assert [r.request_id for r in s.waiting] == ["a1", "x", "y", "a2"]


def test_one_client_is_the_fifo_queue_it_replaces():
    """Random appends, preemptions (``appendleft``), admissions and aborts: a WaitingQueue
    of one client and a deque agree on every answer."""
    rng = random.Random(7)
    for trial in range(200):
        w, d = WaitingQueue(), deque()
        n = 0
        for _ in range(rng.randint(1, 60)):
            op = rng.random()
            if op < 0.45 or not d:
                r = req(f"r{n}")
                n += 1
                (w.appendleft if rng.random() < 0.2 else w.append)(r)
                (d.appendleft if w._resumed and w._resumed[0] is r else d.append)(r)
            elif op < 0.8:
                assert w.peek() is d[0] and w[0] is d[0]
                assert w.popleft() is d.popleft()
            else:
                r = rng.choice(list(d))
                w.remove(r)
                d.remove(r)
            assert list(w) == list(d) and len(w) == len(d), trial


def test_iteration_is_the_admission_order():
    rng = random.Random(3)
    for trial in range(200):
        w = WaitingQueue()
        for i in range(rng.randint(1, 40)):
            r = req(f"r{i}", rng.choice("ABCD"))
            (w.appendleft if rng.random() < 0.1 else w.append)(r)
        for r in rng.sample(list(w), rng.randint(0, len(w) // 2)):
            w.remove(r)
        expected = list(w)
        assert [w.popleft() for _ in range(len(w))] == expected, trial
        assert not w

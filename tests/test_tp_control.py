"""The driver's side of sleep, wake and updates across ranks (engine/tp/control.py) against
scripted workers, no processes: a wake that fails on one rank puts the others back to sleep and
raises with every rank asleep; a sleep that fails on a rank, or a rank that does not answer,
fails the engine; stale answers are not taken for the current call."""

from __future__ import annotations

import queue

import pytest

from engine.tp.channel import Done, Sleep, Update, Wake
from engine.tp.control import DriverCalls, RankCallError, RankFailed


class Worker:
    """A worker's control connection: answers each frame as ``script(rank, msg)`` says."""

    def __init__(self, rank: int, group: "Group", script) -> None:
        self.rank, self.group, self.script = rank, group, script

    def send(self, msg) -> None:
        self.group.sent.append((self.rank, msg))
        error = self.script(self.rank, msg)
        if error is not None:
            self.group._inbox.put((self.rank, Done(msg.seq, self.rank, error, 7, [], [])))


class Group(DriverCalls):
    def __init__(self, script, world: int = 3) -> None:
        self.world, self._procs, self._failed = world, {}, False
        self._inbox: queue.Queue = queue.Queue()
        self.sent: list = []
        self.failures: list = []
        self.on_failure = self.failures.append
        self._chans = {r: Worker(r, self, script) for r in range(1, world)}


def ok(rank, msg):
    return ""


def test_a_wake_that_fails_on_one_rank_puts_every_rank_back_to_sleep() -> None:
    g = Group(lambda r, m: "OutOfMemoryError: no room" if r == 2 and isinstance(m, Wake) else "")
    local: list = []
    with pytest.raises(RankCallError, match="wake_up failed on tensor-parallel rank 2: OutOfMemory"):
        g.wake_all(["weights", "kv_cache"], lambda: local.append("wake"), 2,
                   lambda: local.append("sleep"))
    assert local == ["wake", "sleep"]  # the driver woke, then went back to sleep
    back = [(r, m) for r, m in g.sent if isinstance(m, Sleep)]
    assert [(r, m.level, m.tags) for r, m in back] == [(1, 2, ["weights", "kv_cache"])]
    assert not g.failures  # the engine lives on, asleep


def test_a_wake_that_fails_on_the_driver_puts_the_workers_back_to_sleep() -> None:
    g = Group(ok)

    def boom():
        raise MemoryError("driver")

    with pytest.raises(MemoryError, match="driver"):
        g.wake_all(["weights"], boom, 1, lambda: pytest.fail("the driver is asleep already"))
    assert sorted(r for r, m in g.sent if isinstance(m, Sleep)) == [1, 2]


def test_a_sleep_that_fails_on_a_rank_fails_the_engine() -> None:
    g = Group(lambda r, m: "RuntimeError: stuck" if r == 1 else "")
    with pytest.raises(RankFailed, match="no longer agree.*rank 1: RuntimeError: stuck"):
        g.sleep_all(1, ["weights", "kv_cache"], lambda: 100)
    assert len(g.failures) == 1 and isinstance(g.failures[0], RankFailed) and g._failed


def test_sleep_sums_every_rank_and_ignores_stale_answers() -> None:
    g = Group(ok)
    g._inbox.put((1, Done(0, 1, "RuntimeError: an old call", 0, [], [])))  # not this call's
    assert g.sleep_all(1, ["kv_cache"], lambda: 100) == 100 + 7 + 7
    assert not g.failures
    assert g.update_all(["w"], [[2, 2]], 1 << 20, None, lambda: 64) == 64
    assert [type(m) for _, m in g.sent] == [Sleep, Sleep, Update, Update]


def test_a_rank_that_does_not_answer_fails_the_engine(monkeypatch) -> None:
    monkeypatch.setenv("ENGINECORE_TP_TIMEOUT_S", "0.3")
    g = Group(lambda r, m: None if r == 2 else "")  # rank 2 never answers
    with pytest.raises(RankFailed, match=r"ranks \[2\] did not answer"):
        g.sleep_all(1, ["weights"], lambda: 0)
    assert len(g.failures) == 1

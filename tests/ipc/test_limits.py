"""The server's brakes in isolation, on a fake clock: flood logging and the auth throttle
(its holds on a sleep the test releases)."""

from __future__ import annotations

import inspect
import logging

import anyio
from anyio import wait_all_tasks_blocked
import pytest

from ipc.accept import SummaryLog
from ipc.auth import AuthThrottle, Denied
from ipc.client import EngineClient
from ipc.handshake import HANDSHAKE_TIMEOUT


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_summary_log_logs_the_first_then_one_line_per_interval(caplog):
    clock = Clock()
    log = SummaryLog(logging.getLogger("test.summary"), "accept failed", interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.summary"):
        log.note("EMFILE", "EMFILE: too many open files")
        for _ in range(12_345):
            clock.now += 0.0001
            log.note("EMFILE")
        clock.now = 10.5
        log.note("EMFILE")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["accept failed: EMFILE: too many open files",
                     "accept failed 12,346 times in the last 10 s: EMFILE x12,346"]


def test_auth_throttle_delays_after_free_failures_and_forgets_after_the_window():
    clock = Clock()
    t = AuthThrottle(free_failures=2, global_free_failures=100, window=60.0, base_delay=0.5,
                     max_delay=4.0, clock=clock)
    assert t.delay("a") == 0.0
    t.failed("a")
    assert t.delay("a") == 0.0
    t.failed("a")
    assert t.delay("a") == 0.5 and t.delay("b") == 0.0  # per peer
    for _ in range(10):
        t.failed("a")
    assert t.delay("a") == 4.0  # capped
    clock.now = 61.0
    assert t.delay("a") == 0.0  # the window slid past


def test_auth_throttle_global_bound_and_bounded_peer_table():
    t = AuthThrottle(free_failures=100, global_free_failures=3, base_delay=1.0, max_peers=8,
                     clock=Clock())
    for i in range(3):
        t.failed(f"peer{i}")
    assert t.delay("someone-new") == 1.0  # many peers failing slow everybody down
    for i in range(100):
        t.failed(f"p{i}")
    assert len(t._peers) <= 8


class HeldSleep:
    """``AuthThrottle``'s sleep for tests: records each hold and returns when released."""

    def __init__(self) -> None:
        self.holds: list[float] = []
        self.release = anyio.Event()

    async def __call__(self, seconds: float) -> None:
        self.holds.append(seconds)
        await self.release.wait()


@pytest.mark.asyncio
async def test_auth_throttle_holds_failures_and_answers_those_beyond_max_waiting_at_once():
    sleep = HeldSleep()
    t = AuthThrottle(free_failures=1, base_delay=0.5, max_delay=2.0, max_waiting=2,
                     clock=Clock(), sleep=sleep)
    assert await t.deny("a") == Denied(1, 0.0, None)  # a free failure: answered at once
    results: list[Denied] = []

    async def deny() -> None:
        results.append(await t.deny("a"))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(deny)
        await wait_all_tasks_blocked()
        # two are held (0.5 s, then 1 s: each failure counts at once); the other three are
        # answered at once with the delay they would have had
        assert t.waiting == 2 and sleep.holds == [0.5, 1.0]
        assert results == [Denied(4, 0.0, 2.0), Denied(5, 0.0, 2.0), Denied(6, 0.0, 2.0)]
        sleep.release.set()
    assert t.waiting == 0
    assert results[3:] == [Denied(2, 0.5, None), Denied(3, 1.0, None)]
    assert t.delay("b") == 0.0  # per peer


def test_no_hold_reaches_the_client_handshake_timeout():
    client_timeout = inspect.signature(EngineClient.connect).parameters["timeout"].default
    assert client_timeout == HANDSHAKE_TIMEOUT
    t = AuthThrottle(clock=Clock())
    for n in range(200):
        assert t.delay("a") <= t.max_delay <= HANDSHAKE_TIMEOUT / 2
        t.failed("a")
    assert t.delay("a") == t.max_delay
    for bad in (HANDSHAKE_TIMEOUT, HANDSHAKE_TIMEOUT / 2 + 0.1, 0.0):
        with pytest.raises(ValueError, match="handshake timeout"):
            AuthThrottle(base_delay=min(0.25, bad) if bad else 0.0, max_delay=bad)

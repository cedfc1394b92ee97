"""The server's brakes in isolation, on a fake clock: flood logging and the auth throttle."""

from __future__ import annotations

import logging

from ipc.accept import SummaryLog
from ipc.auth import AuthThrottle


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

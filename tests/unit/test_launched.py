"""``Launched.wait``: a deferred step's tokens read from its host copy, waiting on the copy's
event only while it is not done (``synchronize`` gives the GIL up even then)."""

from __future__ import annotations

import torch

from engine.runner.launched import Launched


class _Event:
    def __init__(self, done: bool):
        self.done, self.synced = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced += 1
        self.done = True


def _deferred(done: bool) -> tuple[Launched, _Event]:
    launched = Launched.deferred(3, [0, 2], torch.tensor([7, 9], dtype=torch.int32), 2)
    event = launched.event = _Event(done)
    return launched, event


def test_a_done_copy_is_read_without_a_synchronize():
    launched, event = _deferred(True)
    assert launched.ready
    assert launched.wait().tokens == [[7], [], [9]]
    assert event.synced == 0


def test_a_copy_under_way_is_waited_for_once():
    launched, event = _deferred(False)
    assert not launched.ready
    assert launched.wait().tokens == [[7], [], [9]]
    assert event.synced == 1
    assert launched.wait().tokens == [[7], [], [9]] and event.synced == 1  # kept

"""``LargeBodyGate``'s bookkeeping on a clock the test moves (no timing): slots, the pace of
their CPU cost, the order of the waiters, a wait given up."""

from __future__ import annotations

import anyio
import pytest
from anyio.lowlevel import checkpoint

from entrypoints.http import body_gate
from entrypoints.http.body_gate import LargeBodyGate

pytestmark = pytest.mark.asyncio


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(body_gate, "_now", lambda: now[0])
    return now


async def settle() -> None:
    for _ in range(20):
        await checkpoint()


async def test_slots_are_granted_in_order_and_given_back_once(clock):
    gate = LargeBodyGate(slots=2, share=1.0, burst_s=0.0)
    a, b = await gate.acquire(), await gate.acquire()
    assert gate.free == 0 and gate.granted == 2
    got: list[str] = []

    async def wait(name: str) -> None:
        slot = await gate.acquire()
        got.append(name)
        slot.release()

    async with anyio.create_task_group() as tg:
        for name in "xyz":
            tg.start_soon(wait, name)
            await settle()
        assert gate.waiting == 3 and not got
        a.release()
        a.release()  # idempotent: one slot back, not two
        await settle()
        assert got == ["x", "y", "z"] and gate.free == 1  # each gave its slot back in turn
        b.release()
    assert gate.free == 2 and gate.waiting == 0


async def test_the_cost_paces_the_next_grant_past_the_burst(clock):
    gate = LargeBodyGate(slots=4, share=0.25, burst_s=0.5)
    slot = await gate.acquire()
    slot.add(0.5)  # CPU seconds: 2 s of the clock at a quarter of a core
    slot.release()
    assert gate.due == pytest.approx(1002.0)
    got = []

    async def wait() -> None:
        got.append(await gate.acquire())

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await settle()
        assert not got and gate.waiting == 1 and gate.free == 4  # a free slot, but not due
        clock[0] += 1.0
        await anyio.sleep(0.6)
        assert not got  # the clock is 0.5 s short of due - burst
        clock[0] += 0.6  # past it: granted once the gate looks again (its own sleep ends)
        with anyio.fail_after(5):
            while not got:
                await anyio.sleep(0.05)
    # idle for long: the clock starts from now, with the burst ahead of it again
    got[0].release()
    clock[0] += 100
    assert (await gate.acquire()) is not None


async def test_a_wait_given_up_leaves_the_gate_as_it_was(clock):
    gate = LargeBodyGate(slots=1, share=1.0, burst_s=0.0)
    held = await gate.acquire()
    with anyio.move_on_after(0.05) as scope:
        await gate.acquire()
    assert scope.cancelled_caught and gate.waiting == 0 and gate.free == 0
    held.release()
    again = await gate.acquire()
    assert gate.free == 0 and gate.granted == 2
    again.release()

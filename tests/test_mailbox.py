"""engine.serving.mailbox.Mailbox: order, the terminal error, closing, and a consumer cancelled mid-wait."""

import anyio
import pytest

from engine.serving.mailbox import Mailbox

pytestmark = pytest.mark.asyncio


async def test_pieces_in_order_then_the_error_once():
    box = Mailbox()
    box.put(1)
    box.put(2)
    box.fail(ValueError("boom"))
    box.put(3)  # after the error: still queued in order (the producer decides what is terminal)
    assert [await box.get(), await box.get(), await box.get()] == [1, 2, 3]
    with pytest.raises(ValueError, match="boom"):
        await box.get()
    with anyio.move_on_after(0.05) as scope:
        await box.get()  # the error was raised once; now it waits
    assert scope.cancelled_caught


async def test_a_sleeping_consumer_is_woken_by_put_and_by_fail():
    box = Mailbox()
    got = []

    async def consume():
        got.append(await box.get())
        try:
            await box.get()
        except RuntimeError as exc:
            got.append(str(exc))

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.sleep(0.01)
        assert got == []
        box.put("a")
        await anyio.sleep(0.01)
        assert got == ["a"]
        box.fail(RuntimeError("engine gone"))
    assert got == ["a", "engine gone"]


async def test_cancelled_consumer_leaves_the_mailbox_usable():
    box = Mailbox()
    with anyio.move_on_after(0.02):
        await box.get()
    box.put("after")  # wakes nobody (the waiter was cancelled) and must not raise
    assert await box.get() == "after"


async def test_closed_mailbox_drops_everything():
    box = Mailbox()
    box.put(1)
    box.close()
    box.put(2)
    box.fail(RuntimeError("late"))
    assert not box.items and box.error is None

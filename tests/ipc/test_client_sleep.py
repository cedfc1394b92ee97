"""Sleep mode over the wire against the fake engine (fast): ``EngineClient.sleep / wake_up /
is_sleeping / update_weights``, refusals while asleep (by the client and by the engine), the
fields bounded in the client and at the server's boundary. The real engine over a real
``enginecore serve`` process: tests/shutdown/test_serve_sleep.py."""

from __future__ import annotations

import math
import struct

import anyio
import msgspec
import pytest

from engine.errors import BadRequestError, EngineSleepingError
from engine.params import SamplingParams
from ipc import EngineClient
from ipc.framing import FrameCodec, FrameReader
from ipc.messages import PROTOCOL_VERSION, EngineMessage, Error, ErrorKind, Hello, Welcome
from ipc.transport import connect
from states import InvalidTransitionError, State
from test_client import collect, serving, wait_for

pytestmark = pytest.mark.asyncio


async def test_sleep_wake_and_update_weights_calls_reach_the_engine() -> None:
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        seen = []
        c.on_state_change(lambda old, new: seen.append(new))
        running = c.generate([1], SamplingParams(max_tokens=100_000))
        await running.__anext__()
        with pytest.raises(InvalidTransitionError, match="SERVING"):
            await c.wake_up()
        await c.sleep(level=2, mode="wait", timeout=7.5)
        assert eng.calls == [("sleep", 2, "wait", 7.5)]
        assert c.is_sleeping and c.state is State.SLEEPING and seen == [State.SLEEPING]
        last = (await collect(running))[-1]  # the request in flight got its one terminal piece
        assert (last.finish_reason, last.reason) == ("abort", "sleep")
        h = await c.health()
        assert (h.state, h.live, h.ready) == (State.SLEEPING, True, False)
        with pytest.raises(EngineSleepingError) as ei:  # the client knows: refused at once
            c.generate([1, 2, 3])
        assert ei.value.retryable
        # the engine's own refusal, over the wire (as if the client had not heard yet)
        c._state = State.SERVING
        with anyio.fail_after(5), pytest.raises(EngineSleepingError) as ei:
            await c.generate([1, 2, 3]).__anext__()
        assert ei.value.retry_after == 4.0
        c._state = State.SLEEPING
        with pytest.raises(InvalidTransitionError, match="SLEEPING"):
            await c.sleep()
        with pytest.raises(BadRequestError, match="intermediate_size"):  # CheckpointError there
            await c.update_weights("/ckpt/bad")
        await c.update_weights("/ckpt/step-2")
        await c.wake_up(["weights"])
        assert c.is_sleeping  # the Ack said "sleeping": half awake
        await c.wake_up(["kv_cache"])
        assert c.state is State.SERVING and not c.is_sleeping and seen[-1] is State.SERVING
        assert eng.calls[1:] == [("update_weights", "/ckpt/bad"), ("update_weights", "/ckpt/step-2"),
                                 ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
        assert len(await collect(c.generate([1], SamplingParams(max_tokens=3)))) == 3


async def test_a_client_connecting_while_asleep_is_told_so() -> None:
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as a:
        await a.sleep(level=1)
        async with EngineClient.connect(addr) as b:
            assert b.welcome.state is State.SLEEPING and b.is_sleeping
            with pytest.raises(EngineSleepingError):
                b.generate([1])
            await b.wake_up()  # any client may wake it; every other one hears
            await wait_for(lambda: a.state is State.SERVING)


async def test_client_checks_every_argument_before_sending() -> None:
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        for bad in (dict(level=3), dict(level=True), dict(level="1"), dict(level=1.0),
                    dict(mode="later"), dict(timeout=-1), dict(timeout=math.nan),
                    dict(timeout="1"), dict(timeout=True)):
            with pytest.raises(BadRequestError):
                await c.sleep(**bad)
        for tags in ([], ["gpu"], "weights", [1], 5, {"weights": 1}):
            with pytest.raises(BadRequestError):
                await c.wake_up(tags)
        for path in ("", "a\0b", "x" * 4097, 5, None):
            with pytest.raises(BadRequestError):
                await c.update_weights(path)
        assert eng.calls == [] and c.state is State.SERVING and not c.closed
        await c.sleep(timeout=math.inf)  # beyond the wire's bound: no limit
        assert eng.calls == [("sleep", 1, "abort", None)]


@pytest.mark.parametrize("raw", [
    {"t": "Sleep", "level": 3},
    {"t": "Sleep", "mode": "soon"},
    {"t": "WakeUp", "tags": ["gpu"]},
    {"t": "UpdateWeights", "path": "x" * 5000},
])
async def test_out_of_bounds_sleep_frames_close_only_that_connection(raw) -> None:
    async with serving() as (eng, server, addr):
        stream = await connect(addr)
        codec = FrameCodec(EngineMessage)
        reader = FrameReader(stream, codec)
        try:
            await stream.send(codec.encode(Hello(protocol_version=PROTOCOL_VERSION)))
            assert isinstance(await reader.read(), Welcome)
            body = msgspec.msgpack.encode(raw)
            await stream.send(struct.pack(">I", len(body)) + body)
            with anyio.fail_after(5):
                err = await reader.read()
            assert isinstance(err, Error) and err.kind is ErrorKind.PROTOCOL and err.fatal
        finally:
            await stream.aclose()
        assert eng.calls == [] and eng.state is State.SERVING
        async with EngineClient.connect(addr) as c:  # the engine serves on
            assert len(await collect(c.generate([1], SamplingParams(max_tokens=2)))) == 2


async def test_shutdown_while_asleep_over_the_wire() -> None:
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        await c.sleep()
        await c.shutdown()
        assert c.state is State.SHUTDOWN and eng.state is State.SHUTDOWN


async def test_sync_client_has_the_sleep_calls() -> None:
    from ipc.sync_client import SyncEngineClient

    async with serving() as (eng, server, addr):
        def script() -> None:
            with SyncEngineClient.connect(addr) as c:
                c.sleep(level=2, mode="wait")
                assert c.is_sleeping
                c.update_weights("/ckpt/step-3")
                c.wake_up()
                assert not c.is_sleeping and c.state is State.SERVING

        await anyio.to_thread.run_sync(script)
    assert eng.calls == [("sleep", 2, "wait", None), ("update_weights", "/ckpt/step-3"),
                         ("wake_up", None)]

"""``serve_ipc`` against a fake engine (fast, deterministic) and once against the real one."""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from contextlib import asynccontextmanager

import anyio
import pytest
import pytest_asyncio

from engine.params import RequestOutput, SamplingParams
from fake_engine import FakeEngine
from ipc.errors import ConnectionClosed
from ipc.framing import FrameCodec, FrameReader
from ipc.messages import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Drain,
    EngineMessage,
    Error,
    ErrorKind,
    Generate,
    Health,
    HealthRequest,
    Hello,
    Outputs,
    Shutdown,
    StateChanged,
    Welcome,
)
from ipc.server import IPCServer, serve_ipc
from ipc.transport import connect
from states import State

pytestmark = pytest.mark.asyncio
_OPEN: list = []


@pytest_asyncio.fixture(autouse=True)
async def _close_test_clients():
    yield
    while _OPEN:
        await _OPEN.pop().stream.aclose()


class RawClient:
    """A minimal protocol client for tests (the real client comes later)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.codec = FrameCodec(EngineMessage)
        self.reader = FrameReader(stream, self.codec)
        self.unread: list = []

    @classmethod
    async def open(cls, address: str, *, hello: bool = True, token: str | None = None) -> "RawClient":
        c = cls(await connect(address))
        _OPEN.append(c)
        if hello:
            await c.send(Hello(protocol_version=PROTOCOL_VERSION, token=token, client_name="test"))
            welcome = await c.recv()
            assert isinstance(welcome, Welcome), welcome
            c.welcome = welcome
        return c

    async def send(self, msg) -> None:
        await self.stream.send(self.codec.encode(msg))

    async def recv(self, timeout: float = 5.0):
        if self.unread:
            return self.unread.pop(0)
        with anyio.fail_after(timeout):
            return await self.reader.read()

    async def recv_until_closed(self, timeout: float = 5.0) -> list:
        out = []
        with anyio.fail_after(timeout):
            while True:
                try:
                    out.append(await self.recv())
                except ConnectionClosed:
                    return out

    async def collect(self, ids: set[str], timeout: float = 10.0):
        """Outputs of ``ids`` until each finished (or got an Error); returns (outputs, frames, other)."""
        outs: dict[str, list[RequestOutput]] = {i: [] for i in ids}
        frames: list[int] = []
        other: list = []
        pending = set(ids)
        with anyio.fail_after(timeout):
            while pending:
                msg = await self.recv()
                if isinstance(msg, Outputs):
                    frames.append(len(msg.outputs))
                    for o in msg.outputs:
                        outs[o.request_id].append(o)
                        if o.finished:
                            pending.discard(o.request_id)
                elif isinstance(msg, Error) and msg.request_id in pending:
                    pending.discard(msg.request_id)
                    other.append(msg)
                else:
                    other.append(msg)
        return outs, frames, other

    async def aclose(self) -> None:
        await self.stream.aclose()


@asynccontextmanager
async def serving(engine: FakeEngine | None = None, address: str = "tcp://127.0.0.1:0", **kw):
    engine = engine or FakeEngine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        server = IPCServer(engine, address, **kw)
        bound = await tg.start(lambda task_status: server.serve(task_status=task_status))
        server.done = anyio.Event()
        yield engine, server, bound
        tg.cancel_scope.cancel()


def short_unix_address() -> tuple[str, str]:
    d = tempfile.mkdtemp(prefix="ipc", dir="/tmp")
    return d, f"unix://{d}/e.sock"


# ------------------------------------------------------------------------------ handshake


async def test_handshake_welcome():
    async with serving() as (eng, server, addr):
        c = await RawClient.open(addr)
        w = c.welcome
        assert w.protocol_version == PROTOCOL_VERSION and w.state is State.SERVING
        assert w.model == "fake:counter" and w.client_id >= 1 and w.max_frame == 16 * 1024 * 1024
        assert len(server.connections) == 1
        await c.aclose()


@pytest.mark.parametrize(
    "first,kind",
    [
        (Hello(protocol_version=PROTOCOL_VERSION + 1), ErrorKind.VERSION),
        (Hello(protocol_version=0), ErrorKind.VERSION),
        (HealthRequest(call_id=1), ErrorKind.PROTOCOL),
        (Welcome(protocol_version=1, state=State.SERVING), ErrorKind.PROTOCOL),  # wrong direction
    ],
    ids=["newer", "older", "not-hello", "engine-message"],
)
async def test_handshake_rejections(first, kind):
    async with serving() as (eng, server, addr):
        c = await RawClient.open(addr, hello=False)
        await c.send(first)
        msgs = await c.recv_until_closed()
        assert len(msgs) == 1 and msgs[0].kind is kind and msgs[0].fatal
        assert not server.connections


@pytest.mark.parametrize("given", [None, "wrong", "s3cret!", ""])
async def test_token_required(given):
    async with serving(token="s3cret") as (eng, server, addr):
        c = await RawClient.open(addr, hello=False)
        await c.send(Hello(protocol_version=PROTOCOL_VERSION, token=given))
        msgs = await c.recv_until_closed()
        assert [m.kind for m in msgs] == [ErrorKind.AUTH] and msgs[0].fatal
        ok = await RawClient.open(addr, token="s3cret")
        assert ok.welcome.state is State.SERVING
        await ok.aclose()


async def test_garbage_and_oversize_hello():
    async with serving() as (eng, server, addr):
        c = await RawClient.open(addr, hello=False)
        await c.stream.send(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
        assert [m.kind for m in await c.recv_until_closed()] == [ErrorKind.PROTOCOL]
        # Before the handshake only 64 KiB frames are allowed; the body is never sent.
        c = await RawClient.open(addr, hello=False)
        await c.stream.send(struct.pack(">I", 64 * 1024 + 1))
        assert [m.kind for m in await c.recv_until_closed()] == [ErrorKind.TOO_LARGE]


async def test_handshake_timeout():
    async with serving(handshake_timeout=0.2) as (eng, server, addr):
        c = await RawClient.open(addr, hello=False)
        msgs = await c.recv_until_closed(timeout=3)
        assert [m.kind for m in msgs] == [ErrorKind.PROTOCOL]


async def test_hello_and_requests_pipelined_in_one_write():
    async with serving() as (eng, server, addr):
        c = await RawClient.open(addr, hello=False)
        await c.stream.send(c.codec.encode_many([
            Hello(protocol_version=PROTOCOL_VERSION),
            Generate(request_id="a", prompt=[1, 2], params=SamplingParams(max_tokens=3)),
            HealthRequest(call_id=7),
        ]))
        assert isinstance(await c.recv(), Welcome)
        outs, _, other = await c.collect({"a"})
        assert [o.token_ids for o in outs["a"]] == [[1], [2], [3]]
        assert any(isinstance(m, Health) and m.call_id == 7 for m in other)
        await c.aclose()


# ------------------------------------------------------------------------------ requests


async def test_generate_streams_and_coalesces_per_step():
    async with serving(FakeEngine(step_interval=0.005)) as (eng, server, addr):
        c = await RawClient.open(addr)
        ids = {f"r{i}" for i in range(32)}
        # Hold the engine until all 32 are submitted (the Health reply comes after them), so
        # they run in lockstep.
        eng.paused = True
        await c.stream.send(c.codec.encode_many(
            [Generate(request_id=i, prompt="a b c", params=SamplingParams(max_tokens=10)) for i in sorted(ids)]
            + [HealthRequest(call_id=1)]))
        assert (await c.recv()).running == 32
        eng.paused = False
        outs, frames, other = await c.collect(ids)
        assert not other
        for rid, pieces in outs.items():
            assert [p.token_ids[0] for p in pieces] == list(range(1, 11))
            assert [p.finished for p in pieces] == [False] * 9 + [True]
            assert pieces[-1].finish_reason == "length" and pieces[-1].num_prompt_tokens == 3
        # One Outputs frame per engine step, holding the whole step.
        assert sum(frames) == 320
        assert len(frames) == eng.steps == 10 and frames == [32] * 10
        await c.aclose()


async def test_request_ids_are_per_connection():
    async with serving() as (eng, server, addr):
        a, b = await RawClient.open(addr), await RawClient.open(addr)
        for c, n in ((a, 3), (b, 5)):
            await c.send(Generate(request_id="same", prompt=[1], params=SamplingParams(max_tokens=n)))
        (oa, _, _), (ob, _, _) = await a.collect({"same"}), await b.collect({"same"})
        assert len(oa["same"]) == 3 and len(ob["same"]) == 5
        assert len(set(eng.submitted)) == 2 and "same" not in eng.submitted
        await a.aclose()
        await b.aclose()


async def test_duplicate_request_id_and_bad_params():
    async with serving() as (eng, server, addr):
        c = await RawClient.open(addr)
        eng.paused = True
        await c.send(Generate(request_id="x", prompt=[1], params=SamplingParams(max_tokens=2)))
        await c.send(Generate(request_id="x", prompt=[1]))
        err = await c.recv()
        assert isinstance(err, Error) and err.kind is ErrorKind.BAD_REQUEST and err.request_id == "x"
        assert not err.fatal
        await c.send(Generate(request_id="y", prompt=[1], params=SamplingParams(max_tokens=0)))
        err = await c.recv()
        assert err.kind is ErrorKind.BAD_REQUEST and err.request_id == "y" and "max_tokens" in err.message
        eng.paused = False
        outs, _, _ = await c.collect({"x"})
        assert outs["x"][-1].finished
        # The id is free again once finished.
        await c.send(Generate(request_id="x", prompt=[1], params=SamplingParams(max_tokens=1)))
        outs, _, _ = await c.collect({"x"})
        assert len(outs["x"]) == 1
        await c.aclose()


async def test_abort_with_ack():
    async with serving() as (eng, server, addr):
        c = await RawClient.open(addr)
        await c.send(Generate(request_id="long", prompt=[1], params=SamplingParams(max_tokens=10_000)))
        first = await c.recv()
        assert isinstance(first, Outputs)
        await c.send(Abort(request_id="long", call_id=11))
        await c.send(Abort(request_id="unknown", call_id=12))
        outs, _, other = await c.collect({"long"})
        assert outs["long"][-1].finish_reason == "abort"
        while len([m for m in other if isinstance(m, Ack)]) < 2:
            other.append(await c.recv())
        acks = {m.call_id: m for m in other if isinstance(m, Ack)}
        assert acks[11].request_id == "long" and acks[12].request_id == "unknown"
        assert eng.aborted[0][1] == "aborted by client"
        await c.aclose()


async def test_health():
    async with serving() as (eng, server, addr):
        c = await RawClient.open(addr)
        await c.send(HealthRequest(call_id=3))
        h = await c.recv()
        assert h == Health(state=State.SERVING, live=True, ready=True, running=0, waiting=0,
                           kv_usage=0.0, call_id=3)
        await c.aclose()


# ------------------------------------------------------------------------------ isolation


async def test_disconnect_aborts_only_that_clients_requests():
    async with serving() as (eng, server, addr):
        a, b = await RawClient.open(addr), await RawClient.open(addr)
        for c in (a, b):
            await c.send(Generate(request_id="r", prompt=[1], params=SamplingParams(max_tokens=10_000)))
            assert isinstance(await c.recv(), Outputs)
        await a.aclose()
        with anyio.fail_after(3):
            while not eng.aborted:
                await anyio.sleep(0.01)
        assert [reason for _, reason in eng.aborted] == ["client disconnected"]
        assert len(eng.requests) == 1  # b's request still runs
        assert isinstance(await b.recv(), Outputs)
        await b.aclose()


@pytest.mark.parametrize("bad", ["garbage", "oversize", "hello-again", "engine-message", "zero"])
async def test_bad_frame_closes_only_that_connection(bad):
    async with serving(max_frame=4096) as (eng, server, addr):
        a, b = await RawClient.open(addr), await RawClient.open(addr)
        for c in (a, b):
            await c.send(Generate(request_id="r", prompt=[1], params=SamplingParams(max_tokens=10_000)))
        if bad == "garbage":
            await a.stream.send(struct.pack(">I", 3) + b"\x93\x01\x02")
            kind = ErrorKind.PROTOCOL
        elif bad == "oversize":
            await a.stream.send(struct.pack(">I", 4097))  # and no body: must not wait for it
            kind = ErrorKind.TOO_LARGE
        elif bad == "zero":
            await a.stream.send(b"\x00\x00\x00\x00")
            kind = ErrorKind.PROTOCOL
        elif bad == "hello-again":
            await a.send(Hello(protocol_version=PROTOCOL_VERSION))
            kind = ErrorKind.PROTOCOL
        else:
            await a.send(StateChanged(state=State.SERVING))
            kind = ErrorKind.PROTOCOL
        msgs = await a.recv_until_closed()
        errors = [m for m in msgs if isinstance(m, Error)]
        assert [e.kind for e in errors] == [kind] and errors[0].fatal and msgs[-1] is errors[0]
        with anyio.fail_after(3):
            while not eng.aborted:
                await anyio.sleep(0.01)
        assert len(eng.requests) == 1 and len(server.connections) == 1
        assert isinstance(await b.recv(), Outputs)
        c = await RawClient.open(addr)  # still accepting
        await c.aclose()
        await b.aclose()


async def test_client_that_stops_reading_is_dropped():
    eng = FakeEngine(step_interval=0.001, text_size=256 * 1024)
    async with serving(eng, send_timeout=0.3) as (eng, server, addr):
        slow = await RawClient.open(addr)
        ok = await RawClient.open(addr)
        await slow.send(Generate(request_id="s", prompt=[1], params=SamplingParams(max_tokens=100_000)))
        with anyio.fail_after(10):
            while not eng.aborted:
                await anyio.sleep(0.05)
        assert eng.aborted == [(eng.submitted[0], "client disconnected")]
        await ok.send(HealthRequest(call_id=1))
        assert isinstance(await ok.recv(), Health)
        await ok.aclose()
        await slow.aclose()


async def test_outbox_limit_drops_the_client():
    eng = FakeEngine(step_interval=0.001, text_size=64 * 1024)
    # The client never reads: the socket fills, the sender blocks, the outbox passes its limit.
    async with serving(eng, send_timeout=30, max_outbox=64) as (eng, server, addr):
        slow = await RawClient.open(addr)
        await slow.stream.send(slow.codec.encode_many(
            [Generate(request_id=f"s{i}", prompt=[1], params=SamplingParams(max_tokens=100_000))
             for i in range(16)]))
        with anyio.fail_after(10):
            while len(eng.aborted) < 16:
                await anyio.sleep(0.05)
        assert not server.connections
        await slow.aclose()


# ------------------------------------------------------------------------------ lifecycle


async def test_drain_over_ipc_then_server_exits_and_removes_socket():
    d, addr = short_unix_address()
    try:
        eng = FakeEngine()
        async with anyio.create_task_group() as tg:
            tg.start_soon(eng.run)
            bound = await tg.start(serve_ipc, eng, addr)
            assert bound == addr and os.path.exists(addr[len("unix://"):])
            a, b = await RawClient.open(addr), await RawClient.open(addr)
            await a.send(Generate(request_id="r", prompt=[1], params=SamplingParams(max_tokens=30)))
            assert isinstance(await a.recv(), Outputs)
            await b.send(Drain(timeout=30, call_id=5))
            # Everybody hears about it; new work is refused with a retry hint.
            for c in (a, b):
                msg = await c.recv()
                while not isinstance(msg, StateChanged):
                    msg = await c.recv()
                assert msg == StateChanged(state=State.DRAINING, previous=State.SERVING)
            await b.send(Generate(request_id="late", prompt=[1]))
            err = await b.recv()
            assert err.kind is ErrorKind.DRAINING and err.retry_after == 2.5 and err.request_id == "late"
            # The in-flight request finishes normally, then the engine shuts down.
            outs, _, _ = await a.collect({"r"})
            assert outs["r"][-1].finish_reason == "length" and len(outs["r"]) >= 29
            rest_b = await b.recv_until_closed()
            assert StateChanged(state=State.SHUTDOWN, previous=State.DRAINING) in rest_b
            assert rest_b[-1] == Ack(call_id=5, state=State.SHUTDOWN)
            rest_a = await a.recv_until_closed()
            assert rest_a == [StateChanged(state=State.SHUTDOWN, previous=State.DRAINING)]
        # serve_ipc returned by itself (the task group exited) and cleaned up.
        assert not os.path.exists(addr[len("unix://"):])
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_shutdown_over_ipc_aborts_and_closes_everyone():
    eng = FakeEngine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(eng.run)
        addr = await tg.start(serve_ipc, eng, "tcp://127.0.0.1:0")
        a, b = await RawClient.open(addr), await RawClient.open(addr)
        await a.send(Generate(request_id="r", prompt=[1], params=SamplingParams(max_tokens=100_000)))
        assert isinstance(await a.recv(), Outputs)
        await b.send(Shutdown(call_id=1))
        rest_a = await a.recv_until_closed()
        finals = [o for m in rest_a if isinstance(m, Outputs) for o in m.outputs if o.finished]
        assert [o.finish_reason for o in finals] == ["abort"]
        rest_b = await b.recv_until_closed()
        assert rest_b[-1] == Ack(call_id=1, state=State.SHUTDOWN)
    assert eng.state is State.SHUTDOWN


async def test_engine_draining_by_itself_notifies_and_closes():
    eng = FakeEngine()
    async with serving(eng) as (eng, server, addr):
        c = await RawClient.open(addr)
        eng.lifecycle.trigger("drain")  # no requests: the loop shuts down at once
        msgs = await c.recv_until_closed()
        assert msgs[-1] == StateChanged(state=State.SHUTDOWN, previous=State.DRAINING)


async def test_engine_death_reports_dead_per_request():
    eng = FakeEngine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(eng.run)
        addr = await tg.start(serve_ipc, eng, "tcp://127.0.0.1:0")
        c = await RawClient.open(addr)
        await c.send(Generate(request_id="r", prompt=[1], params=SamplingParams(max_tokens=100_000)))
        assert isinstance(await c.recv(), Outputs)
        eng.die(RuntimeError("device lost"))
        msgs = [m for m in await c.recv_until_closed() if not isinstance(m, Outputs)]
        assert msgs[0] == StateChanged(state=State.FAILED, previous=State.SERVING)
        err = msgs[1]
        assert err.kind is ErrorKind.DEAD and err.request_id == "r" and "device lost" in err.message
        assert msgs[2] == StateChanged(state=State.SHUTDOWN, previous=State.FAILED)


async def test_cancelling_the_server_aborts_inflight_requests():
    eng = FakeEngine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(eng.run)
        server_scope = anyio.CancelScope()

        async def run_server(task_status):
            with server_scope:
                await serve_ipc(eng, "tcp://127.0.0.1:0", task_status=task_status)

        addr = await tg.start(run_server)
        c = await RawClient.open(addr)
        await c.send(Generate(request_id="r", prompt=[1], params=SamplingParams(max_tokens=100_000)))
        assert isinstance(await c.recv(), Outputs)
        server_scope.cancel()
        await c.recv_until_closed()
        assert eng.aborted and eng.aborted[0][1] == "client disconnected"
        assert eng.state is State.SERVING  # the server never shuts the engine down itself
        tg.cancel_scope.cancel()


# ------------------------------------------------------------------------------ the real engine


@pytest.mark.slow
async def test_real_engine_over_unix_socket():
    from engine import AsyncEngine, EngineConfig

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = {f"p{i}": [(5 * i + j) % 200 + 1 for j in range(3 + i)] for i in range(6)}
    d, addr = short_unix_address()
    try:
        async with AsyncEngine.open(EngineConfig(model="random:tiny-llama")) as eng:
            expected = {}
            for rid, p in prompts.items():
                toks = []
                async for out in eng.generate(p, params):
                    toks += out.token_ids
                expected[rid] = toks
            async with anyio.create_task_group() as tg:
                await tg.start(serve_ipc, eng, addr)
                a, b = await RawClient.open(addr), await RawClient.open(addr)
                assert a.welcome.model == "random:tiny-llama"
                for rid, p in prompts.items():
                    await (a if int(rid[1:]) % 2 else b).send(Generate(request_id=rid, prompt=p, params=params))
                got = {}
                for c, ids in ((a, {r for r in prompts if int(r[1:]) % 2}),
                               (b, {r for r in prompts if not int(r[1:]) % 2})):
                    outs, frames, other = await c.collect(ids, timeout=60)
                    assert not other
                    for rid, pieces in outs.items():
                        got[rid] = [t for p in pieces for t in p.token_ids]
                        assert pieces[-1].finished and pieces[-1].num_output_tokens == 8
                    assert len(frames) < sum(len(v) for v in outs.values())  # coalesced
                assert got == expected
                await a.send(HealthRequest(call_id=1))
                h = await a.recv()
                assert h.state is State.SERVING and h.ready and h.running == 0
                await a.send(Drain(timeout=5, call_id=2))
                rest = await a.recv_until_closed(timeout=30)
                assert rest[-1] == Ack(call_id=2, state=State.SHUTDOWN)
                await b.recv_until_closed(timeout=30)
            assert eng.state is State.SHUTDOWN
        assert not os.path.exists(addr[len("unix://"):])
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_output_too_large_for_a_frame_ends_only_that_request():
    eng = FakeEngine(text_size=8192)
    async with serving(eng, max_frame=4096) as (eng, server, addr):
        c = await RawClient.open(addr)
        await c.send(Generate(request_id="big", prompt=[1], params=SamplingParams(max_tokens=100)))
        err = await c.recv()
        assert err.kind is ErrorKind.TOO_LARGE and err.request_id == "big" and not err.fatal
        with anyio.fail_after(3):
            while not eng.aborted:
                await anyio.sleep(0.01)
        assert eng.aborted[0][1] == "output exceeds the frame limit"
        eng.text_size = 0
        await c.send(Generate(request_id="big", prompt=[1], params=SamplingParams(max_tokens=2)))
        outs, _, other = await c.collect({"big"})
        assert not other and [o.token_ids for o in outs["big"]] == [[1], [2]]

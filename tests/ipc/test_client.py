"""``EngineClient`` against ``serve_ipc`` + the fake engine (fast, deterministic)."""

from __future__ import annotations

from contextlib import asynccontextmanager
import gc

import anyio
from fake_engine import FakeEngine
import pytest

from engine.errors import BadRequestError, EngineDeadError, EngineDrainingError, EngineShutdownError
from engine.loader.tokenizer import Tokenizer
from engine.params import SamplingParams
from ipc.client import EngineClient
from ipc.errors import AuthError, ConnectionClosed
from ipc.server import IPCServer
from states import State

pytestmark = pytest.mark.asyncio


@asynccontextmanager
async def serving(engine: FakeEngine | None = None, **kw):
    engine = engine or FakeEngine()
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.run)
        server = IPCServer(engine, "tcp://127.0.0.1:0", **kw)
        scope = anyio.CancelScope()

        async def run(task_status):
            with scope:
                await server.serve(task_status=task_status)

        addr = await tg.start(run)
        server.scope = scope
        yield engine, server, addr
        tg.cancel_scope.cancel()


async def collect(stream) -> list:
    return [out async for out in stream]


async def wait_for(cond, timeout: float = 3.0) -> None:
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.005)


async def test_generate_streams_like_the_engine():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        assert c.state is State.SERVING and c.model == "fake:counter"
        streams = [c.generate([1, 2, 3], SamplingParams(max_tokens=5 + i)) for i in range(20)]
        assert len({s.request_id for s in streams}) == 20
        results = {}

        async def run(s):
            results[s.request_id] = await collect(s)

        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(run, s)
        for i, s in enumerate(streams):
            outs = results[s.request_id]
            assert [o.token_ids for o in outs] == [[k] for k in range(1, 6 + i)]
            assert all(o.request_id == s.request_id for o in outs)
            assert outs[-1].finished and outs[-1].finish_reason == "length"
            assert outs[-1].num_prompt_tokens == 3
        done = await c.complete("a b", SamplingParams(max_tokens=3), request_id="mine")
        assert (done.request_id, done.token_ids, done.text, done.finish_reason) == \
            ("mine", [1, 2, 3], "<1><2><3>", "length")
        assert done.num_output_tokens == 3 and done.finished
        h = await c.health()
        assert h.state is State.SERVING and h.ready and h.running == 0 and h.call_id is None


async def test_many_streams_one_frame_per_step():
    async with serving(FakeEngine(step_interval=0.001)) as (eng, server, addr):
        async with EngineClient.connect(addr) as c:
            eng.paused = True
            streams = [c.generate([1], SamplingParams(max_tokens=50)) for _ in range(256)]
            await wait_for(lambda: len(eng.requests) == 256)
            eng.paused = False
            got = {}

            async def run(s):
                got[s.request_id] = [o.token_ids[0] async for o in s]

            async with anyio.create_task_group() as tg:
                for s in streams:
                    tg.start_soon(run, s)
            assert all(v == list(range(1, 51)) for v in got.values()) and len(got) == 256
            assert eng.step_sizes[:50] == [256] * 50


async def test_errors_surface_eagerly_or_on_first_next():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        with pytest.raises(BadRequestError, match="max_tokens"):
            c.generate([1], SamplingParams(max_tokens=0))
        with pytest.raises(BadRequestError, match="token ids"):
            c.generate([-1])
        with pytest.raises(BadRequestError, match="token ids"):
            c.generate([True])
        with pytest.raises(BadRequestError, match="prompt must be"):
            c.generate({"not": "a prompt"})  # type: ignore[arg-type]
        with pytest.raises(BadRequestError, match="request_id"):
            c.generate([1], request_id="")
        with pytest.raises(BadRequestError, match="stop must be"):
            c.generate([1], SamplingParams(stop="not a list"))  # type: ignore[arg-type]
        # Refused by the engine: raised by the first __anext__.
        s = c.generate("", SamplingParams(max_tokens=2))
        with pytest.raises(BadRequestError, match="empty prompt"):
            await s.__anext__()
        with pytest.raises(StopAsyncIteration):
            await s.__anext__()
        eng.paused = True
        s1 = c.generate([1], request_id="dup")
        with pytest.raises(BadRequestError, match="already in flight"):
            c.generate([1], request_id="dup")
        eng.paused = False
        assert len(await collect(s1)) == 16
        # The connection survived all of it.
        assert (await c.complete([1], SamplingParams(max_tokens=2))).token_ids == [1, 2]
        assert len(server.connections) == 1


async def test_leaving_a_stream_aborts_it():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        s = c.generate([1], SamplingParams(max_tokens=100_000), request_id="r")
        async for _ in s:
            break
        await s.aclose()
        await wait_for(lambda: eng.aborted)
        assert eng.aborted[-1][1] == "aborted by client" and not eng.requests
        # Dropped without aclose: garbage collection aborts it.
        s = c.generate([1], SamplingParams(max_tokens=100_000))
        await s.__anext__()
        del s
        gc.collect()
        await wait_for(lambda: len(eng.aborted) == 2)
        assert not eng.requests
        # The id is free again once the engine has finished it.
        await wait_for(lambda: "r" not in c._requests)
        assert len(await collect(c.generate([1], SamplingParams(max_tokens=3), request_id="r"))) == 3


async def test_a_reader_cancelled_while_waiting_aborts_its_request():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        s = c.generate([1], SamplingParams(max_tokens=100_000), request_id="r")
        await s.__anext__()
        eng.paused = True  # nothing more comes: the reader waits

        async def read():
            async for _ in s:
                pass

        with anyio.move_on_after(0.1):
            await read()
        await wait_for(lambda: eng.aborted)
        assert eng.aborted[-1][1] == "aborted by client" and s.finished
        eng.paused = False


async def test_reusing_an_id_while_its_abort_is_pending():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        eng.paused = True
        s = c.generate([1], request_id="x")
        s.cancel()
        with pytest.raises(BadRequestError, match="already in flight"):
            c.generate([1], request_id="x")  # like the in-process engine until the abort lands
        eng.paused = False
        await wait_for(lambda: "x" not in c._requests)
        outs = await collect(c.generate([1], SamplingParams(max_tokens=2), request_id="x"))
        assert [o.token_ids for o in outs] == [[1], [2]]  # none of the aborted request's pieces


async def test_abort_delivers_the_final_piece():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        s = c.generate([1], SamplingParams(max_tokens=100_000), request_id="a")
        await s.__anext__()
        await c.abort("a")
        await c.abort("unknown")
        outs = await collect(s)
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert outs[-1].reason == "aborted by client"


async def test_drain_by_another_client():
    async with serving() as (eng, server, addr):
        async with EngineClient.connect(addr) as a, EngineClient.connect(addr) as b:
            s = a.generate([1], SamplingParams(max_tokens=30))
            await s.__anext__()
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.drain, 30)
                await wait_for(lambda: a.state is State.DRAINING)
                with pytest.raises(EngineDrainingError):
                    a.generate([1])
                outs = await collect(s)  # the in-flight request finishes normally
                assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 30
            assert b.state is State.SHUTDOWN
            await wait_for(lambda: a.closed and b.closed)
            assert a.state is State.SHUTDOWN
            for call in (a.health, b.shutdown, lambda: b.drain(1)):
                with pytest.raises(EngineShutdownError):
                    await call()
            with pytest.raises(EngineShutdownError):
                a.generate([1])
    assert eng.state is State.SHUTDOWN


async def test_shutdown_aborts_running_requests():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        s = c.generate([1], SamplingParams(max_tokens=100_000))
        await s.__anext__()
        await c.shutdown()
        outs = await collect(s)
        assert outs[-1].finish_reason == "abort"
        assert c.state is State.SHUTDOWN


async def test_engine_failure_reports_dead():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        s = c.generate([1], SamplingParams(max_tokens=100_000))
        await s.__anext__()
        eng.die(RuntimeError("device lost"))
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(s)
        await wait_for(lambda: c.closed)
        with pytest.raises(EngineDeadError):
            c.generate([1])
        with pytest.raises(EngineDeadError):
            await c.health()


async def test_lost_connection_fails_everything_at_once():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        streams = [c.generate([1], SamplingParams(max_tokens=100_000)) for _ in range(5)]
        for s in streams:
            await s.__anext__()
        errors = []

        async def run(s):
            try:
                await collect(s)
            except EngineDeadError as exc:
                errors.append((anyio.current_time(), exc))

        async def health_or_dead():
            try:
                await c.health()
            except EngineDeadError:
                pass

        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(run, s)
            tg.start_soon(health_or_dead)  # may or may not get its answer first
            await anyio.sleep(0.05)
            t0 = anyio.current_time()
            server.scope.cancel()  # connections close; the engine never said it shut down
        assert len(errors) == 5 and max(t for t, _ in errors) - t0 < 1.0
        assert "lost the connection" in str(errors[0][1])
        assert c.state is State.FAILED and c.closed
        with pytest.raises(EngineDeadError):
            c.generate([1])
        for call in (c.health, c.shutdown, c.drain):
            with pytest.raises(EngineDeadError):
                await call()
        await c.abort("anything")  # like the in-process engine: not an error


async def test_closing_the_client_ends_its_streams():
    async with serving() as (eng, server, addr):
        async with EngineClient.connect(addr) as c:
            s = c.generate([1], SamplingParams(max_tokens=100_000))
            await s.__anext__()
        with pytest.raises(ConnectionClosed):
            await collect(s)
        with pytest.raises(ConnectionClosed):
            c.generate([1])
        await wait_for(lambda: eng.aborted)
        assert eng.aborted[0][1] == "client disconnected"


async def test_body_exception_is_not_wrapped():
    async with serving() as (eng, server, addr):
        with pytest.raises(KeyError):
            async with EngineClient.connect(addr):
                raise KeyError("mine")


async def test_wrong_token():
    async with serving(token="s3cret") as (eng, server, addr):
        with pytest.raises(AuthError):
            async with EngineClient.connect(addr, token="nope"):
                pass
        async with EngineClient.connect(addr, token="s3cret") as c:
            assert (await c.complete([1], SamplingParams(max_tokens=1))).token_ids == [1]


async def test_welcome_describes_the_model_and_chat_template_renders_client_side():
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok = Tokenizer.bytes(300)
    tok.chat_template = template
    eng = FakeEngine(tokenizer=tok, max_model_len=1234)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with serving(eng) as (eng, server, addr), EngineClient.connect(addr) as c:
        w = c.welcome
        assert (w.chat_template, w.bos_token, w.eos_token) == (template, "<s>", "</s>")
        assert c.max_model_len == 1234 and c.vocab_size == 300
        for gen in (True, False):
            assert await c.apply_chat_template(messages, gen) == tok.apply_chat_template(messages, gen)
        assert (await c.apply_chat_template(messages)).startswith("<s><|system|>be brief</s>")
        with pytest.raises(BadRequestError, match="token ids"):
            c.generate([300])  # checked against the vocabulary from the handshake
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        assert c.welcome.chat_template is None and c.vocab_size == 0
        assert await c.apply_chat_template(messages) == "system: be brief\nuser: hi\nassistant: "


async def test_outer_cancellation_closes_the_client_quietly():
    async with serving() as (eng, server, addr):
        with anyio.move_on_after(0.2) as scope:
            async with EngineClient.connect(addr) as c:
                s = c.generate([1], SamplingParams(max_tokens=100_000))
                async for _ in s:  # cancelled in here
                    pass
        assert scope.cancelled_caught and c.closed
        await wait_for(lambda: eng.aborted)
        assert not eng.requests


async def test_cancelled_stream_stops_at_once():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        s = c.generate([1], SamplingParams(max_tokens=100_000))
        await s.__anext__()
        await anyio.sleep(0.05)  # more pieces are queued now
        s.cancel()
        with pytest.raises(StopAsyncIteration):
            await s.__anext__()


async def test_import_ipc_does_not_import_torch():
    import sys

    code = ("import sys, ipc, ipc.client, ipc.sync_client, ipc.spawn, ipc.server\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "from engine import SamplingParams, EngineDeadError, RequestOutput\n"
            "assert 'torch' not in sys.modules\n"
            "from engine import AsyncEngine, EngineConfig\n"
            "assert 'torch' in sys.modules\n")
    with anyio.fail_after(120):
        await anyio.run_process([sys.executable, "-c", code])  # raises on a failed assert


async def test_engine_admission_limit_reaches_the_client_typed_and_retryable():
    from engine.errors import EngineOverloadedError

    class Full(FakeEngine):
        def submit(self, prompt, params, request_id, sink, client=""):
            if len(self.requests) >= 2:
                raise EngineOverloadedError("too many waiting requests (max 2)", retry_after=0.75)
            return super().submit(prompt, params, request_id, sink, client)

    async with serving(Full()) as (eng, server, addr), EngineClient.connect(addr) as c:
        running = [c.generate([1], SamplingParams(max_tokens=100_000)) for _ in range(2)]
        for s in running:
            await s.__anext__()
        with pytest.raises(EngineOverloadedError, match="max 2") as info:
            await collect(c.generate([1]))
        assert info.value.retry_after == 0.75 and info.value.retryable
        assert c.state is State.SERVING and not c.closed  # the connection is fine
        for s in running:
            await s.aclose()


async def test_client_is_an_engine_and_reports_state_changes():
    from engine.interface import Engine

    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        assert isinstance(c, Engine) and isinstance(eng, Engine)
        seen = []
        c.on_state_change(lambda old, new: seen.append((old, new)))
        assert c.model == "fake:counter" and c.tokenizer_info().chat_template is None
        await c.drain(5)
        with anyio.fail_after(3):
            await c.wait_stopped()
        assert seen == [(State.SERVING, State.DRAINING), (State.DRAINING, State.SHUTDOWN)]


async def test_abort_reason_travels_to_the_engine():
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        s = c.generate([1], SamplingParams(max_tokens=100_000), request_id="r")
        await s.__anext__()
        await c.abort("r", reason="user pressed stop")
        outs = await collect(s)
        assert outs[-1].finish_reason == "abort" and outs[-1].reason == "user pressed stop"

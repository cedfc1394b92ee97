"""The RL-loop calls over IPC (ipc/control.py): pause / resume / abort_all / weight_info /
weight transfer against the fake engine (every argument reaches it, bad ones are refused at
the client naming the field), and pause keep -> resume and abort_all against the real engine."""

from __future__ import annotations

import anyio
from fake_engine import FakeEngine
import pytest
from test_client import serving

from engine import AsyncEngine, BadRequestError, EngineConfig, SamplingParams
from engine.errors import EnginePausedError
from engine.weight_ipc import IpcHandles, IpcStorage, IpcTensor
from ipc.client import EngineClient
from ipc.server import IPCServer
from states import State

pytestmark = pytest.mark.asyncio

IPC_STORAGE = IpcStorage(0, b"\x01" * 64, 4096, 0, b"/torch_1_2_3", 0, b"\x02" * 64, True)


async def test_control_calls_reach_the_engine_with_their_arguments() -> None:
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        await c.pause("keep", 2.5)
        assert c.is_paused() and eng.state is State.PAUSED
        assert ("pause", "keep", 2.5) in eng.calls
        info = await c.weight_info()
        assert info == [("model.embed_tokens.weight", (256, 64), "float32"),
                        ("model.norm.weight", (64,), "float32")]
        await c.init_weight_transfer("gloo", "127.0.0.1", 29500, 1, 2)
        await c.update_weights_from_distributed([("model.norm.weight", (64,), "float32")], 3)
        assert ("update_weights_from_distributed", [("model.norm.weight", [64], "float32")], 3) \
            in eng.calls
        await c.update_weights_from_ipc(IpcHandles(pid=7, storages=[IPC_STORAGE], tensors=[
            IpcTensor("model.norm.weight", "float32", [64], [1], 0, 0)]), 4)
        assert ("update_weights_from_ipc", ["model.norm.weight"], 4) in eng.calls
        with pytest.raises(BadRequestError, match="past its storage"):  # checked in the engine
            await c.update_weights_from_ipc(IpcHandles(pid=7, storages=[IPC_STORAGE], tensors=[
                IpcTensor("model.norm.weight", "float32", [64], [1], 1000, 0)]))
        await c.close_weight_transfer()
        await c.resume()
        assert eng.state is State.SERVING and not c.is_paused()
        s = c.generate([1, 2, 3], SamplingParams(max_tokens=1000))
        async for _ in s:
            break
        assert await c.abort_all("done") == 1
        await c.sleep(1, tags=["kv_cache"])
        assert ("sleep", 1, "abort", None, ["kv_cache"]) in eng.calls


async def test_bad_control_arguments_are_refused_at_the_client_naming_them() -> None:
    async with serving() as (eng, server, addr), EngineClient.connect(addr) as c:
        for call, what in [(c.pause("freeze"), "mode"), (c.pause("wait", -1), "timeout"),
                           (c.init_weight_transfer("mpi", "h", 1, 1, 2), "backend"),
                           (c.init_weight_transfer("gloo", "h", 0, 1, 2), "port"),
                           (c.init_weight_transfer("gloo", "h", 1, 0, 2), "rank"),
                           (c.update_weights_from_distributed([]), "metadata"),
                           (c.update_weights_from_distributed([("x", [-1], "float32")]), "metadata"),
                           (c.update_weights_from_distributed([("x", [1], "float32")], -2), "version"),
                           (c.update_weights_from_ipc(IpcHandles(pid=7, storages=[IPC_STORAGE],
                                                                 tensors=[])), "tensors"),
                           (c.abort_all("x" * 300), "reason")]:
            with pytest.raises(BadRequestError, match=what):
                await call
        assert eng.calls == []


async def test_pause_keep_and_abort_all_over_ipc_on_the_real_engine() -> None:
    cfg = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    async with AsyncEngine.open(cfg) as eng, anyio.create_task_group() as tg:
        want = [t async for o in eng.generate([5, 6, 7, 8], params) for t in o.token_ids]
        server = IPCServer(eng, "tcp://127.0.0.1:0")
        addr = await tg.start(lambda task_status: server.serve(task_status=task_status))
        async with EngineClient.connect(addr) as c:
            got: list[int] = []
            first = anyio.Event()

            async def consume() -> None:
                async for o in c.generate([5, 6, 7, 8], params):
                    got.extend(o.token_ids)
                    first.set()

            async with anyio.create_task_group() as inner:
                inner.start_soon(consume)
                await first.wait()
                await c.pause("keep")
                assert eng.state is State.PAUSED
                frozen = len(got)
                await anyio.sleep(0.2)
                assert len(got) == frozen < 40
                await c.resume()
            assert got == want  # nothing lost or repeated across the pause
            outs = []

            async def partial() -> None:
                async for o in c.generate([9, 10, 11], SamplingParams(max_tokens=4000,
                                                                      ignore_eos=True)):
                    outs.append(o)

            async with anyio.create_task_group() as inner:
                inner.start_soon(partial)
                while not outs:
                    await anyio.sleep(0.01)
                assert await c.abort_all("rollout over") == 1
            assert outs[-1].finish_reason == "abort" and outs[-1].reason == "rollout over"
        tg.cancel_scope.cancel()


async def test_reject_while_paused_is_a_typed_retryable_error_over_ipc() -> None:
    eng = FakeEngine()
    async with serving(eng) as (eng, server, addr), EngineClient.connect(addr) as c:
        await c.pause()
        eng.reject = True  # the fake's stand-in for reject_while_paused
        with pytest.raises(EnginePausedError):
            async for _ in c.generate([1], SamplingParams(max_tokens=2)):
                pass

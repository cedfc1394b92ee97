"""CUDA-IPC weight updates on one GPU (engine/weight_ipc.py): a trainer child process (subprocess,
msgpack frames over its pipes: bench/ipc_trainer.py) holds seeded random weights on the GPU and
exports their handles -- its own tensors, or one flat buffer per dtype -- and the engine, paused,
updates from them: its weights then equal the trainer's bit for bit, its greedy outputs equal an
engine given the same weights by ``update_weights_from_tensors``; the trainer gets all of its
memory back once the engine let go, and the engine's ``memory_allocated`` is back to where it was
before load after shutdown. The same in one process (the handles of our own tensors) and over
the IPC control channel. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from engine import AsyncEngine, BadRequestError, EngineConfig, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.asyncio,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT = list(range(100, 140))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cfg(model: str = "random:tiny-llama") -> EngineConfig:
    return EngineConfig(model=model, device="cuda", dtype="bfloat16",
                        kv_cache_bytes=256 * 2**20, max_num_seqs=4)


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


async def _greedy(eng) -> list[int]:
    return [t async for o in eng.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
            for t in o.token_ids]


def _params(eng) -> dict[str, torch.Tensor]:
    return dict(eng.runner.resource("weights").named_parameters())


def _assert_weights(eng, want: dict[str, torch.Tensor]) -> None:
    params = _params(eng)
    checked = [n for n in want if n in params]  # fused ones are checked through the outputs
    assert checked
    for name in checked:
        assert torch.equal(params[name].detach(), want[name].to(params[name].device)), name


async def _reference(model: str, spec, seed: int) -> list[int]:
    from bench.ipc_trainer import trainer_weights

    async with AsyncEngine.open(cfg(model)) as ref:
        await ref.pause()
        await ref.update_weights_from_tensors(trainer_weights(spec, seed))
        await ref.resume()
        return await _greedy(ref)


@pytest.fixture(autouse=True)
def _bench_importable(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.mark.parametrize("mode", ["tensors", "bucket"])
async def test_a_trainer_process_updates_the_engine_through_ipc_handles(mode) -> None:
    from bench.ipc_trainer import TrainerProcess, trainer_weights

    torch.empty(1, device="cuda")
    base = _allocated()
    model, seed = "random:tiny-llama", 11
    async with AsyncEngine.open(cfg(model)) as eng:
        spec = eng.weight_info()
        before = await _greedy(eng)
        trainer = TrainerProcess(spec, seed, mode)
        try:
            handles, export_s = trainer.export()
            print(f"\n{mode}: {len(handles.tensors)} tensors on {len(handles.storages)} storages, "
                  f"export {export_s * 1e3:.1f} ms")
            if mode == "bucket":
                assert len(handles.storages) == len({d for _, _, d in spec})
            await eng.pause("keep")
            await eng.update_weights_from_ipc(handles, version=3)
            await eng.resume()
            _assert_weights(eng, trainer_weights(spec, seed))
            after = await _greedy(eng)
            assert after != before
            assert eng.weight_version == 3
            # a second round from the same trainer (handles opened again, let go again)
            handles, _ = trainer.export()
            await eng.pause()
            await eng.update_weights_from_ipc(handles)
            await eng.resume()
            assert await _greedy(eng) == after and eng.weight_version == 4
            left = trainer.close()
            print(f"trainer's CUDA bytes after it let go: {left}")
            assert left == 0  # the engine holds no reference to the trainer's memory
        finally:
            trainer.kill()
    assert _allocated() == base
    assert after == await _reference(model, spec, seed)
    assert _allocated() == base


async def test_the_handles_of_this_process_and_refusals_on_the_gpu() -> None:
    from bench.ipc_trainer import trainer_weights
    from engine.weight_ipc import export_cuda_ipc

    base = _allocated()
    async with AsyncEngine.open(cfg()) as eng:
        spec = eng.weight_info()
        mine = trainer_weights(spec, 5)
        await eng.pause()
        await eng.update_weights_from_ipc(export_cuda_ipc(mine), version=1)
        _assert_weights(eng, mine)
        # a subset: one tensor, the rest unchanged
        name = spec[0][0]
        one = {name: mine[name] * 2}
        await eng.update_weights_from_ipc(export_cuda_ipc(one))
        _assert_weights(eng, {**mine, **one})
        wrong = {name: mine[name].float()} if mine[name].dtype != torch.float32 else \
            {name: mine[name].half()}
        with pytest.raises(BadRequestError):
            await eng.update_weights_from_ipc(export_cuda_ipc(wrong))
        _assert_weights(eng, {**mine, **one})
        await eng.resume()
        del mine, one, wrong
    assert _allocated() == base


async def test_over_the_ipc_control_channel() -> None:
    import anyio

    from bench.ipc_trainer import TrainerProcess, trainer_weights
    from ipc.client import EngineClient
    from ipc.server import IPCServer

    async with AsyncEngine.open(cfg()) as eng, anyio.create_task_group() as tg:
        server = IPCServer(eng, "tcp://127.0.0.1:0")
        addr = await tg.start(lambda task_status: server.serve(task_status=task_status))
        async with EngineClient.connect(addr) as client:
            spec = await client.weight_info()
            trainer = TrainerProcess(spec, 21)
            try:
                handles, _ = trainer.export()
                await client.pause("keep")
                await client.update_weights_from_ipc(handles, version=9)
                await client.resume()
                _assert_weights(eng, trainer_weights(spec, 21))
                assert trainer.close() == 0
            finally:
                trainer.kill()
        tg.cancel_scope.cancel()

"""Weights from a trainer over a gloo group (engine/weight_transfer.py): a transfer from a sender
thread or a sender process writes the same weights as ``update_weights_from_tensors``; a plan
that does not fit the model is refused before anything moves; the group leaves no thread behind."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import anyio
from anyio import to_thread
import pytest
import torch

from engine import AsyncEngine, BadRequestError, EngineConfig, SamplingParams
from engine.weight_transfer import Sender, metadata

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("torch_one_thread")]

PROMPT = list(range(20, 50))


def cfg() -> EngineConfig:
    return EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=64, max_num_seqs=4)


def native_threads() -> int:
    """Threads of this process that Python did not start (gloo's, torch's)."""
    import os
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nudged(eng, seed: int) -> dict[str, torch.Tensor]:
    """Every weight, nudged (what a trainer's step would send)."""
    g = torch.Generator().manual_seed(seed)
    params = dict(eng.runner.resource("weights").named_parameters())
    out = {}
    for name, shape, _ in eng.weight_info():
        base = params[name].detach() if name in params else torch.zeros(shape)
        out[name] = (base + 0.05 * torch.randn(shape, generator=g)).contiguous()
    return out


async def greedy(eng) -> tuple[list[int], int]:
    toks, version = [], -1
    async for o in eng.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True)):
        toks += o.token_ids
        version = o.weight_version
    return toks, version


async def test_gloo_transfer_from_a_thread_equals_update_from_tensors() -> None:
    threads = native_threads()
    before = set(threading.enumerate())
    async with AsyncEngine.open(cfg()) as eng:
        original = {n: t.clone() for n, t in eng.runner.resource("weights").state_dict().items()}
        new = nudged(eng, 3)
        await eng.pause()
        await eng.update_weights_from_tensors(new)
        await eng.resume()
        want, _ = await greedy(eng)
        await eng.pause()
        await eng.update_weights_from_tensors(original, version=0)
        await eng.resume()
        assert (await greedy(eng))[0] != want

        port = free_port()
        async with anyio.create_task_group() as tg:
            sender: list[Sender] = []
            tg.start_soon(to_thread.run_sync, lambda: sender.append(Sender("127.0.0.1", port)))
            await eng.init_weight_transfer("gloo", "127.0.0.1", port, rank=1, world_size=2)
        await eng.pause("keep")
        async with anyio.create_task_group() as tg:
            tg.start_soon(to_thread.run_sync, sender[0].send, new)
            await eng.update_weights_from_distributed(metadata(new), version=5,
                                                      bucket_bytes=2**20)
        await eng.resume()
        assert await greedy(eng) == (want, 5)
        sender[0].close()
        await eng.close_weight_transfer()
    # the engine's step thread ends on its own once closed (nothing joins it): give it a moment
    for _ in range(100):
        new = [t.name for t in set(threading.enumerate()) - before
               if t.name != "AnyIO worker thread"]
        if not new:
            break
        time.sleep(0.05)
    assert new == []
    assert native_threads() <= threads


async def test_a_plan_that_does_not_fit_is_refused_before_anything_moves() -> None:
    async with AsyncEngine.open(cfg()) as eng:
        before = await greedy(eng)
        info = eng.weight_info()
        with pytest.raises(BadRequestError, match="init_weight_transfer"):
            await eng.update_weights_from_distributed([(info[0][0], list(info[0][1]), "float32")])
        port = free_port()
        async with anyio.create_task_group() as tg:
            sender: list[Sender] = []
            tg.start_soon(to_thread.run_sync, lambda: sender.append(Sender("127.0.0.1", port)))
            await eng.init_weight_transfer("gloo", "127.0.0.1", port, rank=1, world_size=2)
        await eng.pause()
        name, shape, _ = info[0]
        for meta, what in [([(name, list(shape), "float32"), ("nope", [2], "float32")], "unexpected"),
                           ([(name, [1, 2], "float32")], "shape"),
                           ([(name, list(shape), "bfloat16")], "dtype"),
                           ([(name, list(shape), "complex64")], "dtype must be one of"),
                           ([], "non-empty"), ("x", "non-empty"), ([(name, shape)], "name, shape")]:
            with pytest.raises(BadRequestError, match=what):
                await eng.update_weights_from_distributed(meta)
        await eng.resume()
        assert await greedy(eng) == before
        sender[0].close()


SENDER = r"""
import json, sys, torch
from engine.weight_transfer import Sender
port, seed, meta = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
g = torch.Generator().manual_seed(seed)
tensors = [(n, torch.randn(s, generator=g)) for n, s, _ in meta]
with Sender("127.0.0.1", port) as s:
    s.send(tensors)
"""


async def test_gloo_transfer_from_a_sender_process() -> None:
    async with AsyncEngine.open(cfg()) as eng:
        info = [(n, list(s), d) for n, s, d in eng.weight_info()][:4]
        g = torch.Generator().manual_seed(11)
        tensors = [(n, torch.randn(s, generator=g)) for n, s, _ in info]
        await eng.pause()
        await eng.update_weights_from_tensors(tensors)
        await eng.resume()
        want, _ = await greedy(eng)
        await eng.pause()
        await eng.update_weights_from_tensors([(n, torch.zeros(t.shape)) for n, t in tensors])
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-c", SENDER, str(port), "11", json.dumps(info)])
        try:
            await eng.init_weight_transfer("gloo", "127.0.0.1", port, rank=1, world_size=2,
                                           timeout=60)
            await eng.update_weights_from_distributed(info)
            assert await to_thread.run_sync(proc.wait, 60) == 0
        finally:
            proc.kill()
        await eng.resume()
        assert (await greedy(eng))[0] == want
    # the engine's shutdown closed the group it still had
    assert eng._transfer is None

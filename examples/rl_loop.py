"""A GRPO-shaped rollout loop in one process, on the CPU: the engine generates ``n`` samples per
prompt, a "trainer" (a torch module holding the same weights) takes a step and sends its weights
to the engine through a gloo group (``engine.weight_transfer``) while the engine is paused, and
generation goes on with the new weights; every output says which weights made it. At the end
the engine is shut down and none of its tensors is left.

    python examples/rl_loop.py                       # the embedded SmolLM2-135M-Instruct
    python examples/rl_loop.py --model random:tiny-llama --rounds 2

The "training step" here only nudges the weights along a fixed random direction scaled by the
batch's mean reward (a stand-in: the point is the engine's side of the loop).
"""

from __future__ import annotations

import argparse
import gc
import socket
import statistics
import weakref

import anyio
from anyio import to_thread
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.memory.owner import reachable_tensors
from engine.weight_transfer import Sender, metadata

PROMPTS = ["Write one word that rhymes with cat.", "Name a colour.", "Say something kind."]


def reward(text: str) -> float:
    """A toy reward: shorter answers score higher."""
    return 1.0 / (1 + len(text.split()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def rollout(engine: AsyncEngine, n: int, seed: int) -> tuple[list[str], set[int]]:
    """``n`` samples of every prompt, in parallel; their texts and the weight versions seen."""
    texts: list[str] = []
    versions: set[int] = set()

    async def one(prompt: str, k: int) -> None:
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed * 1000 + k)
        text = ""
        async for out in engine.generate(prompt, params):
            text += out.text
            versions.add(out.weight_version)
        texts.append(text)

    async with anyio.create_task_group() as tg:
        for i, prompt in enumerate(PROMPTS):
            for k in range(n):
                tg.start_soon(one, prompt, i * n + k)
    return texts, versions


async def main(model: str, rounds: int, n: int) -> list[list[str]]:
    config = EngineConfig(model=model, device="cpu", cpu_weights="float", dtype="float32")
    history: list[list[str]] = []
    async with AsyncEngine.open(config) as engine:
        # the trainer's copy of the weights (a real trainer has its own model)
        weights = dict(engine.runner.resource("weights").named_parameters())
        trainer = {name: weights[name].detach().clone() for name, _, _ in engine.weight_info()}
        engine_tensors = [weakref.ref(p) for p in weights.values()]
        runner = engine.runner
        del weights
        direction = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) * 0.02
                     for k, v in trainer.items()}
        port = free_port()
        senders: list[Sender] = []
        async with anyio.create_task_group() as tg:  # both sides of the rendezvous at once
            tg.start_soon(to_thread.run_sync, lambda: senders.append(Sender("127.0.0.1", port)))
            await engine.init_weight_transfer("gloo", "127.0.0.1", port, rank=1, world_size=2)
        sender = senders[0]
        for r in range(rounds):
            # the same seeds every round: what changes between rounds is the weights
            texts, versions = await rollout(engine, n, seed=0)
            assert versions == {r}, versions
            history.append(sorted(texts))
            mean = statistics.fmean(reward(t) for t in texts)
            print(f"round {r}: weights v{sorted(versions)}, {len(texts)} samples, "
                  f"mean reward {mean:.3f}")
            for k in trainer:  # the "training step"
                trainer[k] += mean * direction[k]
            await engine.pause("keep")  # nothing in flight here; "keep" would freeze it
            async with anyio.create_task_group() as tg:
                tg.start_soon(to_thread.run_sync, sender.send, trainer)
                await engine.update_weights_from_distributed(metadata(trainer), version=r + 1)
            await engine.resume()
        sender.close()
    gc.collect()
    left = reachable_tensors(runner) + [r for r in engine_tensors if r() is not None]
    print(f"engine shut down; its tensors still alive: {len(left)}")
    assert not left, left
    return history


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=EngineConfig().model)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=4, help="samples per prompt")
    a = ap.parse_args()
    anyio.run(main, a.model, a.rounds, a.n)

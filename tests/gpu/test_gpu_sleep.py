"""GPU sleep mode: asleep, the CUDA caching allocator holds exactly what it held
before the engine loaded -- ``memory_allocated`` and ``memory_reserved`` to the byte, CUDA graphs
and every workspace included -- at level 2 and at level 1, where the weights sit in page-locked
host memory instead; greedy outputs after a wake equal those before; shutdown from sleep gives
back every byte too. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import gc

import anyio
import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.memory.owner import reachable_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 2**20
PROMPTS = [list(range(1000, 1000 + n)) for n in (5, 300, 2500)] + [[7, 8, 9]] * 5
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def _mem() -> tuple[int, int]:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _pinned() -> int:
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


@pytest.fixture(scope="module")
def baseline() -> tuple[int, int]:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    gc.collect()
    torch.cuda.empty_cache()
    m = _mem()
    print(f"\nbefore load: allocated {m[0]} B, reserved {m[1]} B; pinned host {_pinned()} B")
    return m


async def _greedy(eng) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        async for o in eng.generate(PROMPTS[i], PARAMS):
            outs[i] += o.token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return outs


@pytest.mark.parametrize("speculator", ["none", "draft"])
def test_sleep_levels_give_back_every_device_byte(baseline, speculator):
    extra = {} if speculator == "none" else dict(speculator="draft",
                                                  draft_model="random:qwen3-0.6b@seed=1")
    config = EngineConfig(model="random:qwen3-0.6b", device="cuda", dtype="bfloat16",
                          kv_cache_bytes=8 * 2**30, **extra)

    async def run() -> None:
        async with AsyncEngine.open(config) as eng:
            ref = await _greedy(eng)
            assert eng.runner.resource("cuda_graphs").captured, "decode steps ran without graphs"
            weights = eng.runner.resource("weights")
            w_bytes = sum(t.numel() * t.element_size()
                          for t in [*weights.parameters(), *weights.buffers()])
            del weights
            pinned0 = _pinned()
            for cycle in range(2):
                for level in (2, 1):
                    await eng.sleep(level=level)
                    asleep = _mem()
                    print(f"cycle {cycle} level {level}: asleep allocated "
                          f"{asleep[0] - baseline[0]:+d} B, reserved {asleep[1] - baseline[1]:+d} B; "
                          f"kept in host memory {eng._sleep.host_bytes / MiB:.1f} MiB (weights "
                          f"{w_bytes / MiB:.1f} MiB), pinned {(_pinned() - pinned0) / MiB:.1f} MiB; "
                          f"parts {eng.runner.sleep_timings}")
                    assert asleep == baseline, f"level {level}: {asleep} != {baseline}"
                    if level == 2:
                        assert reachable_tensors(eng.runner) == []
                        assert eng._sleep.host_bytes == 0
                    else:
                        weights = eng.runner.resource("weights")  # the module stays, on the host
                        assert all(t.device.type == "cpu" and t.is_pinned()
                                   for t in [*weights.parameters(), *weights.buffers()])
                        del weights
                        assert eng._sleep.host_bytes >= w_bytes
                        assert _pinned() - pinned0 >= w_bytes
                    await eng.wake_up()
                    print(f"  wake {eng.runner.sleep_timings}; pinned after wake "
                          f"{(_pinned() - pinned0) / MiB:.1f} MiB")
                    assert _pinned() <= pinned0  # the page-locked copies were given back
                    assert await _greedy(eng) == ref, f"level {level}: outputs differ"
                    assert eng.runner.resource("cuda_graphs").captured  # recaptured lazily
            await eng.sleep(level=1)
        assert _mem() == baseline, "shutdown from sleep left memory behind"

    anyio.run(run)

"""Repeated open/close of an in-process ``AsyncEngine``: nothing accumulates.

Each cycle loads a model with a 64 MiB KV cache, serves a few concurrent requests and shuts
down. A leak of any cycle's KV cache alone would add 64 MiB of virtual memory (on CPU the cache
is its own memory map, resident only where written: engine/kv/kv_cache.py) and the RSS of what the
requests wrote; a leaked tensor object of any size shows up in the live-tensor count.
"""

from __future__ import annotations

import gc
import os

import anyio
import msgspec
import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams
from states import State

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CYCLES = 12  # (a leaked KV cache shows in one cycle; a leaked tensor object in the count)
WARMUP = 3  # first cycles fill one-time caches (torch kernels, thread pool, logging)
KV_BYTES = 64 * 2**20
RSS_NOISE = 24 * 2**20  # allocator/heap noise over all cycles; well below one KV cache
# tiny-llama caches 2 layers x (k, v) x 2 heads x 16 dims x 16 tokens x 4 bytes = 8 KiB a block
CONFIG = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=KV_BYTES // 8192,
                      max_num_seqs=4, max_num_batched_tokens=64)


def live_tensors() -> int:
    gc.collect()
    # type(), not isinstance(): some torch objects warn when their __class__ is read
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


async def one_cycle(probe: list | None = None) -> None:
    # (the probe's cycle leaves the heap unfrozen: gc.get_objects does not list frozen objects,
    # and a serving engine freezes its startup heap, engine/runner/gc_freeze.py; shut down, it thaws)
    cfg = CONFIG if probe is None else msgspec.structs.replace(CONFIG, freeze_gc=False)
    async with AsyncEngine.open(cfg) as engine:
        assert engine.runner.resource("kv_cache").nbytes == KV_BYTES
        if probe is not None:  # the count below sees the engine's tensors while it is open
            probe.append(live_tensors())
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        streams = [engine.generate(list(range(30, 30 + n)), params) for n in (3, 17, 40)]
        for s in streams:
            n = 0
            async for out in s:
                n += len(out.token_ids)
            assert n == 8
    assert engine.state is State.SHUTDOWN and engine.runner.released


def test_open_close_cycles_do_not_grow():
    counts, sizes, virtual, probe = [], [], [], []

    async def main():
        for _ in range(WARMUP):
            await one_cycle()
        counts.append(live_tensors())
        sizes.append(rss())
        virtual.append(vm_size())
        for i in range(CYCLES):
            await one_cycle(probe if i == 0 else None)
            gc.collect()
            sizes.append(rss())
            virtual.append(vm_size())
            if i + 1 in (CYCLES // 2, CYCLES):
                counts.append(live_tensors())

    anyio.run(main)
    growth = sizes[-1] - sizes[0]
    print(f"\nlive tensors {counts} (open: {probe}); RSS {sizes[0] / 2**20:.1f} -> "
          f"{sizes[-1] / 2**20:.1f} MiB (max {max(sizes) / 2**20:.1f}) over {CYCLES} cycles; "
          f"virtual {virtual[0] / 2**20:.1f} -> {virtual[-1] / 2**20:.1f} MiB "
          f"(max {max(virtual) / 2**20:.1f})")
    assert probe[0] > counts[0] + 20, "the live-tensor count does not see the engine's tensors"
    assert counts[1:] == [counts[0]] * 2, f"live torch.Tensor objects grew: {counts}"
    assert growth < RSS_NOISE, f"RSS grew by {growth / 2**20:.1f} MiB over {CYCLES} cycles"
    vgrowth = virtual[-1] - virtual[0]
    assert vgrowth < KV_BYTES, f"virtual memory grew by {vgrowth / 2**20:.1f} MiB over {CYCLES} cycles"

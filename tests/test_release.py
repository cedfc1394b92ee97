"""Release on CPU: after ``ModelRunner.shutdown()`` every tensor the runner allocated is dead, the
runner's object graph reaches no tensor, and the release order is the reverse of creation.

``release_problems`` is *the* check: the same function judges a real shutdown (must be clean)
and a runner with a tensor smuggled past the ``__setattr__`` guard (must be reported)."""

from __future__ import annotations

import gc
import logging
import os
import types
import weakref

import anyio
import pytest
import torch
from torch import nn

from engine import AsyncEngine, EngineConfig, ModelRunner, SamplingParams
from engine.core.engine_core import EngineCore
from engine.memory.owner import reachable_tensors
from states import State

pytestmark = pytest.mark.usefixtures("torch_one_thread")

CFG = dict(device="cpu", num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=32)
ORDER = ["grammar_bitmask", "model_state", "kv_cache", "weights"]


def collect_refs(runner: ModelRunner) -> dict[str, weakref.ref]:
    """Weak references to every device allocation the runner owns, by name."""
    refs: dict[str, weakref.ref] = {}

    def module(prefix: str, m: nn.Module) -> None:
        refs[prefix] = weakref.ref(m)
        for name, t in [*m.named_parameters(), *m.named_buffers()]:
            refs[f"{prefix}.{name}"] = weakref.ref(t)

    module("weights", runner.resource("weights"))
    kv = runner.resource("kv_cache")
    refs["kv_cache"] = weakref.ref(kv)
    refs["kv_cache.tensor"] = weakref.ref(kv.tensor)
    state = runner.resource("model_state")
    refs["model_state"] = weakref.ref(state)
    for name, t in state.buffers.items():
        refs[f"model_state.{name}"] = weakref.ref(t)
    spec = runner._owner.get("speculator")
    if spec is not None:
        refs["speculator"] = weakref.ref(spec)
        for name, value in vars(spec).items():
            if isinstance(value, nn.Module):
                module(f"speculator.{name}", value)
            elif isinstance(getattr(value, "tensor", None), torch.Tensor):
                refs[f"speculator.{name}.tensor"] = weakref.ref(value.tensor)
    assert len(refs) > 20
    return refs


def release_problems(runner: ModelRunner, refs: dict[str, weakref.ref]) -> list[str]:
    """Everything that survived a shutdown: owned allocations still alive (someone holds them),
    and tensors or modules still reachable from the runner (held outside the owner)."""
    gc.collect()
    problems = [f"alive after shutdown: {name}" for name, ref in refs.items() if ref() is not None]
    problems += [f"reachable from runner: {path}" for path in reachable_tensors(runner)]
    if not runner.released:
        problems.append("owner not closed")
    return problems


def _run_requests(runner: ModelRunner, n: int = 3, max_tokens: int = 6) -> EngineCore:
    """Real steps (mixed prefill/decode, several KV blocks) so activations were allocated."""
    core = EngineCore(runner, check_integrity=True)
    for i in range(n):
        core.add_request(f"r{i}", list(range(10, 10 + 7 * (i + 1))),
                         SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finished = 0
    while core.has_work():
        finished += sum(o.finished for o in core.step())
    assert finished == n and core.statistics().generation_tokens == n * max_tokens
    return core


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3"])
def test_shutdown_releases_everything(model):
    runner = ModelRunner(EngineConfig(model=model, **CFG))
    runner.load()
    core = _run_requests(runner)
    refs = collect_refs(runner)
    assert release_problems(runner, refs)[:1] == ["alive after shutdown: weights"]  # sanity
    assert runner.shutdown() == ORDER
    assert release_problems(runner, refs) == []
    assert reachable_tensors(core) == []
    assert runner.shutdown() == []  # a second call is harmless


def test_shutdown_releases_speculator_first():
    pytest.importorskip("engine.spec_decode")
    runner = ModelRunner(EngineConfig(model="random:tiny-llama", speculator="draft",
                                      draft_model="random:tiny-llama@seed=1", **CFG))
    runner.load()
    assert "speculator" in runner._owner
    _run_requests(runner)
    refs = collect_refs(runner)
    assert any(name.startswith("speculator.") for name in refs)
    assert runner.shutdown() == ["speculator", *ORDER]
    assert release_problems(runner, refs) == []


@pytest.fixture
def runner():
    r = ModelRunner(EngineConfig(model="random:tiny-llama", **CFG))
    r.load()
    yield r
    r.shutdown()


@pytest.mark.parametrize("value", [
    torch.zeros(3), nn.Linear(2, 2), [torch.zeros(3)], {"x": torch.zeros(3)},
    types.SimpleNamespace(cache=(torch.zeros(3),)),
], ids=["tensor", "module", "list", "dict", "nested"])
def test_tensor_attribute_is_refused(runner, value):
    with pytest.raises(TypeError, match="outside the owner"):
        runner.foo = value
    assert not hasattr(runner, "foo")


@pytest.mark.parametrize("value, path", [
    (torch.zeros(3), "root.foo: Tensor"),
    (types.SimpleNamespace(cache=[torch.zeros(3)]), "root.foo.cache[0]: Tensor"),
], ids=["tensor", "nested"])
def test_bypassed_guard_is_reported(runner, value, path):
    refs = collect_refs(runner)
    object.__setattr__(runner, "foo", value)
    _run_requests(runner, n=1)
    assert runner.shutdown() == ORDER
    assert release_problems(runner, refs) == [f"reachable from runner: {path}"]


def test_held_reference_is_reported(runner):
    """The weak-reference half of the check: a strong reference kept across shutdown (here
    by the test itself) is reported, so 'dead' in the clean test really means dead."""
    refs = collect_refs(runner)
    kv = runner.resource("kv_cache").tensor
    runner.shutdown()
    assert release_problems(runner, refs) == ["alive after shutdown: kv_cache.tensor"]
    assert kv.numel() == 0  # and the owner emptied it in place anyway
    del kv
    assert release_problems(runner, refs) == []


def test_async_engine_releases_runner(caplog):
    caplog.set_level(logging.INFO, logger="enginecore.runner")
    out: dict = {}

    async def main():
        async with AsyncEngine.open(EngineConfig(model="random:tiny-llama", **CFG)) as engine:
            out["engine"] = engine
            out["refs"] = collect_refs(engine.runner)
            toks = []
            async for o in engine.generate(list(range(20, 50)),
                                           SamplingParams(max_tokens=8, ignore_eos=True)):
                toks += o.token_ids
            assert len(toks) == 8

    anyio.run(main)
    engine = out.pop("engine")
    assert engine.state is State.SHUTDOWN and engine.core is None
    assert release_problems(engine.runner, out["refs"]) == []
    assert reachable_tensors(engine) == []
    assert "released grammar_bitmask, model_state, kv_cache, weights" in [
        r.getMessage() for r in caplog.records if r.name == "enginecore.runner"]


def _mapping_rss(addr: int) -> int | None:
    """Resident bytes of the memory mapping holding ``addr`` (/proc/self/smaps); None if no
    mapping holds it. (The kernel may merge a fresh anonymous map with a neighbour: for what
    one tensor made resident, :func:`_written_bytes`.)"""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    return None


def _written_bytes(addr: int, nbytes: int) -> int:
    """Bytes of ``[addr, addr + nbytes)`` backed by pages of this process's own (written) --
    /proc/self/pagemap's "exclusively mapped" bit (56): a page only read maps the kernel's
    shared zero page, which is present but not exclusive. Exact to the page, whatever the
    neighbouring mappings."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = addr // page, (addr + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    entries = memoryview(raw).cast("Q")
    return sum(page for e in entries if e >> 63 & 1 and e >> 56 & 1)


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs /proc/self/pagemap")
def test_cpu_kv_cache_resident_only_where_written_and_unmapped_at_close():
    """The CPU cache's memory map (engine/kv/kv_cache.py ``zeroed_host``): reads as zeros, is
    resident only where written, and is unmapped by close() -- or, if a view of it leaked,
    when that view dies, never while it can still be read."""
    from engine.kv.kv_cache import KVCache

    kv = KVCache(num_layers=2, num_blocks=1024, block_size=16, num_kv_heads=2, head_dim=64,
                 dtype=torch.float32, device=torch.device("cpu"))  # 32 MiB
    t = kv.tensor
    assert kv.nbytes == 32 * 2**20 and t.is_contiguous() and t._base is None
    addr, size = t.data_ptr(), kv.nbytes
    assert _written_bytes(addr, size) == 0  # nothing resident yet
    assert not t.any()  # a read sees zeros (and makes nothing of ours resident)
    assert _written_bytes(addr, size) == 0
    t[0, 1, 7].fill_(1.5)  # one block: 8 KiB (a transparent huge page, where on, makes 2 MiB)
    assert 8192 <= _written_bytes(addr, size) <= 2 * 2**20 and t[0, 1, 7].eq(1.5).all()
    view = t[0, 1, 7]  # a view that outlives the cache
    del t
    kv.close()
    assert kv.tensor is None and _mapping_rss(addr) is not None  # still mapped: the view reads it
    assert view.eq(1.5).all()
    del view
    gc.collect()
    assert _mapping_rss(addr) is None  # unmapped with the last view

    kv = KVCache(num_layers=2, num_blocks=1024, block_size=16, num_kv_heads=2, head_dim=64,
                 dtype=torch.bfloat16, device=torch.device("cpu"))
    addr = kv.tensor.data_ptr()
    kv.close()
    assert _mapping_rss(addr) is None  # no view: unmapped by close() itself

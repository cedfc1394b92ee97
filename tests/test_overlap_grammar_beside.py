"""Adversarial checks of ENGINECORE_GRAMMAR_OVERLAP=1 (``EngineCore._grammar_job``): failures
on either thread, the process-wide GIL setting, the host rows the next step reads back."""

from __future__ import annotations

import threading

import anyio
import pytest

from engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.params import SamplingParams
from engine.structured import matcher as matcher_mod
from engine.structured.gil import _batch_functions

from test_overlap_structured import REGEX, SCHEMA, _core, _mixed, _order, _run


def _flags():
    return [f.release_gil for f in _batch_functions()]


def test_a_failure_on_the_helper_fails_the_step_and_restores_the_gil_setting(monkeypatch):
    core = _core(True, "sample-first-beside")
    real = matcher_mod.accept_allowed
    calls = {"n": 0}

    def boom(ms, ts):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("helper boom")
        return real(ms, ts)

    monkeypatch.setattr(matcher_mod, "accept_allowed", boom)
    with pytest.raises(RuntimeError, match="helper boom"):
        _run(core, list(_mixed(9)))
    assert calls["n"] == 3
    assert not any(_flags())
    core.runner.shutdown()


@pytest.mark.parametrize("after", ["apply-first-beside", "sample-first-beside"])
def test_a_forward_failure_while_the_helper_runs(after, monkeypatch):
    """The forward raises while the helper feeds the matchers and fills the masks: the step
    fails; the helper's job is done (or waited for) before anything reuses the host rows."""
    core = _core(True, after, fault_at_step=10)
    with pytest.raises(RuntimeError, match="injected fault"):
        _run(core, list(_mixed(9)))
    assert core.grammar_jobs > 0
    core.runner.shutdown()  # waits for the helper (TokenBitmask.close)
    assert not any(_flags())
    assert not [t for t in threading.enumerate() if t.name.startswith("grammar-fill")]


@pytest.mark.asyncio
async def test_injected_fault_with_beside_kills_cleanly():
    cfg = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=256,
                       overlap_scheduling=True, fault_at_step=9)
    async with AsyncEngine.open(cfg, check_integrity=True) as eng:
        core = eng.core
        _order(core, "sample-first-beside")
        errors = []

        async def one(k):
            s = eng.generate("ab", SamplingParams(max_tokens=200,
                                                  structured=REGEX if k % 2 else SCHEMA))
            try:
                async for _ in s:
                    pass
            except EngineDeadError as e:
                errors.append(e)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for k in range(6):
                    tg.start_soon(one, k)
        await eng.wait_stopped()
    assert len(errors) == 6
    assert core.grammar_jobs > 0
    assert eng.runner.released
    assert not any(_flags())


@pytest.mark.asyncio
async def test_two_engines_beside_at_once_with_aborts():
    """Two engines in one process, both feeding and filling on their helpers (the GIL setting
    is process-wide): every stream ends once, every completed regex output matches."""
    import re

    async def serve(tag):
        cfg = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=128,
                           overlap_scheduling=True, max_num_seqs=16)
        async with AsyncEngine.open(cfg, check_integrity=True) as eng:
            core = eng.core
            _order(core, "sample-first-beside" if tag else "apply-first-beside")
            res = {}

            async def one(k):
                s = eng.generate(bytes([97 + k % 20]).decode() * (1 + k % 7), SamplingParams(
                    max_tokens=5 + k % 50, temperature=0.8 if k % 3 else 0.0, seed=k,
                    structured=REGEX if k % 2 else SCHEMA))
                toks, fins = [], []
                async for o in s:
                    toks += o.token_ids
                    fins.append(o.finished)
                    if k % 5 == 0 and len(toks) > 3:
                        await eng.abort(s.request_id)
                res[k] = (toks, fins, o.finish_reason)

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for k in range(40):
                        tg.start_soon(one, k)
                        if k % 8 == 7:
                            await anyio.sleep(0.01)
            assert core.grammar_jobs > 0
            return res

    results = []

    async def run(tag):
        results.append(await serve(tag))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, 0)
        tg.start_soon(run, 1)
    for res in results:
        for k, (toks, fins, why) in res.items():
            assert sum(fins) == 1 and fins[-1], (k, fins)
            if k % 2 and why == "stop":
                text = bytes(t for t in toks if t < 256).decode("latin-1")
                assert re.fullmatch(r"(ab|cd){2,9}x", text), (k, text)
    assert not any(_flags())


@pytest.mark.parametrize("after", ["apply-first", "sample-first"])
@pytest.mark.parametrize("kw", [{"num_kv_blocks": 24, "block_size": 4},
                                {"max_num_batched_tokens": 16}], ids=["preempt", "chunked"])
def test_jobs_mixed_with_synchronous_late_steps(after, kw, monkeypatch):
    """The step before's tokens not back now and then (``Launched.ready`` False): late steps
    with and without a job alternate -- masks filled on the helper, then read back by
    ``allows`` on the step thread, and the other way round -- across preemptions and prompt
    chunks: the outputs are those of the same order without jobs."""
    import random

    from engine.launched import Launched

    work = list(_mixed(14))
    want = _run(_core(True, after, **kw), work)
    rnd = random.Random(3)
    ready = Launched.ready
    monkeypatch.setattr(Launched, "ready",
                        property(lambda self: ready.fget(self) and rnd.random() < 0.5))
    core = _core(True, after + "-beside", **kw)
    assert _run(core, work) == want
    assert 0 < core.grammar_jobs < core.late_sampled_steps

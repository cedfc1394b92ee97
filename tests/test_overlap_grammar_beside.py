"""Adversarial checks of the grammar worker's jobs (``EngineCore._grammar_job``,
``structured/native.py``): failures on either thread, two engines at once, the host rows the
next step reads back."""

from __future__ import annotations

import threading

import anyio
import pytest
from test_overlap_structured import REGEX, SCHEMA, _core, _mixed, _order, _run

from engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.params import SamplingParams
from engine.structured import native

pytestmark = pytest.mark.skipif(native.worker_module() is None,
                                reason="no grammar worker (no C++ compiler)")


def _bitmask(core):
    from engine.memory.owner import Resource as R

    return core.runner._owner[R.GRAMMAR_BITMASK]


def test_a_failure_on_the_worker_fails_the_step(monkeypatch):
    """xgrammar raising inside the worker's third job: that step raises the error (kind and
    message), and the engine's shutdown still ends the worker."""
    import tvm_ffi

    def boom(*args):
        raise ValueError("worker boom")

    core = _core(True, "sample-first-beside")
    submit = native.GrammarWorker.submit
    calls = {"n": 0}

    def third_fails(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            # both accepts: the batch one, and the one a row (each row timed: budget.py)
            fail = tvm_ffi.convert(boom)
            self._fns = (fail,) + self._fns[1:3] + (fail,) + self._fns[4:]
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(native.GrammarWorker, "submit", third_fails)
    with pytest.raises(RuntimeError, match="ValueError: worker boom"):
        _run(core, list(_mixed(9)))
    assert calls["n"] == 3 and core.grammar_jobs == 3
    bits = _bitmask(core)
    assert bits._worker
    core.runner.shutdown()
    assert bits._worker is None  # closed: its thread joined


@pytest.mark.parametrize("after", ["apply-first-beside", "sample-first-beside"])
def test_a_forward_failure_while_the_helper_runs(after, inject_fault):
    """The forward raises while the worker feeds the matchers and fills the masks: the step
    fails; the worker's job is done (or waited for) before anything reuses the host rows."""
    inject_fault(10)
    core = _core(True, after)
    with pytest.raises(RuntimeError, match="injected fault"):
        _run(core, list(_mixed(9)))
    assert core.grammar_jobs > 0
    bits = _bitmask(core)
    assert bits._worker
    core.runner.shutdown()  # waits for the worker's job (TokenBitmask.close)
    assert bits._worker is None
    assert not [t for t in threading.enumerate() if t.name.startswith("grammar-fill")]


@pytest.mark.asyncio
async def test_injected_fault_with_beside_kills_cleanly(inject_fault):
    inject_fault(9)
    cfg = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=256,
                       overlap_scheduling=True)
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


@pytest.mark.asyncio
async def test_two_engines_beside_at_once_with_aborts():
    """Two engines in one process, each feeding and filling on its own worker: every stream
    ends once, every completed regex output matches."""
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


@pytest.mark.parametrize("after", ["apply-first", "sample-first"])
@pytest.mark.parametrize("kw", [{"num_kv_blocks": 24, "block_size": 4},
                                {"max_num_batched_tokens": 16}], ids=["preempt", "chunked"])
def test_jobs_mixed_with_synchronous_late_steps(after, kw, monkeypatch):
    """The step before's tokens not back now and then at the forward's launch
    (``Launched.ready`` False: the job starts after the launch, once they are), and now and
    then no job at all (the step thread feeds and fills): late steps with jobs before the
    launch, after it and without alternate -- masks filled on the worker, then read back by
    ``allows`` on the step thread, and the other way round -- across preemptions and prompt
    chunks: the outputs are those of the same order without jobs."""
    import random

    from engine.runner.launched import Launched
    from engine.runner.model_runner import ModelRunner

    work = list(_mixed(14))
    want = _run(_core(True, after, **kw), work)
    rnd = random.Random(3)
    ready = Launched.ready
    monkeypatch.setattr(Launched, "ready",
                        property(lambda self: ready.fget(self) and rnd.random() < 0.5))
    start = ModelRunner.accept_then_fill
    monkeypatch.setattr(ModelRunner, "accept_then_fill",
                        lambda self, *a: start(self, *a) if rnd.random() < 0.7 else None)
    core = _core(True, after + "-beside", **kw)
    assert _run(core, work) == want
    assert 0 < core.grammar_jobs < core.late_sampled_steps
    assert 0 < core.grammar_jobs_after < core.grammar_jobs


@pytest.mark.parametrize("after", ["apply-first", "sample-first"])
def test_a_token_out_of_its_mask_undoes_the_job(after, monkeypatch):
    """Every fifth step sampled without its masks (``TokenBitmask.mask`` skipped): tokens out of
    their masks reach the worker, which checks them against the rows they were sampled from,
    finds one out and does nothing -- no matcher fed, no row filled; the step thread then feeds
    the matchers one by one (each verdict read: the refused ones end with an error). The
    outputs are those of the same order without the worker."""
    from engine.structured.bitmask import TokenBitmask

    mask = TokenBitmask.mask
    calls = {"n": 0}

    def sometimes(self, logits, filling, copy=True):
        calls["n"] += 1
        if calls["n"] % 5 == 0:
            filling.rows()  # (waited for, as mask does)
            return logits
        return mask(self, logits, filling, copy)

    monkeypatch.setattr(TokenBitmask, "mask", sometimes)
    want = _run(_core(True, after), list(_mixed(18)))
    calls["n"] = 0
    core = _core(True, after + "-beside")
    got = _run(core, list(_mixed(18)))
    assert got == want
    assert core.grammar_jobs_refused > 0
    assert any(f[0] == "error" for f in got[1].values()), got[1]


def test_an_aborted_requests_matcher_is_not_fed(monkeypatch):
    """Constrained requests aborted while their tokens are in flight: the jobs after the abort
    feed the other matchers only (the feed planned at the launch is not reused once a request
    left), and the ones before fed them."""
    from engine.runner.model_runner import ModelRunner

    fed: list[list] = []
    start = ModelRunner.accept_then_fill

    def spy(self, matchers, *a):
        fed.append(list(matchers))
        return start(self, matchers, *a)

    monkeypatch.setattr(ModelRunner, "accept_then_fill", spy)
    core = _core(True, "sample-first-beside")
    gone = {}
    real_abort = core.abort

    def abort(rid, reason):
        req = core.requests[rid]
        assert req.pending and req.matcher is not None  # its token in flight
        gone[rid] = (req.matcher, len(fed))
        return real_abort(rid, reason)

    core.abort = abort
    _run(core, list(_mixed(12)), abort_after={3: ["r0", "r1"], 5: ["r4"]})
    assert set(gone) == {"r0", "r1", "r4"}
    for rid, (matcher, at) in gone.items():
        assert any(m is matcher for m in fed[at - 1]), rid
        assert not any(m is matcher for ms in fed[at:] for m in ms), rid


# each order once, under heavy (10 blocks) and lighter (24) preemption: the four pairs took
# two minutes of CI for what two of them show
@pytest.mark.parametrize("after,blocks", [("apply-first", 10), ("sample-first", 24)])
def test_the_planned_feed_under_preemption_and_aborts(after, blocks, monkeypatch):
    """Few KV blocks (preemptions) and aborts mid-run: the late steps' jobs -- with the feed
    _defer planned, and with it never reused -- give the outputs of the same order without
    the worker."""
    from engine.core.engine_core import EngineCore

    work = list(_mixed(24))
    aborts = {4: ["r3", "r6"], 7: ["r9"], 11: ["r12", "r13"]}
    want = _run(_core(True, after, num_kv_blocks=blocks), work, abort_after=dict(aborts))
    core = _core(True, after + "-beside", num_kv_blocks=blocks)
    assert _run(core, work, abort_after=dict(aborts)) == want
    assert core.grammar_jobs > 0
    fed = EngineCore._fed

    def unplanned(self, batch, launched):
        launched.fed = None
        return fed(self, batch, launched)

    monkeypatch.setattr(EngineCore, "_fed", unplanned)
    assert _run(_core(True, after + "-beside", num_kv_blocks=blocks), work,
                abort_after=dict(aborts)) == want

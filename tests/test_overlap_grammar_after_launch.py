"""Attacks on a late step's grammar job started after the forward's launch and on ``_grammar_done``'s all-go-on verdicts
(``structured.matcher.ALL_GO_ON``): entries that reach ``_append`` with a matcher but were not fed must not
take a verdict they never earned."""

from __future__ import annotations

import random

import pytest
from test_overlap_structured import REGEX, SCHEMA, _core, _run

from engine.params import SamplingParams
from engine.structured import native

pytestmark = pytest.mark.skipif(native.worker_module() is None,
                                reason="no grammar worker (no C++ compiler)")


def _odd(n: int):
    """Constrained requests with every knob that changes what ``_append`` does with a token:
    scoring only (max_tokens 0), min_tokens, ignore_eos, stop strings, logprobs; and
    unconstrained ones beside them."""
    for i in range(n):
        prompt = [(i * 11 + j * 5) % 200 + 32 for j in range(3 + i % 7)]
        c = (REGEX, SCHEMA, None)[i % 3]
        kind = i % 6
        kw = dict(max_tokens=5 + (i * 7) % 30, temperature=0.0, structured=c)
        if kind == 0:
            kw.update(max_tokens=0, prompt_logprobs=1)
        elif kind == 1:
            kw.update(min_tokens=3)
        elif kind == 2:
            kw.update(ignore_eos=True)
        elif kind == 3:
            kw.update(stop=["cd", "}"])
        elif kind == 4:
            kw.update(logprobs=True, temperature=0.8, seed=i)
        yield f"r{i}", prompt, SamplingParams(**kw)


_PLAIN, _PREEMPT, _CHUNKED = {}, {"num_kv_blocks": 24, "block_size": 4}, {"max_num_batched_tokens": 16}


# every pair of (order, batch kind), (readiness, batch kind) and (order, readiness) once: six
# cases for the twelve of the full product (two minutes of CI for the same pairs)
@pytest.mark.parametrize("after,kw,ready", [
    ("apply-first", _PLAIN, "random"), ("sample-first", _PLAIN, "never"),
    ("sample-first", _CHUNKED, "random"), ("apply-first", _CHUNKED, "never"),
    ("apply-first", _PREEMPT, "random"), ("sample-first", _PREEMPT, "never"),
], ids=["apply-first-plain-random", "sample-first-plain-never", "sample-first-chunked-random",
        "apply-first-chunked-never", "apply-first-preempt-random", "sample-first-preempt-never"])
def test_after_launch_jobs_with_odd_requests(after, kw, ready, monkeypatch):
    from engine.runner.launched import Launched

    work = list(_odd(18))
    adds = {3: [(f"late{i}", [40 + i, 41, 42], SamplingParams(
        max_tokens=0 if i == 0 else 9, prompt_logprobs=1, structured=REGEX))
        for i in range(3)]}
    aborts = {5: ["r4", "r7"], 8: ["r10", "late1"]}
    _patch_ready(monkeypatch, ready)
    want = _run(_core(True, after, **kw), work, dict(adds), dict(aborts))
    monkeypatch.undo()
    _patch_ready(monkeypatch, ready)  # the same steps not back at the same points
    core = _core(True, after + "-beside", **kw)
    assert _run(core, work, dict(adds), dict(aborts)) == want
    assert core.grammar_jobs_after > 0


def _patch_ready(monkeypatch, ready: str) -> None:
    """``Launched.ready`` False for every deferred step ("never") or for a random half of them
    (chosen in launch order, so both runs of a test see the same steps not back)."""
    from engine.runner.launched import Launched

    rnd = random.Random(1)
    late: dict[int, tuple] = {}  # id -> (the step, whether it is never ready)
    made = Launched.__dict__["deferred"].__func__
    was = Launched.ready

    def deferred(cls, *a, **k):
        launched = made(cls, *a, **k)
        late[id(launched)] = (launched, ready == "never" or rnd.random() < 0.5)
        return launched

    monkeypatch.setattr(Launched, "deferred", classmethod(deferred))
    monkeypatch.setattr(Launched, "ready", property(
        lambda self: was.fget(self) and not late.get(id(self), (None, False))[1]))


@pytest.mark.asyncio
async def test_the_loop_let_in_during_a_late_step_gives_the_same_outputs():
    """Through the AsyncEngine (whose loop is let in by ``on_launched`` once a late step's
    forward is launched): the outputs of the synchronous engine; every stream ends once."""
    import anyio

    from engine import AsyncEngine
    from engine.config import EngineConfig

    async def serve(overlap: bool) -> dict:
        cfg = EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32",
                           num_kv_blocks=256, overlap_scheduling=overlap, seed=3)
        res = {}
        async with AsyncEngine.open(cfg, check_integrity=True) as eng:
            async def one(k):
                toks, ends = [], 0
                async for o in eng.generate([97 + k % 20] * (2 + k % 5), SamplingParams(
                        max_tokens=4 + k % 23, temperature=0.0,
                        structured=(REGEX, SCHEMA, None)[k % 3])):
                    toks += o.token_ids
                    ends += o.finished
                res[k] = (toks, ends, o.finish_reason)

            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for k in range(18):
                        tg.start_soon(one, k)
            if overlap:
                assert eng.core.late_sampled_steps > 0
        return res

    want = await serve(False)
    got = await serve(True)
    assert got == want
    assert all(ends == 1 for _, ends, _ in got.values())


# each number of looks once, the orders alternating (both orders at each point: twice the CI)
@pytest.mark.parametrize("after,reads", [("apply-first", 1), ("sample-first", 2),
                                         ("apply-first", 3), ("sample-first", 9)])
def test_jobs_start_inside_the_forward_once_the_tokens_are_back(after, reads, monkeypatch):
    """Each deferred step reads as not back for its first ``reads`` looks: the job starts at the
    forward's first poll (before the model's launch), its second (before the logits), after
    the launch, or -- never back until then -- after it too (the wait). The outputs are those
    of the same order without the worker."""
    from engine.runner.launched import Launched

    work = list(_odd(18))
    adds = {3: [(f"late{i}", [40 + i, 41, 42], SamplingParams(max_tokens=9, structured=REGEX))
                for i in range(3)]}
    aborts = {5: ["r4", "r7"], 8: ["r10", "late1"]}
    want = _run(_core(True, after), work, dict(adds), dict(aborts))
    looks: dict[int, int] = {}
    was = Launched.ready

    def ready(self):
        n = looks[id(self)] = looks.get(id(self), 0) + 1
        return was.fget(self) and (self.result is not None or n > reads)

    monkeypatch.setattr(Launched, "ready", property(ready))
    core = _core(True, after + "-beside")
    assert _run(core, work, dict(adds), dict(aborts)) == want
    assert core.grammar_jobs > 0
    if reads < 3:  # the look before the forward, then its two polls
        assert core.grammar_jobs_inside > 0
    else:  # (a step looked at more often -- an earlier step's check -- may start inside)
        assert core.grammar_jobs_after > core.grammar_jobs_inside

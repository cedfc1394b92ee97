"""Overlapped scheduling (``EngineConfig.overlap_scheduling``, engine/core/engine_core.py): step N+1 is
scheduled and launched before step N's tokens are read back. The outputs must be exactly those
of the synchronous engine -- greedy and seeded sampling, stop tokens that end a request which
was already scheduled into the next step, length limits, preemption pressure -- and every
request gets exactly one terminal output, also when it is aborted while its token is in flight.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner

TINY = "random:tiny-llama"


def _core(overlap: bool, **kw) -> EngineCore:
    r = ModelRunner(EngineConfig(model=TINY, device="cpu", overlap_scheduling=overlap,
                                 max_num_seqs=kw.pop("max_num_seqs", 16), seed=3, **kw))
    r.load()
    return EngineCore(r, check_integrity=True)


def _requests(n: int, temperature: float, stop_ids=()):
    for i in range(n):
        prompt = [(i * 7 + j) % 400 + 5 for j in range(10 + i * 3)]
        yield f"r{i}", prompt, SamplingParams(
            max_tokens=5 + i, temperature=temperature, seed=i if temperature else None,
            stop_token_ids=list(stop_ids))


def _run(core: EngineCore, reqs, abort_after: dict | None = None, lps: dict | None = None):
    tokens: dict[str, list[int]] = {}
    final: dict[str, tuple] = {}
    for rid, prompt, params in reqs:
        core.add_request(rid, prompt, params)
    steps = 0
    while core.has_work():
        for o in core.step():
            assert o.request_id not in final, f"{o.request_id}: output after its terminal one"
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            if lps is not None:
                got = lps.setdefault(o.request_id, [[], [], []])
                got[0] += [tuple(e) for e in (o.token_logprobs or [])]
                got[1] += list(o.logprobs or [])
                got[2] += [tuple(e) for e in (o.prompt_logprobs or [])]
            if o.finished:
                final[o.request_id] = (o.finish_reason, o.reason)
        steps += 1
        for rid in (abort_after or {}).get(steps, []):
            o = core.abort(rid, "client")
            if o is not None:
                assert rid not in final
                final[rid] = (o.finish_reason, o.reason)
    assert not core.requests and core.scheduler.check_integrity() is None
    assert core.blocks.num_free == core.blocks.num_blocks
    core.runner.shutdown()
    return tokens, final, steps


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_overlap_gives_the_synchronous_outputs(temperature):
    sync = _run(_core(False), _requests(24, temperature))
    core = _core(True)
    over = _run(core, _requests(24, temperature))
    assert over[0] == sync[0] and over[1] == sync[1]
    assert core.deferred_steps > 0.8 * over[2]
    assert len(over[1]) == 24


def test_stop_tokens_end_requests_already_scheduled_again():
    # the random model repeats a few tokens: stopping on them ends requests at varied steps,
    # each while its next step is already in flight
    probe = _run(_core(False), _requests(12, 0.0))[0]
    common = sorted({t for toks in probe.values() for t in toks[1:3]})[:3]
    sync = _run(_core(False), _requests(12, 0.0, common))
    over = _run(_core(True), _requests(12, 0.0, common))
    assert over[0] == sync[0] and over[1] == sync[1]
    assert any(f == ("stop", None) for f in over[1].values())


def test_preemption_pressure():
    sync = _run(_core(False, num_kv_blocks=14), _requests(10, 0.0))
    over_core = _core(True, num_kv_blocks=14)
    over = _run(over_core, _requests(10, 0.0))
    assert over[0] == sync[0] and over[1] == sync[1]
    assert over_core.statistics().preemptions > 0 and over_core.deferred_steps > 0


def test_abort_while_a_token_is_in_flight():
    core = _core(True)
    tokens, final, _ = _run(core, _requests(8, 0.0), abort_after={2: ["r5", "r6"], 4: ["r7"]})
    assert final["r5"] == ("abort", "client") and final["r7"] == ("abort", "client")
    assert len(final) == 8


def _lp_requests(n: int):
    for rid, prompt, params in _requests(n, 0.7):
        i = int(rid[1:])
        yield rid, prompt, SamplingParams(
            max_tokens=params.max_tokens, temperature=0.7, seed=i, logprobs=i % 2 == 0,
            top_logprobs=5 if i % 4 == 0 else 0, prompt_logprobs=3 if i % 3 == 0 else None)


def test_logprobs_and_prompt_logprobs_overlap_too():
    # a small token budget chunks the prompts: prompt logprobs arrive over several deferred steps
    sync_lps: dict = {}
    sync = _run(_core(False, max_num_batched_tokens=48), _lp_requests(12), lps=sync_lps)
    core = _core(True, max_num_batched_tokens=48)
    over_lps: dict = {}
    over = _run(core, _lp_requests(12), lps=over_lps)
    assert over[0] == sync[0] and over[1] == sync[1]
    assert over_lps == sync_lps
    assert any(v[0] for v in over_lps.values()) and any(v[2] for v in over_lps.values())
    # (calls that only applied a step before an eager launch launch nothing: not steps)
    assert core.deferred_steps > 0.8 * core.statistics().steps


def test_overlap_off_for_requests_that_read_their_tokens():
    core = _core(True)
    core.add_request("p", [5, 6, 7, 8], SamplingParams(max_tokens=4, repetition_penalty=1.3))
    core.add_request("q", [5, 6, 7, 8], SamplingParams(max_tokens=4))
    core.step()
    assert core._inflight is None  # a penalty reads the output so far: this step was applied
    core.abort_all("done")
    while core.has_work():
        core.step()
    core.runner.shutdown()


# -- through the AsyncEngine (overlap forced on: on CPU it is off by default) --------------------
async def _collect(eng, prompt, params):
    toks, last = [], None
    async for out in eng.generate(prompt, params):
        assert last is None or not last.finished, "an output after the terminal one"
        toks += out.token_ids
        last = out
    return toks, last


@pytest.mark.asyncio
async def test_async_engine_64_streams_drain_deadline_each_one_terminal_output():
    import anyio

    from engine import AsyncEngine

    cfg = EngineConfig(model=TINY, overlap_scheduling=True, max_num_batched_tokens=256)
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(3 + (i * 11) % 68)] for i in range(64)]
    short = SamplingParams(max_tokens=12, ignore_eos=True)
    async with AsyncEngine.open(cfg, check_integrity=True) as eng:
        res = [None] * 64

        async def one(i, params):
            res[i] = await _collect(eng, prompts[i], params)

        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i, short)
        assert all(len(t) == 12 and last.finish_reason == "length" for t, last in res)
        assert eng.core.deferred_steps > 0
        # then a drain whose deadline cuts long requests: every stream still ends exactly once
        long = SamplingParams(max_tokens=2000, ignore_eos=True)
        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i, long if i % 2 else short)
            await anyio.sleep(0.3)
            tg.start_soon(eng.drain, 0.5)
    reasons = {last.finish_reason for _, last in res}
    assert reasons <= {"length", "abort"} and "abort" in reasons
    assert all(last.finished for _, last in res)
    assert eng.runner.released


def test_first_tokens_are_applied_before_an_eager_launch():
    """The step in flight carries a first token, the device is done with it (always, on the
    CPU) and the next step computes prompt tokens (a long host launch on a GPU): the call
    applies it and returns that token without launching; the next call launches. Outputs are
    the same as without overlap."""
    core = _core(True)
    core.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0))
    assert core.step() == [] and core.in_flight  # a's prefill launched, deferred
    core.add_request("b", [15, 16, 17], SamplingParams(max_tokens=3, temperature=0.0))
    launched = core.runner.steps
    out = core.step()
    assert [o.request_id for o in out] == ["a"] and len(out[0].token_ids) == 1
    assert core.runner.steps == launched and not core.in_flight and core.early_completions == 1
    core.step()  # b's prefill and a's decode
    assert core.runner.steps == launched + 1
    tokens = {}
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
    sync = _core(False)
    ref = _run(sync, [("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0)),
                      ("b", [15, 16, 17], SamplingParams(max_tokens=3, temperature=0.0))])[0]
    assert out[0].token_ids + tokens["a"] == ref["a"] and tokens["b"] == ref["b"]
    core.runner.shutdown()

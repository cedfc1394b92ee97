"""How the in-process engine hands outputs over: a consumer that fell behind gets
what is pending as one merged piece (same tokens, text and logprobs, one terminal output), and
every device call runs on the engine's one step thread."""

from __future__ import annotations

import threading

import anyio
import pytest

from engine import AsyncEngine, EngineConfig, EngineDeadError, SamplingParams
from engine.params import Logprobs, RequestOutput
from engine.serving.output_merge import merge_outputs
from engine.serving.request_stream import RequestStream
from engine.serving.step_thread import StepThread

TINY = "random:tiny-llama"


def _rows(ids: list[int], k: int = 1) -> Logprobs:
    """Packed logprob rows for ``ids`` (values irrelevant: only the joining is checked)."""
    import numpy as np

    rows = np.zeros((len(ids), 3 + 2 * k), dtype="<i4")
    rows[:, 0] = ids
    return Logprobs(k, rows.tobytes())


def test_merge_outputs_joins_pieces_in_order() -> None:
    a = RequestOutput(request_id="r", token_ids=[1, 2], text="ab", num_prompt_tokens=5,
                      num_output_tokens=2, logprobs=[-0.1, -0.2], token_logprobs=_rows([1, 2]),
                      prompt_logprobs=_rows([9, 9, 9]), prompt_text="ppp")
    b = RequestOutput(request_id="r", token_ids=[3], text="c", num_prompt_tokens=5,
                      num_output_tokens=3, logprobs=[-0.3], token_logprobs=_rows([3]))
    c = RequestOutput(request_id="r", token_ids=[4], text="d", num_prompt_tokens=5,
                      num_output_tokens=4, logprobs=[-0.4], token_logprobs=_rows([4]),
                      finished=True, finish_reason="length")
    m = merge_outputs([a, b, c])
    assert m.request_id == "r" and m.token_ids == [1, 2, 3, 4] and m.text == "abcd"
    assert m.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert m.token_logprobs.token_ids == [1, 2, 3, 4]
    assert m.prompt_logprobs == a.prompt_logprobs and m.prompt_text == "ppp"  # first piece's
    assert (m.num_prompt_tokens, m.num_output_tokens) == (5, 4)  # cumulative: the last piece's
    assert m.finished and m.finish_reason == "length"
    assert a.token_ids == [1, 2] and a.text == "ab"  # the pieces themselves are unchanged
    assert merge_outputs([b]) is b
    plain = merge_outputs([RequestOutput(request_id="r", token_ids=[1]),
                           RequestOutput(request_id="r", token_ids=[2])])
    assert plain.logprobs is None and plain.token_logprobs is None and plain.prompt_text is None


@pytest.mark.asyncio
async def test_a_stream_behind_gets_one_piece_then_ends_once() -> None:
    aborted: list = []
    stream = RequestStream("r", lambda rid, why: aborted.append(rid))
    sink = stream.sink()
    sink(RequestOutput(request_id="r", token_ids=[1], text="a"))
    first = await stream.__anext__()  # caught up: the piece as it came
    assert first.token_ids == [1]
    for t in (2, 3):
        sink(RequestOutput(request_id="r", token_ids=[t], text=str(t)))
    sink(RequestOutput(request_id="r", token_ids=[4], text="4", finished=True,
                       finish_reason="length"))
    rest = [out async for out in stream]
    assert len(rest) == 1 and rest[0].token_ids == [2, 3, 4] and rest[0].text == "234"
    assert rest[0].finished
    sink(RequestOutput(request_id="r", token_ids=[5]))  # nothing after the end
    assert [out async for out in stream] == [] and aborted == []


@pytest.mark.asyncio
async def test_pieces_before_an_error_come_first_merged() -> None:
    stream = RequestStream("r", lambda rid, why: None)
    sink = stream.sink()
    sink(RequestOutput(request_id="r", token_ids=[1]))
    sink(RequestOutput(request_id="r", token_ids=[2]))
    sink(EngineDeadError("engine failed", RuntimeError("boom")))
    out = await stream.__anext__()
    assert out.token_ids == [1, 2] and not out.finished
    with pytest.raises(EngineDeadError):
        await stream.__anext__()
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


@pytest.mark.asyncio
async def test_a_consumer_that_fell_behind_gets_the_same_output() -> None:
    """A consumer that reads nothing until its request has finished gets all of it in one piece,
    equal to what a consumer that kept up joined from its pieces."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0, logprobs=True,
                            top_logprobs=2)
    prompt = [5, 17, 42, 99, 3]
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        pieces = [out async for out in eng.generate(prompt, params)]
        assert len(pieces) > 1 and sum(p.finished for p in pieces) == 1 and pieces[-1].finished
        stream = eng.generate(prompt, params, request_id="late")
        with anyio.fail_after(30):
            while "late" in eng._sinks:  # until its terminal output was delivered
                await anyio.sleep(0.01)
        late = [out async for out in stream]
    assert len(late) == 1 and late[0].finished and late[0].finish_reason == "length"
    joined = merge_outputs(pieces)
    assert late[0].token_ids == joined.token_ids and len(joined.token_ids) == 24
    assert late[0].text == joined.text == "".join(p.text for p in pieces)
    assert late[0].logprobs == joined.logprobs
    assert late[0].token_logprobs.rows == joined.token_logprobs.rows
    assert late[0].num_output_tokens == 24


@pytest.mark.asyncio
async def test_step_thread_runs_every_call_on_one_thread() -> None:
    step = StepThread(anyio.CapacityLimiter(1))
    try:
        idents = {await step.run(threading.get_ident) for _ in range(5)}
        assert len(idents) == 1 and threading.get_ident() not in idents

        def boom():
            raise ValueError("in the step")

        with pytest.raises(ValueError, match="in the step"):
            await step.run(boom)
        assert await step.run(threading.get_ident) in idents  # the thread outlives an error
    finally:
        step.close()
    after = await step.run(threading.get_ident)  # closed: a new thread
    step.close()
    assert after not in idents


@pytest.mark.asyncio
async def test_cancelling_a_step_waits_for_it() -> None:
    step = StepThread(anyio.CapacityLimiter(1))
    release = threading.Event()
    done: list = []

    def slow():
        release.wait(10)
        done.append(True)

    timer = threading.Timer(0.05, release.set)  # lets the call end once cancelled (not timed)
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(step.run, slow)
                await anyio.sleep(0)
                scope.cancel()
                timer.start()
        assert done == [True]  # the call was not orphaned: cancellation waited for it
    finally:
        release.set()
        timer.cancel()
        step.close()


@pytest.mark.asyncio
async def test_an_abandonable_call_returns_at_once_when_cancelled() -> None:
    """``abandon_on_cancel`` (the load): cancellation is raised while the call runs on; the
    thread then finishes it and takes the next call."""
    step = StepThread(anyio.CapacityLimiter(1))
    release = threading.Event()
    done: list = []

    def slow():
        release.wait(10)
        done.append(True)

    try:
        with anyio.move_on_after(0.05):
            await step.run(slow, abandon_on_cancel=True)
        assert done == []  # not waited for
        release.set()
        assert await step.run(lambda: list(done)) == [True]  # it ran on, then the next call
    finally:
        release.set()
        step.close()


@pytest.mark.asyncio
async def test_the_load_and_the_steps_run_on_one_thread(monkeypatch) -> None:
    """One thread runs torch's parallel ops from the load on (one OpenMP team: see
    engine/serving/step_thread.py)."""
    from engine.runner.model_runner import ModelRunner

    seen: dict[str, set] = {"load": set(), "step": set()}
    load, launch = ModelRunner.load, ModelRunner.launch

    def spy_load(self, *a, **kw):
        seen["load"].add(threading.get_ident())
        return load(self, *a, **kw)

    def spy_launch(self, *a, **kw):
        seen["step"].add(threading.get_ident())
        return launch(self, *a, **kw)

    monkeypatch.setattr(ModelRunner, "load", spy_load)
    monkeypatch.setattr(ModelRunner, "launch", spy_launch)
    async with AsyncEngine.open(EngineConfig(model=TINY)) as eng:
        async for _ in eng.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)):
            pass
    assert len(seen["load"]) == 1 and seen["load"] == seen["step"]


@pytest.mark.asyncio
async def test_overlapped_engine_delivers_the_same_streams() -> None:
    """Overlapped (outputs held until the next step is launched): every stream gets the same
    pieces' tokens as without overlap, in order, with one terminal output last; an abort and a
    drain deadline still end their requests."""

    async def run(overlap: bool):
        cfg = EngineConfig(model=TINY, overlap_scheduling=overlap, max_num_seqs=8, seed=1)
        got: dict = {}
        async with AsyncEngine.open(cfg) as eng:
            async def one(i: int) -> None:
                params = SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True,
                                        temperature=0.0 if i % 2 else 0.8, seed=i)
                pieces = [out async for out in eng.generate([3 + i, 7, 11 + i, 40], params)]
                got[i] = pieces

            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(one, i)
            stream = eng.generate([9, 9, 9], SamplingParams(max_tokens=500, ignore_eos=True))
            first = await stream.__anext__()
            await eng.abort(stream.request_id, "stop here")
            rest = [out async for out in stream]
            tail = eng.generate([8, 8], SamplingParams(max_tokens=1000, ignore_eos=True))
            await tail.__anext__()
            await eng.drain(0, reason="deadline")
            ended = [out async for out in tail]
        return got, first, rest, ended

    plain, overlapped = await run(False), await run(True)
    for got in (plain[0], overlapped[0]):
        for pieces in got.values():
            assert [p.finished for p in pieces].count(True) == 1 and pieces[-1].finished
    for i in range(12):
        a, b = merge_outputs(plain[0][i]), merge_outputs(overlapped[0][i])
        assert a.token_ids == b.token_ids and a.text == b.text and len(a.token_ids) == 4 + 3 * i
    for _, first, rest, ended in (plain, overlapped):
        assert not first.finished and rest[-1].finish_reason == "abort"
        assert rest[-1].reason == "stop here" and sum(p.finished for p in rest) == 1
        assert ended[-1].finish_reason == "abort" and ended[-1].reason == "deadline"


@pytest.mark.asyncio
async def test_overlapped_first_token_is_not_held_for_the_next_launch() -> None:
    """Overlapped, a step's outputs wait for the next step's launch, except a request's first
    token (that launch's host time went into every TTFT): it arrives once the
    prefill and the step launched after it are in, before a third forward."""
    cfg = EngineConfig(model=TINY, overlap_scheduling=True, max_num_seqs=4, seed=1)
    async with AsyncEngine.open(cfg) as eng:
        s0 = eng.runner.steps
        at = {}  # the launches counted where an output is delivered (not where it is read:
        deliver = eng._deliver  # the consumer may be scheduled a step later on a busy box)

        def counted(outputs):
            for out in outputs:  # keyed by the count of tokens (the consumer may merge outputs)
                at.setdefault(out.num_output_tokens, eng.runner.steps - s0)
            deliver(outputs)

        eng._deliver = counted
        seen = []
        async for out in eng.generate([3, 7, 11, 40], SamplingParams(max_tokens=6,
                                                                     ignore_eos=True)):
            seen.append((at[out.num_output_tokens], len(out.token_ids), out.num_output_tokens))
    assert seen[0][1:] == (1, 1)  # the first token alone
    assert seen[0][0] == 2  # launched: the prefill and the step after it
    assert sum(n for _, n, _ in seen) == 6

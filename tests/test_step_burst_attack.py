"""Attacks on step bursts (``AsyncEngine._burst``): what the event loop does while the step
thread runs steps back to back must not cost a request its one terminal output, duplicate or
lose its tokens, or reorder them -- nor leave a call hanging on a dying or stopping engine.

Each event is injected *on the step thread between two steps of a burst* (``EngineCore.step``
wrapped: the hook runs the action on the event loop and waits for it there), so where it lands
is fixed by the step count, not by timing. Every scenario is run with bursts (10 s budget: only
the loop's work ends one) and without (``step_burst_ms=0``, a round trip per step); the streams
must be the same, item for item."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.core.engine_core import EngineCore
from engine.errors import EngineDeadError
from states import State

TINY = "random:tiny-llama"
PROMPTS = [[(5 * i + 3 * j) % 250 + 1 for j in range(4 + (i * 7) % 30)] for i in range(8)]
LONG = 10_000.0  # ms: a burst ends only for the loop's work


class Rec:
    """A sink that checks the stream's contract as items arrive."""

    def __init__(self):
        self.tokens: list[int] = []
        self.items: list = []
        self.end = None
        self.errors: list[str] = []
        self.done = anyio.Event()

    def __call__(self, item):
        if self.end is not None:
            self.errors.append(f"item after the terminal one: {item!r}")
        self.items.append(item)
        if isinstance(item, BaseException):
            self.end = item
            self.done.set()
            return
        self.tokens += item.token_ids
        if item.token_ids and item.num_output_tokens != len(self.tokens):
            self.errors.append(f"num_output_tokens {item.num_output_tokens} after "
                               f"{len(self.tokens)} tokens (lost or repeated)")
        if item.finished:
            self.end = item
            self.done.set()

    def summary(self):
        end = self.end
        if isinstance(end, BaseException):
            end = type(end).__name__
        elif end is not None:
            end = (end.finish_reason, end.reason)
        return self.tokens, end


@pytest.fixture
def hooks(monkeypatch):
    """``hooks[k] = (where, fn)``: on the step thread, at the k-th ``EngineCore.step`` call,
    ``fn(eng_state)`` -- ``where`` "after": once the step returned (between two steps),
    "launched": in the step, once the next step is launched (after ``on_launched``)."""
    table: dict[int, tuple] = {}
    state = {"calls": 0, "bursting_at": {}, "unlaunched": 0}
    real = EngineCore.step

    def step(self, on_launched=None):
        state["calls"] += 1
        k = state["calls"]
        where, fn = table.get(k, (None, None))
        called = []

        def wrapped():
            called.append(k)
            if on_launched is not None:
                on_launched()
            if where == "launched":
                state["bursting_at"][k] = state["engine"]._bursting
                fn(state)

        was_in_flight = self.in_flight
        out = real(self, wrapped)
        if was_in_flight and self.in_flight and not called:  # applied first, no launch call
            state["unlaunched"] += 1
        if where == "after":
            state["bursting_at"][k] = state["engine"]._bursting
            fn(state)
        return out

    monkeypatch.setattr(EngineCore, "step", step)
    table_state = (table, state)
    return table_state


def on_loop(state, fn):
    """Run ``fn()`` on the event loop from the step thread; wait for it."""
    loop: asyncio.AbstractEventLoop = state["loop"]
    done = threading.Event()
    box: list = []

    def run():
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001
            box.append(exc)
        finally:
            done.set()

    loop.call_soon_threadsafe(run)
    assert done.wait(10), "the event loop did not run the injected call"
    return box[0] if box else None


def until_not_serving(state):
    """On the step thread: wait until the task just started on the loop left SERVING (so the
    transition lands between these two steps, whatever the loop's timing)."""
    import time
    t = time.monotonic() + 10
    while state["engine"].state is State.SERVING:
        assert time.monotonic() < t, "the transition did not happen"
        time.sleep(0.001)


async def scenario(hooks, burst_ms, n=6, max_tokens=None, after=None, params=None, **cfg_kw):
    """Submit ``n`` requests; run; return {rid: (tokens, terminal)} and the engine."""
    table, state = hooks
    state["calls"] = state["unlaunched"] = 0
    state["bursting_at"].clear()
    cfg = EngineConfig(model=TINY, overlap_scheduling=True, step_burst_ms=burst_ms, **cfg_kw)
    recs: dict[str, Rec] = {}
    eng = AsyncEngine(cfg, check_integrity=True)
    state["engine"] = eng
    state["loop"] = asyncio.get_running_loop()
    state["recs"] = recs
    state["tasks"] = tasks = []
    try:
        async with anyio.create_task_group() as tg:
            await eng.start(tg)
            ps = [params(i) if params else SamplingParams(
                max_tokens=max_tokens[i] if max_tokens else 30, ignore_eos=True)
                for i in range(n)]
            for p in ps:  # every constraint compiled first: no add is delayed
                if p.structured is not None:
                    await eng.grammars.compiled(p.structured)
            for i, p in enumerate(ps):
                rid = f"r{i}"
                recs[rid] = Rec()
                eng.submit(PROMPTS[i], p, rid, recs[rid])
            with anyio.fail_after(18):
                for r in list(recs.values()):
                    await r.done.wait()
                if after is not None:
                    await after(eng, recs)
                for r in list(recs.values()):
                    await r.done.wait()
                if eng.state in (State.SERVING, State.SLEEPING, State.DRAINING):
                    await eng.drain(0)
                await eng.wait_stopped()
                for t in tasks:
                    await t
    except EngineDeadError:
        pass
    for rid, r in recs.items():
        assert not r.errors, (rid, r.errors)
        assert r.end is not None, f"{rid}: no terminal output"
    eng.unlaunched = state["unlaunched"]
    return {rid: r.summary() for rid, r in recs.items()}, eng, dict(state["bursting_at"])


def _assert_mid_burst(bursting_at, k):
    assert bursting_at.get(k) is True, f"the hook at step {k} did not run inside a burst"


async def both(hooks, **kw):
    with_bursts, eng, at = await scenario(hooks, LONG, **kw)
    without, eng0, _ = await scenario(hooks, 0.0, **kw)
    return with_bursts, without, eng, at


@pytest.mark.asyncio
async def test_plain_run_with_varied_lengths_matches(hooks):
    lengths = [1, 2, 5, 9, 17, 30]
    a, b, eng, _ = await both(hooks, max_tokens=lengths)
    assert a == b
    for i, n in enumerate(lengths):
        toks, end = a[f"r{i}"]
        assert len(toks) == n and end == ("length", None)


@pytest.mark.asyncio
async def test_abort_between_two_steps_of_a_burst(hooks):
    table, _ = hooks
    table[8] = ("after", lambda s: on_loop(s, lambda: s["engine"]._abort_nowait("r2", "gone")))
    a, b, eng, at = await both(hooks)
    _assert_mid_burst(at, 8)
    assert a == b
    assert a["r2"][1] == ("abort", "gone") and len(a["r2"][0]) < 30
    assert all(a[f"r{i}"][1] == ("length", None) for i in (0, 1, 3, 4, 5))


@pytest.mark.asyncio
async def test_abort_from_another_thread_in_the_launch(hooks):
    # the step thread itself aborts (any thread may): nothing wakes the loop, the burst must end
    table, _ = hooks
    table[9] = ("launched", lambda s: s["engine"]._abort_nowait("r4", "gone"))
    a, b, eng, at = await both(hooks)
    _assert_mid_burst(at, 9)
    assert a == b and a["r4"][1] == ("abort", "gone")


@pytest.mark.asyncio
async def test_new_request_mid_burst_gets_its_first_token_and_the_same_stream(hooks):
    table, _ = hooks

    def add(s):
        def go():
            r = s["recs"]["late"] = Rec()
            s["engine"].submit(PROMPTS[7], SamplingParams(max_tokens=12, ignore_eos=True),
                               "late", r)
        on_loop(s, go)

    table[7] = ("after", add)
    a, b, eng, at = await both(hooks)
    _assert_mid_burst(at, 7)
    assert a == b and a["late"] == (b["late"][0], ("length", None)) and len(a["late"][0]) == 12


@pytest.mark.parametrize("timeout", [None, 0.0])
@pytest.mark.asyncio
async def test_drain_mid_burst(hooks, timeout):
    table, _ = hooks
    def drain(s):
        on_loop(s, lambda: s["tasks"].append(asyncio.ensure_future(s["engine"].drain(timeout))))
        until_not_serving(s)

    table[6] = ("after", drain)
    a, b, eng, at = await both(hooks)
    _assert_mid_burst(at, 6)
    assert eng.state is State.SHUTDOWN and eng.exit_code == 0
    if timeout is None:
        assert a == b and all(end == ("length", None) for _, end in a.values())
    else:
        assert a == b and all(end == ("abort", "drain timeout") for _, end in a.values())


def _sleep_at(table, step: int, mode: str, slept: dict) -> None:
    """After ``step``: the engine is put to sleep (level 1, ``mode``) from the loop; ``slept``
    gets "ok" once the sleep has returned."""
    def sleep(s):
        async def go():
            await s["engine"].sleep(1, mode)
            slept["ok"] = True
        on_loop(s, lambda: s["tasks"].append(asyncio.ensure_future(go())))
        until_not_serving(s)

    table[step] = ("after", sleep)


async def _until_slept(eng, slept: dict) -> None:
    while not slept:
        await anyio.sleep(0.01)
    assert eng.state is State.SLEEPING


@pytest.mark.asyncio
async def test_sleep_abort_mid_burst_then_wake_and_serve(hooks):
    table, _ = hooks
    slept = {}
    _sleep_at(table, 6, "abort", slept)

    async def after(eng, recs):
        await _until_slept(eng, slept)
        await eng.wake_up()
        r = recs["again"] = Rec()
        eng.submit(PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True), "again", r)

    a, b, eng, at = await both(hooks, after=after)
    _assert_mid_burst(at, 6)
    assert all(a[f"r{i}"][1] == ("abort", "sleep") for i in range(6))
    assert a == b and a["again"][1] == ("length", None) and len(a["again"][0]) == 5


@pytest.mark.parametrize("where", ["after", "launched"])
@pytest.mark.asyncio
async def test_exception_in_a_burst_step(hooks, where):
    # a failure inside a step of a burst: every stream gets the outputs it was given before,
    # then exactly one EngineDeadError; the engine stops (no call hangs)
    table, _ = hooks

    def boom(s):
        raise RuntimeError("injected")

    table[10] = (where, boom)
    a, b, eng, at = await both(hooks)
    _assert_mid_burst(at, 10)
    assert a == b
    assert all(end == "EngineDeadError" for _, end in a.values())
    assert eng.state is State.SHUTDOWN and eng.exit_code == 1


@pytest.mark.asyncio
async def test_fault_at_step_in_a_burst(hooks, inject_fault):
    inject_fault(12)
    a, b, eng, _ = await both(hooks)
    assert a == b and all(end == "EngineDeadError" for _, end in a.values())
    assert all(len(toks) > 3 for toks, _ in a.values())
    assert eng.exit_code == 1


@pytest.mark.asyncio
async def test_rank_failure_mid_burst(hooks):
    # tensor parallel's watcher calls _rank_failed on the loop while the step thread bursts
    table, _ = hooks
    table[9] = ("after", lambda s: on_loop(s, lambda: s["engine"]._rank_failed(
        RuntimeError("rank 1 died"))))
    a, b, eng, at = await both(hooks)
    _assert_mid_burst(at, 9)
    assert a == b and all(end == "EngineDeadError" for _, end in a.values())
    assert eng.exit_code == 1


@pytest.mark.asyncio
async def test_preemption_steps_that_apply_first(hooks):
    # few KV blocks: steps apply the one in flight before scheduling (no on_launched call);
    # the burst keeps those outputs before the next ones
    kw = dict(num_kv_blocks=20, block_size=4, max_tokens=[20] * 6)
    a, b, eng, _ = await both(hooks, **kw)
    assert eng.unlaunched > 0, "no step applied the one in flight first"
    assert a == b
    assert all(end == ("length", None) and len(t) == 20 for t, end in a.values())


@pytest.mark.asyncio
async def test_cancelled_loop_mid_burst_ends_every_stream(hooks):
    # the loop's task group cancelled while a burst runs: the shielded wait ends with the
    # burst, then every stream gets EngineDeadError and the engine stops
    table, state = hooks
    state["calls"] = 0
    cfg = EngineConfig(model=TINY, overlap_scheduling=True, step_burst_ms=LONG)
    eng = AsyncEngine(cfg, check_integrity=True)
    state["engine"], state["loop"] = eng, asyncio.get_running_loop()
    recs = {f"r{i}": Rec() for i in range(4)}
    scope_box = []
    table[6] = ("after", lambda s: on_loop(s, lambda: scope_box[0].cancel()))
    with anyio.fail_after(18):
        async with anyio.create_task_group() as tg:
            scope_box.append(tg.cancel_scope)
            await eng.start(tg)
            for rid, r in recs.items():
                eng.submit(PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True), rid, r)
            await anyio.sleep_forever()
        await eng.wait_stopped()
    assert state["bursting_at"][6] is True
    for rid, r in recs.items():
        assert not r.errors and r.end is not None, rid
    # NOTE: the cancellation does not end the burst: it waits for the burst's budget or its
    # end (here the requests' last step), the bound step_burst_ms documents
    print("steps after the cancellation:", state["calls"] - 6,
          "tokens per stream:", [len(r.tokens) for r in recs.values()])


@pytest.mark.asyncio
async def test_rank_failure_between_a_launch_taking_the_held_outputs_and_their_delivery(
        hooks, monkeypatch):
    # The watcher's _rank_failed lands on the loop after ``launched()`` took ``_pending`` on the
    # step thread but before the delivery it posts: the outputs held then were due before
    # the EngineDeadError (``_fail_streams``: "after the outputs it was due"), as when the
    # loop itself flushed ``_pending``.
    from engine.serving.step_thread import StepThread

    table, state = hooks
    real_poster = StepThread.poster
    fired = {}

    def poster(fn):
        post = real_poster(fn)
        loop = asyncio.get_running_loop()

        def racing(*args):
            if state["calls"] == 9 and not fired:
                held = args[0] if args else state["engine"]._handed[-1]
                fired["held"] = [(o.request_id, o.num_output_tokens) for o in held]
                loop.call_soon_threadsafe(state["engine"]._rank_failed,
                                          RuntimeError("rank 1 died"))
            return post(*args)

        return racing

    monkeypatch.setattr(StepThread, "poster", staticmethod(poster))
    a, eng, at = (await scenario(hooks, LONG))
    assert fired.get("held"), "the race was not set up"
    assert all(end == "EngineDeadError" for _, end in a.values())
    # each held output reached its stream before the error
    lost = [(rid, n, len(a[rid][0])) for rid, n in fired["held"] if len(a[rid][0]) < n]
    assert not lost, f"held outputs lost: (request, its output count, tokens delivered) {lost}"


@pytest.mark.asyncio
async def test_constrained_requests_in_bursts(hooks):
    # the late-sampled steps (forward, then on_launched, then masks): same streams, and a
    # constrained request aborted mid-burst ends once
    from engine import StructuredOutputs

    regex = StructuredOutputs(regex=r"(ab|cd){10,14}x")
    schema = StructuredOutputs(json_object=True)

    def params(i):
        return SamplingParams(max_tokens=30 + i, structured=(regex, schema, None, regex)[i % 4],
                              temperature=0.9 if i % 4 == 3 else 0.0, seed=i)

    table, _ = hooks
    table[11] = ("after", lambda s: on_loop(s, lambda: s["engine"]._abort_nowait("r3", "gone")))
    a, b, eng, at = await both(hooks, params=params)
    _assert_mid_burst(at, 11)
    assert a == b
    assert a["r3"][1] == ("abort", "gone")
    assert all(end is not None and end[0] in ("stop", "length") for rid, (_, end) in a.items()
               if rid != "r3")


@pytest.mark.asyncio
async def test_sleep_wait_mid_burst_lets_requests_finish(hooks):
    table, _ = hooks
    slept = {}
    _sleep_at(table, 6, "wait", slept)

    async def after(eng, recs):
        await _until_slept(eng, slept)

    a, b, eng, at = await both(hooks, after=after, max_tokens=[3, 8, 13, 21, 30, 30])
    _assert_mid_burst(at, 6)
    assert a == b and all(end == ("length", None) for _, end in a.values())


@pytest.mark.asyncio
async def test_abort_of_a_request_whose_end_is_held_in_the_burst(hooks):
    # r0 finishes inside a burst; its last output is held (not delivered yet) when the client
    # aborts it: it still ends once, by length, with all its tokens
    table, _ = hooks
    fired = {}  # engine -> whether its step thread was bursting when the abort came

    def maybe_abort(s):
        eng = s["engine"]
        if eng not in fired and "r0" not in eng.core.requests and s["recs"]["r0"].end is None:
            fired[eng] = eng._bursting
            on_loop(s, lambda: eng._abort_nowait("r0", "late"))

    for k in range(2, 20):
        table[k] = ("after", maybe_abort)
    a, b, eng, at = await both(hooks, max_tokens=[4, 30, 30, 30, 30, 30])
    assert list(fired.values()) == [True, True], "the abort did not meet a held end"
    assert a == b
    assert a["r0"] == (a["r0"][0], ("length", None)) and len(a["r0"][0]) == 4

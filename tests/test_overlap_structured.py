"""Overlapped scheduling with output constraints (engine/core/engine_core.py ``EngineCore.step``): a step
with a constrained request whose token is in flight is launched as its forward first; the step
before is applied (its matchers take their tokens) while the device runs it; then the masks
are filled and the step sampled. The outputs must be exactly those of the synchronous engine --
constrained and unconstrained requests in one batch, greedy and seeded, grammars that end
requests already scheduled into the next step -- with every request ending exactly once, also
on a dead end, an abort or a drain.
"""

from __future__ import annotations

import anyio
import pytest

from engine import AsyncEngine, StructuredOutputs
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner
from engine.structured.grammars import GrammarService

TINY = "random:tiny-llama"  # byte tokenizer: a byte is a token
REGEX = StructuredOutputs(regex=r"(ab|cd){2,9}x")
SCHEMA = StructuredOutputs(json_schema={"type": "object", "properties": {
    "t": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"enum": ["ab", "cd"]}},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["t", "n"]})


def _core(overlap: bool, after="apply-first", **kw) -> EngineCore:
    """``after``: a step sampled late applies the step before after its sampling is launched
    (``EngineCore.apply_after_sampling``, the CUDA order: "sample-first") instead of before
    (the CPU's: "apply-first"); "...-beside": the step before's tokens fed and the masks filled
    on a helper thread beside the forward's launch (``EngineCore.grammar_overlap``)."""
    r = ModelRunner(EngineConfig(model=TINY, device="cpu", dtype="float32",
                                 overlap_scheduling=overlap, max_num_seqs=32, seed=5, **kw))
    r.load()
    core = EngineCore(r, check_integrity=True)
    _order(core, after)
    return core


def _order(core: EngineCore, after: str) -> None:
    core.apply_after_sampling = after.startswith("sample-first")
    core.grammar_overlap = after.endswith("-beside")


AFTER = pytest.mark.parametrize("after", ["apply-first", "sample-first", "apply-first-beside",
                                          "sample-first-beside"])


_COMPILED: dict = {}  # (model, vocab size) -> {key: compiled grammar}: one compile a process


def _grammars(core: EngineCore) -> dict:
    """REGEX's and SCHEMA's compiled grammars for ``core``'s tokenizer. Compiled once a test
    process and model (a compiled grammar is immutable; each request gets its own matcher): a
    compile pool's worker process costs ~3 s to start, twice a test before."""
    key = (core.runner.config.model, core.runner.model_config.vocab_size)
    if key not in _COMPILED:
        svc = GrammarService(lambda: core.tokenizer, lambda: core.runner.model_config.vocab_size)

        async def compile_all():
            return {c.key: await svc.compiled(c) for c in (REGEX, SCHEMA)}

        try:
            _COMPILED[key] = anyio.run(compile_all)
        finally:
            svc.close()
    return _COMPILED[key]


def _mixed(n: int):
    """Constrained (regex, JSON) and unconstrained requests, greedy and seeded, varied lengths."""
    for i in range(n):
        prompt = [(i * 13 + j * 7) % 200 + 32 for j in range(4 + i % 9)]
        c = (REGEX, SCHEMA, None)[i % 3]
        seeded = i % 4 == 3
        yield f"r{i}", prompt, SamplingParams(
            max_tokens=6 + (i * 5) % 40, temperature=0.9 if seeded else 0.0,
            seed=i if seeded else None, structured=c)


def _run(core: EngineCore, reqs, add_at: dict | None = None, abort_after: dict | None = None):
    """Step ``core`` until idle: {id: tokens}, {id: (finish_reason, reason)}. ``add_at``: step
    -> requests added after it; ``abort_after``: step -> ids aborted after it."""
    grammars = _grammars(core)
    tokens: dict[str, list[int]] = {}
    final: dict[str, tuple] = {}

    def add(batch):
        for rid, prompt, params in batch:
            c = params.structured
            core.add_request(rid, prompt, params, grammars[c.key] if c is not None else None)

    add(reqs)
    steps = 0
    while core.has_work():
        for o in core.step():
            assert o.request_id not in final, f"{o.request_id}: output after its terminal one"
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                final[o.request_id] = (o.finish_reason, o.reason)
        steps += 1
        add((add_at or {}).get(steps, []))
        for rid in (abort_after or {}).get(steps, []):
            o = core.abort(rid, "client")
            if o is not None:
                assert rid not in final
                final[rid] = (o.finish_reason, o.reason)
    assert not core.requests and core.scheduler.check_integrity() is None
    assert core.blocks.num_free == core.blocks.num_blocks
    core.runner.shutdown()
    return tokens, final


def _text(core_tokens: list[int]) -> str:
    return bytes(t for t in core_tokens if t < 256).decode("latin-1")


@AFTER
def test_mixed_constrained_batch_overlapped_gives_the_synchronous_outputs(after):
    sync = _run(_core(False), list(_mixed(24)))
    core = _core(True, after)
    over = _run(core, list(_mixed(24)))
    assert over == sync
    assert len(over[1]) == 24
    # the grammars ended some requests (each while its next step was already in flight)
    stops = [rid for rid, f in over[1].items() if f == ("stop", None) and int(rid[1:]) % 3 < 2]
    assert len(stops) >= 4, over[1]
    import re

    for rid in stops:
        if int(rid[1:]) % 3 == 0:
            assert re.fullmatch(r"(ab|cd){2,9}x", _text(over[0][rid])), over[0][rid]
    # the constrained requests kept the overlap: most steps were deferred, and the steps with a
    # constrained token in flight were sampled after the step before was applied
    assert core.deferred_steps > 0.8 * core.statistics().steps
    assert core.late_sampled_steps > 0
    # beside: the late steps' grammar work ran on the helper thread (the tokens are always back
    # by then on the CPU, and no token here is refused)
    assert (core.grammar_jobs == core.late_sampled_steps) == after.endswith("-beside")


@AFTER
def test_dead_end_with_overlap_ends_that_request_with_error(after):
    """An allow-list the grammar excludes forces a dead end (the matcher refuses the sampled
    token); it joins a batch whose constrained requests have tokens in flight. That request
    ends with "error", the others are those of the synchronous engine."""
    def work():
        return list(_mixed(9))

    def late():
        # 120 = "x": the regex needs "ab" or "cd" first
        return {2: [("dead", [40, 41, 42], SamplingParams(
            max_tokens=8, allowed_token_ids=[120], structured=REGEX))]}

    sync = _run(_core(False), work(), add_at=late())
    core = _core(True, after)
    over = _run(core, work(), add_at=late())
    assert over == sync
    assert over[1]["dead"][0] == "error" and "grammar" in over[1]["dead"][1]
    assert over[0].get("dead", []) == []
    assert core.late_sampled_steps > 0 and core.deferred_steps > 0


@AFTER
def test_abort_with_constrained_tokens_in_flight(after):
    core = _core(True, after)
    tokens, final = _run(core, list(_mixed(12)),
                         abort_after={1: ["r0", "r1"], 3: ["r3", "r4", "r9"], 5: ["r6"]})
    assert len(final) == 12
    assert final["r0"] == ("abort", "client") and final["r4"] == ("abort", "client")
    assert core.late_sampled_steps > 0


@AFTER
@pytest.mark.asyncio
async def test_drain_with_constrained_requests_in_flight_overlapped(after):
    """Overlap forced on (on CPU it is off by default): a drain with constrained requests
    running (and one unconstrained) ends each stream exactly once."""
    cfg = EngineConfig(model=TINY, device="cpu", num_kv_blocks=256, overlap_scheduling=True)
    async with AsyncEngine.open(cfg, check_integrity=True) as eng:
        _order(eng.core, after)
        streams = [eng.generate("ab", SamplingParams(
            max_tokens=300, structured=REGEX if k % 2 else StructuredOutputs(json_object=True)))
            for k in range(6)]
        streams.append(eng.generate("ab", SamplingParams(max_tokens=300, ignore_eos=True)))
        ends: dict[str, list] = {s.request_id: [] for s in streams}

        async def read(s):
            async for o in s:
                ends[s.request_id].append(o.finished)

        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(read, s)
            with anyio.fail_after(30):
                while eng.core.late_sampled_steps < 3:
                    await anyio.sleep(0.005)
            await eng.drain(0)
    assert all(sum(v) == 1 and v[-1] for v in ends.values()), ends
    assert eng.runner.released


"""Prefix caching end to end: greedy outputs of the embedded model are token-identical
with the cache on and off — shared prefixes ending mid-block, prompts cached entirely, multi-turn
prompts that extend earlier ones, chunked prefill, preemption pressure — and the statistics,
invalidation and shutdown behave."""

from __future__ import annotations

import anyio
import pytest

from engine import AsyncEngine, EngineConfig, ModelRunner, SamplingParams
from engine.core.engine_core import EngineCore
from engine.memory.owner import Resource as R
from engine.request import Request
from entrypoints.args import add_model_args, config_from_args

SYSTEM = ("You are a careful assistant. Answer in one short sentence, use plain words, and "
          "never make up facts about places, people or numbers you do not know well.")
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Who wrote Hamlet?",
             "What is water made of?"]
FOLLOW_UP = " Tell me one more thing about it."
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
# SmolLM2 in fp32: 30 layers x (k, v) x 3 KV heads x 64 x 4 bytes a token, 16 tokens a block
BLOCK_BYTES = 30 * 2 * 3 * 64 * 4 * 16

_memo: dict = {}


async def _one(eng, prompt, out, key, params=PARAMS):
    toks = []
    async for o in eng.generate(prompt, params):
        toks += o.token_ids
    out[key] = toks


async def _wave(eng, prompts: dict) -> dict:
    out: dict = {}
    async with anyio.create_task_group() as tg:
        for key, p in prompts.items():
            tg.start_soon(_one, eng, p, out, key)
    return out


async def _conversations(config: EngineConfig):
    """Two waves: first turns (and a prompt of exactly three blocks), then second turns that
    extend the first ones with their answers, and the first prompts again (cached entirely)."""
    async with AsyncEngine.open(config, check_integrity=True) as eng:
        tok = eng.tokenizer
        system = tok.encode(SYSTEM)[:37]  # ends 5 tokens into the third block
        first = {f"q{i}": system + tok.encode(" " + q) for i, q in enumerate(QUESTIONS)}
        first["blocks3"] = (system + tok.encode(" " + QUESTIONS[0]))[:48]
        out = await _wave(eng, first)
        second = {f"turn2-{k}": p + out[k] + tok.encode(FOLLOW_UP) for k, p in first.items()}
        second.update({f"again-{k}": p for k, p in first.items()})
        out.update(await _wave(eng, second))
        stats = eng.statistics()
        blocks = eng.core.blocks
    assert blocks.closed and blocks.statistics().cached_blocks == 0  # released with the KV cache
    return out, stats


async def _run(name: str, **kw):
    if name not in _memo:  # float32: token identity needs kernels that ignore the row count
        _memo[name] = await _conversations(EngineConfig(model="default", device="cpu", dtype="float32", **kw))
    return _memo[name]


@pytest.mark.asyncio
async def test_greedy_identical_with_caching_on_and_off():
    off, off_stats = await _run("off", enable_prefix_caching=False)
    on, on_stats = await _run("on", max_num_batched_tokens=64)  # chunked prefills too
    assert on == off
    assert off_stats.prefix_cache_queries == 0 and off_stats.prefix_cache_hits == 0
    assert on_stats.prefix_cache_queries == on_stats.prompt_tokens
    # the second wave alone re-reads the first wave's prompts: a large share is cached
    assert on_stats.prefix_cache_hits > 0.4 * on_stats.prefix_cache_queries
    assert on_stats.generation_tokens == off_stats.generation_tokens == len(on) * PARAMS.max_tokens


@pytest.mark.asyncio
async def test_one_burst_shares_its_prefix_in_its_first_step():
    """The first wave alone, sent at once to a fresh engine with the default token budget: the
    first prompt's chunk registers the system prompt's blocks when it is scheduled, so the four
    others admitted in the same step hit them (a step with no cache would compute them five
    times) -- and every output equals the uncached engine's."""
    off, _ = await _run("off", enable_prefix_caching=False)
    async with AsyncEngine.open(EngineConfig(model="default", device="cpu", dtype="float32"),
                                check_integrity=True) as eng:
        tok = eng.tokenizer
        system = tok.encode(SYSTEM)[:37]
        first = {f"q{i}": system + tok.encode(" " + q) for i, q in enumerate(QUESTIONS)}
        first["blocks3"] = (system + tok.encode(" " + QUESTIONS[0]))[:48]
        out = await _wave(eng, first)
        stats = eng.statistics()
    assert out == {k: off[k] for k in first}
    # q1..q3 and blocks3 each hit the system prompt's 2 full blocks (blocks3's third is its
    # last: the last token is always computed)
    assert stats.prefix_cache_hits == 4 * 32, stats
    assert stats.steps <= PARAMS.max_tokens + 1  # all five in the first step


@pytest.mark.asyncio
async def test_greedy_identical_under_preemption_pressure():
    off, _ = await _run("off", enable_prefix_caching=False)
    got, stats = await _run("small", kv_cache_bytes=7 * BLOCK_BYTES)
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
    assert got == off


@pytest.mark.asyncio
async def test_reset_drops_the_cache_and_keeps_outputs():
    prompt = list(range(5, 70))
    async with AsyncEngine.open(EngineConfig(model="random:tiny-llama", device="cpu"),
                                check_integrity=True) as eng:
        blocks = eng.core.blocks
        first = await _wave(eng, {"a": prompt})
        assert blocks.statistics().cached_blocks == 5  # 65 + 15 computed: the answer's too
        again = await _wave(eng, {"a": prompt})
        hits = eng.statistics().prefix_cache_hits
        assert hits == 64  # 65 tokens: four blocks, the last token recomputed
        blocks.reset_prefix_cache(weights_version=1)
        assert blocks.statistics().cached_blocks == 0 and blocks.weights_version == 1
        after = await _wave(eng, {"a": prompt})
        assert eng.statistics().prefix_cache_hits == hits  # nothing found after the reset
    assert first == again == after



def _run_until_idle(core, after_step) -> dict[str, list[int]]:
    """Step ``core`` until idle (``after_step(steps)`` after each step): each request's tokens;
    every request gone and every block free at the end."""
    out: dict[str, list[int]] = {}
    steps = 0
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        steps += 1
        after_step(steps)
    assert not core.requests and core.blocks.num_free == core.blocks.num_blocks
    return out

def _core_tokens(core, rid, prompt) -> list[int]:
    core.add_request(rid, prompt, PARAMS)
    toks: list[int] = []
    while core.has_work():
        for o in core.step():
            toks += o.token_ids
    return toks


@pytest.mark.parametrize("caching", [True, False])
def test_abort_mid_prefill_caches_only_what_was_computed(caching):
    prompt = list(range(3, 200))  # 197 tokens: 12 full blocks
    runner = ModelRunner(EngineConfig(model="random:tiny-llama", device="cpu",
                                      max_num_batched_tokens=40, enable_prefix_caching=caching))
    runner.load()
    try:
        core = EngineCore(runner, check_integrity=True)
        core.add_request("victim", prompt, PARAMS)
        core.step()
        core.step()  # 80 tokens computed: 5 full blocks
        assert core.abort("victim", "test").finished
        assert core.blocks.num_free == core.blocks.num_blocks
        assert core.blocks.statistics().cached_blocks == (5 if caching else 0)
        got = _core_tokens(core, "p", prompt)
        assert core.statistics().prefix_cache_hits == (80 if caching else 0)
        _memo.setdefault("abort", []).append(got)
    finally:
        runner.shutdown()
    if len(_memo["abort"]) == 2:
        assert _memo["abort"][0] == _memo["abort"][1]


@pytest.mark.asyncio
async def test_a_fault_drops_the_cache_with_the_kv_cache(inject_fault):
    from engine import EngineDeadError

    prompt = list(range(5, 60))
    inject_fault(20)
    async with AsyncEngine.open(EngineConfig(model="random:tiny-llama", device="cpu")) as eng:
        blocks = eng.core.blocks
        await _wave(eng, {"a": prompt[:40]})  # 16 steps; its full blocks stay cached
        assert blocks.statistics().cached_blocks == 3
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate(prompt, PARAMS):
                pass
        await eng.wait_stopped()
        assert eng.runner.released and blocks.closed
        assert blocks.statistics().cached_blocks == 0 and blocks.lookup(Request("x", prompt, PARAMS)) == []


def test_cli_flag_turns_caching_off():
    import argparse

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert config_from_args(p.parse_args([])).enable_prefix_caching is True
    assert config_from_args(p.parse_args(["--no-prefix-caching"])).enable_prefix_caching is False


SPEC_CASES = {
    "ngram": dict(speculator="ngram"),
    "ngram-small-kv": dict(speculator="ngram", num_kv_blocks=10, max_num_batched_tokens=48),
    "draft-small-kv": dict(speculator="draft", draft_model="random:tiny-llama@seed=1",
                           num_kv_blocks=10),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(SPEC_CASES))
async def test_speculative_decoding_over_cached_prefixes(case):
    """Draft tokens write only private blocks, rollback gives back only those, and the cached
    prefixes they extend give the same greedy tokens as no cache and no speculator."""
    shared = [(3 * j) % 97 + 5 for j in range(40)]  # 2.5 blocks, repeated text for n-grams
    prompts = {f"p{i}": shared + [(i * 7 + j) % 50 + 100 for j in range(i % 4)] + shared[:8]
               for i in range(8)}
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    async def run(**kw):
        async with AsyncEngine.open(EngineConfig(model="random:tiny-llama", device="cpu", **kw),
                                    check_integrity=True) as eng:
            outs = {}
            for wave in (list(prompts)[:2], list(prompts)[2:]):  # the second wave can hit
                async with anyio.create_task_group() as tg:
                    for k in wave:
                        tg.start_soon(_one, eng, prompts[k], outs, k, params)
            return outs, eng.statistics()

    if "spec-base" not in _memo:
        _memo["spec-base"] = await run(enable_prefix_caching=False)
    base, _ = _memo["spec-base"]
    got, stats = await run(**SPEC_CASES[case])
    assert got == base
    assert stats.prefix_cache_hits >= 6 * 32 and stats.spec_proposed > 0
    if "small" in case:
        assert stats.preemptions > 0


def _staggered(overlap: bool, caching: bool, ref: dict | None):
    """A burst sharing a 37-token prefix (ends mid-block): equal prompts, one that is a block of
    the prefix plus one token (a one-token chunk after a hit: a decode row); then after every
    step a request extending ``a``'s prompt with ``a``'s answer so far (``ref``: an earlier
    run's), which may hit the block ``a``'s decode fills in that step. A token budget of 37
    (chunks end anywhere in a block) and 16 KV blocks (preemptions). Returns the tokens, the
    statistics, the deferred steps and how many blocks some request held as computed while
    another request's chunk of the same step filled them (shared ahead). Blocks are filled
    with garbage when handed out, so that reading one before it is computed shows."""
    runner = ModelRunner(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32",
                                      overlap_scheduling=overlap, enable_prefix_caching=caching,
                                      max_num_batched_tokens=37, num_kv_blocks=16, seed=3))
    runner.load()
    core = EngineCore(runner, check_integrity=True)
    kv, allocate = runner.resource(R.KV_CACHE).tensor, core.blocks.allocate

    def poisoned(n):  # a block handed out holds garbage until its holder writes it
        out = allocate(n)
        kv[:, :, out] = 50.0  # finite: a masked read stays harmless
        return out

    core.blocks.allocate = poisoned
    sched, schedule = core.scheduler, core.scheduler.schedule
    ahead = 0

    def counting():
        nonlocal ahead
        batch, bs = schedule(), sched.block_size
        filled = {r.block_ids[p // bs] for r, n in batch
                  for p in range(r.num_computed_tokens, r.num_computed_tokens + n)}
        ahead += sum(b in filled for r, _ in batch for b in r.block_ids[: r.num_computed_tokens // bs])
        return batch

    sched.schedule = counting
    shared = [(5 * j) % 301 + 7 for j in range(37)]
    prompts = {"a": shared[:30], "b": shared + [11, 12], "c": shared + [11, 12], "d": shared[:33],
               "e": shared + [400 + j for j in range(12)], "f": shared[:32] + [9]}
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for rid, p in prompts.items():
        core.add_request(rid, p, params)
    def later(steps):
        if ref is not None and steps <= 20:
            core.add_request(f"x{steps}", prompts["a"] + ref["a"][: steps + 2] + [13], params)

    try:
        out = _run_until_idle(core, later)
        return out, core.statistics(), core.deferred_steps, ahead
    finally:
        runner.shutdown()


def test_greedy_identical_overlapped_small_budget_preempting_and_shared_ahead():
    """Caching on and off, overlapped scheduling on and off: the same greedy tokens, with blocks
    shared in the step that computes them (``BlockManager.seal_ahead``), a budget that ends
    chunks mid-block, preemptions, and requests arriving at every step (check_integrity on)."""
    probe = _staggered(False, False, None)[0]
    base, _, _, none_ahead = _staggered(False, False, probe)
    assert len(base) == 26 and none_ahead == 0
    for overlap in (False, True):
        got, stats, deferred, ahead = _staggered(overlap, True, probe)
        assert got == base, overlap
        assert stats.prefix_cache_hits > 0 and stats.preemptions > 0, stats
        assert ahead > 0 and (deferred > 0) == overlap
    assert _staggered(True, False, probe)[0] == base


def _self_preempting(overlap: bool, caching: bool) -> tuple[dict, object]:
    """``r``'s first chunk ends one token short of a block (budget 31 after ``p``'s 16); the
    next step it needs more blocks than are free, preempts itself, and resumes from what it
    computed once ``p`` is done."""
    runner = ModelRunner(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32",
                                      overlap_scheduling=overlap, enable_prefix_caching=caching,
                                      max_num_batched_tokens=31, num_kv_blocks=4, seed=3))
    runner.load()
    core = EngineCore(runner, check_integrity=True)
    core.add_request("p", [(3 * j) % 200 + 5 for j in range(16)],
                     SamplingParams(max_tokens=10, ignore_eos=True))
    core.add_request("r", [(7 * j) % 300 + 9 for j in range(60)],
                     SamplingParams(max_tokens=4, ignore_eos=True))
    out: dict[str, list[int]] = {}
    try:
        while core.has_work():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        return out, core.statistics()
    finally:
        runner.shutdown()


def test_a_chunk_that_preempts_itself_before_its_block_is_full_shares_nothing():
    """Only the blocks a scheduled chunk fills are registered ahead: ``r``'s block that its
    chunk left one token short is not found by its own resume (it would read that token's
    K/V, never computed)."""
    base = _self_preempting(False, False)[0]
    for overlap in (False, True):
        got, stats = _self_preempting(overlap, True)
        assert got == base and stats.preemptions > 0, (overlap, stats)


def _mirrored(mirrors: bool, monkeypatch) -> tuple[dict, object, dict]:
    """n-gram speculation (8 draft tokens: rollbacks), 12 KV blocks (preemptions), prefix caching
    (admissions onto cached blocks) and requests arriving as others run; blocks hold garbage when
    handed out. ``mirrors``: the decode rows' block tables come from ``host_arrays.block_table``
    (each one checked against the request's blocks when read), else from the lists (as before
    the mirrors). Returns the tokens, the statistics, and how the mirrors were read."""
    from engine.ops.host_arrays import block_table
    import engine.runner.model_runner as runner_mod

    seen = {"rebuilt": 0, "appended": 0, "reused": 0}

    def checked(req):
        m = req.block_mirror
        out = block_table(req)
        assert out.tolist() == req.block_ids, req  # never a stale or a wrong table
        if m is not None:
            key = ("reused" if m[3] is out else "rebuilt" if m[0] != req.block_epoch
                   else "appended")
            seen[key] += 1
        return out

    monkeypatch.setattr(runner_mod, "block_table", checked if mirrors else (lambda req: None))
    runner = ModelRunner(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32",
                                      speculator="ngram", num_speculative_tokens=8, ngram_min=2,
                                      num_kv_blocks=12, max_model_len=96,
                                      max_num_batched_tokens=40, seed=3))
    runner.load()
    core = EngineCore(runner, check_integrity=True)
    kv, allocate = runner.resource(R.KV_CACHE).tensor, core.blocks.allocate

    def poisoned(n):
        out = allocate(n)
        kv[:, :, out] = 50.0
        return out

    core.blocks.allocate = poisoned
    shared = [(3 * j) % 23 + 5 for j in range(36)]  # repeated text: n-gram drafts
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(4):
        core.add_request(f"a{i}", shared + [60 + i, 61, 62] * (i % 3), params)
    def later(steps):
        if steps % 7 == 0 and steps <= 42:
            core.add_request(f"b{steps}", shared[: 20 + steps % 13] + [70 + steps], params)

    try:
        return _run_until_idle(core, later), core.statistics(), seen
    finally:
        runner.shutdown()


def test_decode_block_tables_from_mirrors_equal_the_lists(monkeypatch):
    """The decode rows' block tables read from host_arrays.block_table's mirrors give the same
    greedy tokens as tables made from the lists, through draft rollbacks, preemptions and cache
    hits; every mirror read equals the blocks, and mirrors were appended to and rebuilt."""
    base, base_stats, _ = _mirrored(False, monkeypatch)
    got, stats, seen = _mirrored(True, monkeypatch)
    assert got == base and len(got) == 10
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert stats.spec_accepted > 0 and stats.spec_proposed > stats.spec_accepted, stats
    assert seen["rebuilt"] > 0 and seen["appended"] > 0 and seen["reused"] > 0, seen
    assert stats.steps == base_stats.steps

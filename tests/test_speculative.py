"""Speculative decoding (engine/spec_decode): n-gram and draft-model proposers.

* greedy outputs are token-identical to plain decoding (32 mixed requests, stop strings,
  max_tokens, the context limit, a small KV cache that forces preemption);
* sampled outputs keep the target distribution: at the verify-function level on synthetic
  logits (chi-square, many draws) and end to end on the first verified positions;
* release: after ``shutdown()`` nothing of the draft survives and the speculator goes first.
"""

from __future__ import annotations

import collections
import gc
import math
import random
import weakref

import anyio
import pytest
import torch

from engine import AsyncEngine, BadRequestError, EngineConfig, ModelRunner, SamplingParams
from engine.core.engine_core import EngineCore
from engine.memory.owner import reachable_tensors
from engine.sample.sampler import SamplingBatch
from engine.spec_decode import DraftSpeculator, NgramSpeculator, ngram_lookup, verify_tokens

MODEL = "random:tiny-llama"


# -- statistics helpers ----------------------------------------------------------------------------
def chi2_critical(df: int, alpha_z: float = 3.09) -> float:
    """Upper critical value of chi-square(df) at z (3.09: alpha = 0.001), Wilson–Hilferty."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + alpha_z * math.sqrt(a)) ** 3


def chi2_gof(counts: collections.Counter, probs: dict[int, float]) -> tuple[float, int]:
    """Goodness of fit of ``counts`` to ``probs``; cells expecting < 5 draws are pooled."""
    n = sum(counts.values())
    stat, df, pool_o, pool_e = 0.0, -1, 0, 0.0
    for tok in set(probs) | set(counts):
        e = probs.get(tok, 0.0) * n
        o = counts.get(tok, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / max(pool_e, 1e-9)
        df += 1
    else:
        assert pool_o == 0, "draws outside the target's support"
    return stat, max(df, 1)


def chi2_two_sample(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Homogeneity of two samples; categories with < 10 draws together are pooled."""
    na, nb = sum(a.values()), sum(b.values())
    cells, pa, pb = [], 0, 0
    for tok in set(a) | set(b):
        if a[tok] + b[tok] < 10:
            pa, pb = pa + a[tok], pb + b[tok]
        else:
            cells.append((a[tok], b[tok]))
    if pa + pb:
        cells.append((pa, pb))
    stat = 0.0
    for oa, ob in cells:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return stat, max(len(cells) - 1, 1)


def tv(counts: collections.Counter, probs: dict[int, float]) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(t, 0) / n - probs.get(t, 0.0)) for t in set(probs) | set(counts))


# -- verify at the function level ------------------------------------------------------------------
def _batch(n_rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0, gens=None):
    return SamplingBatch(
        temperature=torch.full((n_rows,), temperature), top_k=torch.full((n_rows,), top_k),
        top_p=torch.full((n_rows,), top_p), generators=gens or [None] * n_rows,
        all_greedy=temperature == 0, need_logprobs=False)


def test_verify_greedy_rule():
    # 3 entries: all drafts accepted (bonus), first rejected (correction), no drafts
    v = 10
    logits = torch.full((6, v), -5.0)
    for row, tok in enumerate([3, 4, 5, 7, 1, 2]):
        logits[row, tok] = 5.0
    rows = [[0, 1, 2], [3, 4], [5], []]
    drafts = [[3, 4], [8], [], []]
    toks, lps, n_acc = verify_tokens(logits, rows, drafts, _batch(6, 0.0))
    assert toks == [[3, 4, 5], [7], [2], []]
    assert n_acc == [2, 0, 0, 0] and lps is None
    sb = _batch(6, 0.0)
    sb.need_logprobs = True
    _, lps, _ = verify_tokens(logits, rows, drafts, sb)
    ref = logits.log_softmax(-1)
    assert lps[0] == pytest.approx([ref[0, 3].item(), ref[1, 4].item(), ref[2, 5].item()])
    assert lps[1] == pytest.approx([ref[3, 7].item()]) and lps[3] == []


@pytest.mark.parametrize("mode", ["point", "dense"])
@pytest.mark.parametrize("filters", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_verify_sampling_preserves_target_distribution(mode, filters):
    """Many independent entries, each with 2 drafts: the emitted token at position j must follow
    the (filtered) target law p_j, whatever the draft did — chi-square at alpha 0.001."""
    torch.manual_seed(1234)
    v, m, n = 6, 2, 30000
    base = torch.randn(m + 1, v) * 1.5
    logits = base.repeat(n, 1)  # entry e has rows 3e, 3e+1, 3e+2
    sb = _batch(n * (m + 1), **filters)
    from engine.sample.sampler import apply_penalty_free_filters

    p = apply_penalty_free_filters(base, _batch(m + 1, **filters)).softmax(-1)
    q = torch.softmax(torch.randn(m, v) * 1.5, -1)  # the draft's (different) law
    if mode == "point":  # n-gram: always the same deterministic proposal
        drafts = [[int(p[j].argsort()[-2]) for j in range(m)]] * n  # the runner-up token
        dprobs = None
    else:
        x = torch.stack([torch.multinomial(q[j], n, replacement=True) for j in range(m)], 1)
        drafts = x.tolist()
        dprobs = [q] * n
    rows = [list(range(e * (m + 1), (e + 1) * (m + 1))) for e in range(n)]
    toks, _, n_acc = verify_tokens(logits, rows, drafts, sb, dprobs)
    assert all(len(t) == a + 1 for t, a in zip(toks, n_acc))
    rate = sum(n_acc) / (n * m)
    assert 0.05 < rate < 0.95, rate  # both accepts and rejects happen
    for j in range(m + 1):
        drawn = collections.Counter(t[j] for t in toks if len(t) > j)
        law = {k: float(p[j, k]) for k in range(v) if p[j, k] > 0}
        stat, df = chi2_gof(drawn, law)
        assert stat < chi2_critical(df), (j, stat, df, drawn, law)
        # twice the expected total-variation distance of an exact sampler's empirical law
        n_j = sum(drawn.values())
        assert tv(drawn, law) < math.sqrt(2 * v / (math.pi * n_j)), (j, n_j, drawn, law)
    # the test has power: accepting every draft would emit the draft's law, far from p
    assert 0.5 * float((q[0] - p[0]).abs().sum()) > 0.2


def test_verify_seeded_rows_are_reproducible_and_batch_independent():
    torch.manual_seed(0)
    v = 8
    base = torch.randn(3, v)
    q = torch.softmax(torch.randn(2, v), -1)

    def run(extra: int):
        rows_n = 3 * (1 + extra)
        logits = base.repeat(1 + extra, 1)
        gens = [torch.Generator().manual_seed(7)] * 3 + [None] * (3 * extra)
        sb = _batch(rows_n, 1.0, gens=gens)
        rows = [list(range(e * 3, e * 3 + 3)) for e in range(1 + extra)]
        out, _, _ = verify_tokens(logits, rows, [[1, 2]] * (1 + extra), sb, [q] * (1 + extra))
        return out[0]

    assert run(0) == run(5) == run(2)


# -- n-gram ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_min,n_max,alphabet", [(1, 4, 6), (2, 3, 3), (1, 1, 10), (3, 8, 2)])
def test_ngram_lookup_matches_linear_scan(n_min, n_max, alphabet):
    rng = random.Random(n_min * 100 + n_max)

    class Req:
        def __init__(self, toks):
            self.request_id, self.token_ids = "r", toks

    spec = NgramSpeculator.__new__(NgramSpeculator)
    spec.n_min, spec.n_max, spec._hist = n_min, n_max, {}
    toks: list[int] = []
    for _ in range(300):  # grow one request token by token, checking every step
        toks.append(rng.randrange(alphabet))
        assert spec.lookup(Req(toks), 5) == ngram_lookup(toks, 5, n_min, n_max), toks
    assert ngram_lookup([1, 2, 3, 1, 2], 3, 1, 3) == [3, 1, 2]
    assert ngram_lookup([1, 2, 3, 9, 2], 3, 2, 3) == []
    assert ngram_lookup([5, 6, 7, 5, 8], 2, 1, 2) == []
    assert ngram_lookup([5, 6, 5, 7, 5], 2, 1, 2) == [7, 5]  # the most recent occurrence
    # fewer than k tokens follow it: the repeat goes on
    assert ngram_lookup([5, 5, 5], 4, 1, 2) == [5, 5, 5, 5]
    assert ngram_lookup([7, 1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]


def test_proposals_respect_max_tokens_and_context():
    cfg = EngineConfig(model=MODEL, device="cpu", speculator="ngram", num_speculative_tokens=8,
                       max_model_len=40)
    runner = ModelRunner(cfg)
    runner.load()
    try:
        core = EngineCore(runner, check_integrity=True)
        a = core.add_request("a", [1, 2, 3] * 4, SamplingParams(max_tokens=5, ignore_eos=True))
        b = core.add_request("b", [4, 5] * 14, SamplingParams(max_tokens=30, ignore_eos=True))
        seen = []
        while core.has_work():
            runner.speculator.propose(core.scheduler.running)
            for r in (a, b):
                if r.spec_token_ids:
                    seen.append(r.request_id)
                    assert len(r.spec_token_ids) <= r.params.max_tokens - r.num_output_tokens - 1
                    assert r.num_tokens + len(r.spec_token_ids) < runner.max_model_len
            batch = core.scheduler.schedule()
            core._update(batch, runner.execute(batch))
        assert a.num_output_tokens == 5 and b.num_tokens == 40  # max_tokens, context limit
        assert set(seen) == {"a", "b"}
        assert runner.speculator._hist == {}  # forgotten when finished
    finally:
        runner.shutdown()


def test_draft_vocabulary_must_match():
    runner = ModelRunner(EngineConfig(model=MODEL, device="cpu", speculator="draft",
                                      draft_model="random:smollm2-135m"))
    try:
        with pytest.raises(BadRequestError, match="vocabulary"):
            runner.load()
    finally:
        runner.shutdown()
    assert reachable_tensors(runner) == []


# -- end to end: greedy is token-identical --------------------------------------------------------
def _workload(n: int = 32, seed: int = 0) -> list[tuple[list[int], dict]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 0:  # repetitive: n-gram lookup finds it
            unit = [rng.randrange(256) for _ in range(rng.randrange(2, 7))]
            prompt = (unit * 12)[: rng.randrange(12, 48)]
        else:
            prompt = [rng.randrange(512) for _ in range(rng.randrange(3, 60))]
        out.append((prompt, dict(max_tokens=rng.randrange(8, 41), ignore_eos=True,
                                 logprobs=i % 5 == 0)))
    return out


async def _generate(cfg: EngineConfig, work, stops: dict[int, list[str]] | None = None,
                    seeds: bool = False):
    """Run ``work`` concurrently; returns ({i: (tokens, text, finish, reason, logprobs)},
    engine statistics, speculator statistics, speculator host state after the last request)."""
    res: dict[int, tuple] = {}
    async with AsyncEngine.open(cfg, check_integrity=True) as eng:
        async def one(i: int, prompt, kw):
            kw = dict(kw)
            if stops and i in stops:
                kw["stop"] = stops[i]
            if seeds:
                kw["seed"] = i
            toks, text, lps, last = [], "", [], None
            async for out in eng.generate(prompt, SamplingParams(**kw)):
                toks += out.token_ids
                text += out.text
                lps += out.logprobs or []
                last = out
            res[i] = (toks, text, last.finish_reason, last.reason, lps)

        async with anyio.create_task_group() as tg:
            for i, (prompt, kw) in enumerate(work):
                tg.start_soon(one, i, prompt, kw)
        stats = eng.statistics()
        spec = eng.runner.speculator
        spec_stats = spec.stats() if spec is not None else None
        state = None
        if isinstance(spec, DraftSpeculator):
            state = (dict(spec._seqs), spec.num_free_blocks, spec.num_blocks,
                     len(eng.runner.resource("speculator").state.generators))
        elif isinstance(spec, NgramSpeculator):
            state = dict(spec._hist)
    assert reachable_tensors(eng.runner) == []
    return res, stats, spec_stats, state


_MEMO: dict = {}


async def _memo(key, make):
    if key not in _MEMO:
        _MEMO[key] = await make()
    return _MEMO[key]


async def _stop_strings(work) -> dict[int, list[str]]:
    """Stop strings that occur in the middle of some plain-greedy outputs."""
    async def make():
        res, *_ = await _generate(EngineConfig(model=MODEL, device="cpu"), work)
        stops = {}
        for i, (_, text, *_r) in res.items():
            if i % 4 == 1 and len(text) >= 8:
                mid = len(text) // 2
                stops[i] = [text[mid:mid + 2], "\x00never\x00"]
        return stops
    return await _memo("stops", make)


SMALL_KV = dict(num_kv_blocks=12, max_model_len=64)
CASES = {
    "ngram": dict(speculator="ngram"),
    "ngram-k8-small-kv": dict(speculator="ngram", num_speculative_tokens=8, ngram_min=2, **SMALL_KV),
    "draft-self": dict(speculator="draft", draft_model=MODEL),
    "draft-other": dict(speculator="draft", draft_model="random:tiny-qwen3"),
    "draft-seed-small-kv": dict(speculator="draft", draft_model=MODEL + "@seed=1", **SMALL_KV),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CASES))
async def test_greedy_token_identical(case):
    work = _workload()
    stops = await _stop_strings(work)
    kw = CASES[case]
    small = "num_kv_blocks" in kw
    base_kw = SMALL_KV if small else {}
    base, base_stats, _, _ = await _memo(("base", small), lambda: _generate(
        EngineConfig(model=MODEL, device="cpu", **base_kw), work, stops))
    got, stats, spec, state = await _generate(EngineConfig(model=MODEL, device="cpu", **kw), work, stops)
    for i in base:
        b, g = base[i], got[i]
        assert g[0] == b[0], f"request {i}: tokens differ"
        assert g[1:4] == b[1:4], f"request {i}: text/finish differ"
        assert g[4] == pytest.approx(b[4], abs=1e-4), f"request {i}: logprobs differ"
        n_out = work[i][1]["max_tokens"]
        assert len(g[0]) <= n_out and (g[2] != "length" or g[3] or len(g[0]) == n_out)
    finishes = collections.Counter(r[2] for r in got.values())
    assert finishes["stop"] >= 3  # stop strings honoured (and cut the output where plain does)
    for i in stops:
        assert stops[i][0] not in got[i][1]
    assert stats.spec_proposed > 0 and spec["proposed"] == stats.spec_proposed
    assert spec["accepted"] == stats.spec_accepted
    if case.startswith("ngram"):
        assert stats.spec_accepted > 0
        assert state == {}  # every request's index dropped when it finished
    else:
        seqs, free, total, gens = state
        assert seqs == {} and free == total and gens == 0  # draft cache all returned
    if case == "draft-self":
        assert spec["acceptance_rate"] > 0.95 and spec["mean_accepted_length"] > 3
    if small:
        assert stats.preemptions > 0
        assert any(r[3] == "context limit" for r in got.values())
    assert stats.generation_tokens == base_stats.generation_tokens
    assert stats.steps < base_stats.steps or case in ("draft-other", "draft-seed-small-kv")


@pytest.mark.asyncio
@pytest.mark.slow
async def test_greedy_identical_default_model():
    """The embedded SmolLM2 (real weights), 32 mixed requests: n-gram lookup and a draft model
    (the model itself, the only same-vocabulary checkpoint shipped) are token-identical to
    plain greedy decoding. In float32: the packed CPU path (woq) runs other kernels for a
    verify step's rows than for one decode row, so its greedy tokens may differ by path."""
    texts = ["one two three four, one two three four, one two three",
             "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a",
             "The cat sat on the mat. The cat sat on the", "Hello",
             "The capital of France is", "List three colours:", "1, 2, 3, 4,", "Once upon a time"]
    work = [(t, dict(max_tokens=6 + i % 5, ignore_eos=True)) for i, t in enumerate(texts * 4)]
    assert len(work) == 32
    base, *_ = await _generate(EngineConfig(model="default", device="cpu", dtype="float32"), work)
    for kw in (dict(speculator="ngram"), dict(speculator="draft", draft_model="default")):
        got, stats, spec, _ = await _generate(EngineConfig(model="default", device="cpu", dtype="float32", **kw),
                                              work)
        assert {i: r[0] for i, r in got.items()} == {i: r[0] for i, r in base.items()}, kw
        assert stats.spec_accepted > 0, kw


# -- end to end: sampling keeps the distribution --------------------------------------------------
@pytest.mark.asyncio
async def test_sampling_distribution_end_to_end():
    """300 seeded requests, temperature 1 / top-k 4, 3 tokens each: the laws of output tokens 2
    and 3 (the ones speculation decides) match plain sampling (chi-square homogeneity at alpha
    0.001); token 1 comes from the prefill, before any draft, so it is identical per seed."""
    rng = random.Random(1)
    unit = [rng.randrange(256) for _ in range(4)]
    # the prompt ends with the model's own greedy continuation, so n-gram lookup proposes
    # tokens the target likes (accepted often, rejected often)
    greedy, *_ = await _generate(EngineConfig(model=MODEL, device="cpu"),
                                 [(unit * 5, dict(max_tokens=20, ignore_eos=True))])
    prompt = unit * 5 + greedy[0][0]
    n = 300
    work = [(prompt, dict(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True))] * n
    base, *_ = await _generate(EngineConfig(model=MODEL, device="cpu", max_num_seqs=n), work,
                               seeds=True)
    for kw in (dict(speculator="ngram"), dict(speculator="draft", draft_model=MODEL + "@seed=1"),
               dict(speculator="draft", draft_model=MODEL)):
        got, stats, spec, _ = await _generate(
            EngineConfig(model=MODEL, device="cpu", max_num_seqs=n, **kw), work, seeds=True)
        # (the 300 equal prompts share their blocks from the first step on: 4 steps in all)
        assert stats.spec_proposed > 50, kw
        if kw["speculator"] == "ngram":  # point-mass proposals, accepted and rejected
            assert 0.1 < spec["acceptance_rate"] < 0.9, spec
        elif kw["draft_model"] == MODEL:  # q == p: (almost) always accepted
            assert spec["acceptance_rate"] > 0.9, spec
        assert [got[i][0][0] for i in range(n)] == [base[i][0][0] for i in range(n)]
        for pos in (1, 2):
            a = collections.Counter(base[i][0][pos] for i in range(n))
            b = collections.Counter(got[i][0][pos] for i in range(n))
            stat, df = chi2_two_sample(a, b)
            assert stat < chi2_critical(df), (kw, pos, stat, df, a, b)


# -- release ---------------------------------------------------------------------------------------
def test_release_draft_first_and_completely():
    runner = ModelRunner(EngineConfig(model=MODEL, device="cpu", speculator="draft",
                                      draft_model=MODEL + "@seed=3"))
    runner.load()
    res = runner.resource("speculator")
    refs = [weakref.ref(p) for p in res.model.parameters()] + [weakref.ref(res.kv.tensor)]
    model_ref = weakref.ref(res.model)
    del res
    core = EngineCore(runner, check_integrity=True)
    core.add_request("a", [5, 6, 7] * 5, SamplingParams(max_tokens=30, temperature=0.8, seed=1,
                                                        ignore_eos=True))
    core.add_request("b", [1, 2] * 9, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):  # mid-flight: draft blocks, generators and pending draft laws exist
        core.step()
    assert runner.speculator.num_cached("a") > 0
    # drafts proposed (a draft law pending for the sampled request), then an abort and a
    # shutdown before any verification
    runner.speculator.propose(core.scheduler.running)
    pending = runner.resource("speculator").pending
    assert set(pending) == {"a"}
    core.abort("a", "test")
    assert not pending and runner.speculator.num_cached("a") == 0
    runner.speculator.propose(core.scheduler.running)
    del core, pending
    order = runner.shutdown()
    assert order == ["speculator", "grammar_bitmask", "model_state", "kv_cache", "weights"]
    assert reachable_tensors(runner) == []
    gc.collect()
    assert model_ref() is None
    assert all(r() is None for r in refs)


def test_no_speculator_owns_nothing_extra():
    runner = ModelRunner(EngineConfig(model=MODEL, device="cpu", speculator="ngram"))
    runner.load()
    assert isinstance(runner.speculator, NgramSpeculator)
    assert runner.shutdown() == ["grammar_bitmask", "model_state", "kv_cache", "weights"]
    assert reachable_tensors(runner) == []


# -- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("case", ["ngram", "draft-self", "draft-other", "draft-seed-small-kv"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_gpu_greedy_token_identical(case):
    """fp32 on CUDA (decodes go through the Triton kernel, verification through prefill)."""
    work = _workload()
    kw = CASES[case]
    base_kw = SMALL_KV if "num_kv_blocks" in kw else {}
    base, *_ = await _memo(("gpu-base", bool(base_kw)), lambda: _generate(
        EngineConfig(model=MODEL, device="cuda", dtype="float32", **base_kw), work))
    got, stats, spec, _ = await _generate(
        EngineConfig(model=MODEL, device="cuda", dtype="float32", **kw), work)
    assert {i: r[0] for i, r in got.items()} == {i: r[0] for i, r in base.items()}
    assert stats.spec_proposed > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_draft_release_to_the_byte():
    """bf16 draft speculation with sampled and greedy requests, then shutdown: the caching
    allocator is back where it was before load."""
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    runner = ModelRunner(EngineConfig(model=MODEL, device="cuda", dtype="bfloat16",
                                      speculator="draft", draft_model=MODEL + "@seed=2",
                                      num_kv_blocks=64))
    runner.load()
    core = EngineCore(runner, check_integrity=True)
    for i in range(8):
        core.add_request(str(i), [3, 4, 5] * (i + 2), SamplingParams(
            max_tokens=24, temperature=0.8 if i % 2 else 0.0, seed=i, top_k=20, ignore_eos=True))
    while core.has_work():
        core.step()
    assert core.statistics().spec_proposed > 0
    graphs = runner.resource("speculator").graphs
    assert graphs is None or graphs.replays > 0  # the draft's decode rounds replay graphs
    del core, graphs
    assert runner.shutdown()[0] == "speculator"
    assert reachable_tensors(runner) == []
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before

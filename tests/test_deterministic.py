"""Deterministic mode (``EngineConfig.deterministic``, engine/model/invariant.py) on the CPU path:
a request's tokens and logprobs are bitwise the same

* alone and amid 255 mixed requests (float32 and bfloat16);
* with prefix caching on and off on a chat-like workload (a long shared system prompt), under
  preemption pressure, with chunked prefill, with overlapped scheduling and with the n-gram
  speculator (accepted tokens = the plain greedy ones); with structured outputs and a draft
  model; with two tensor-parallel ranks; in a Qwen3 shape (q/k norms, tied embeddings);
* as a training-side recomputation (one forward over the whole sequence, log_softmax) gets them;

and without the mode at least one of these differs (float32), so the tests can fail. The ops one
by one first: the invariant linear, SiLU and both attention kernels against row counts, places
in the batch, key layouts and thread counts.
"""

from __future__ import annotations

import argparse
import random

import msgspec
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, SamplingParams
from engine.errors import BadRequestError
from engine.interface import Health
from engine.model import invariant
from engine.ops.cpu import invariant_attention
from engine.sample import logprobs
from engine.testing import (check_batch_invariance, full_sequence_logprobs, load, logprob_rows,
                            tensor_parallel_differences,
                            mixed_jobs, run_jobs)
from states import State

MODEL = "random:tiny-llama"  # 512 tokens, 64 wide, 4 heads over 2 KV heads of 16
VOCAB = 512
DTYPES = ["float32", "bfloat16"]


def _cfg(dtype: str, **kw) -> EngineConfig:
    return EngineConfig(model=MODEL, device="cpu", dtype=dtype, seed=3,
                        **{"num_kv_blocks": 256, "deterministic": True, **kw})


# -- the ops -----------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2])
def test_the_ops_give_a_row_the_same_bits_whatever_the_rows_beside_it(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(576, 192, generator=g).to(dtype)
            x = torch.randn(300, 192, generator=g).to(dtype)
            alone = invariant.linear(x[:1], w)[0]
            for m in (2, 3, 4, 7, 8, 9, 64, 300):  # row counts, and the row at every tile place
                assert torch.equal(invariant.linear(x[:m], w)[0], alone), (dtype, m)
                mixed = torch.cat([x[1:m], x[:1]])
                assert torch.equal(invariant.linear(mixed, w)[m - 1], alone), (dtype, m)
            s = invariant.silu(x.float() * 3).to(dtype)
            for n in (1, 5, 17, 33):  # where the tensor ends does not matter
                assert torch.equal(invariant.silu(x[7:7 + n].float() * 3).to(dtype), s[7:7 + n])
        # logprob rows of a 49,152-logit row alone and among 8 (logsumexp differed: 2 in 100)
        plan = logprobs.Plan([0], [(0, 0, 1, 5)], 1, [], 5)
        for _ in range(20):
            rows = torch.randn(8, 49152, generator=g) * 4
            alone = logprobs.device_rows_invariant(rows[:1], plan, torch.tensor([3]))
            among = logprobs.device_rows_invariant(rows, logprobs.Plan(
                list(range(8)), [(i, i, i + 1, 5) for i in range(8)], 8, [], 5), torch.arange(8) + 3)
            assert torch.equal(alone[0], among[0])
    finally:
        torch.set_num_threads(before)


def test_a_row_without_top_p_keeps_its_tail_beside_a_row_with_it():
    """The sampler's filters leave a row that does not ask for them as it is: a top_p = 1 row's
    tail tokens were dropped (its rounded mass reached 1.0) only when another row of the step
    asked for top-p -- 4,826 of 49,152 tokens here, before the fix."""
    from engine.sample.sampler import SamplingBatch, apply_penalty_free_filters

    def batch(top_p):
        n = len(top_p)
        return SamplingBatch(torch.ones(n), torch.zeros(n, dtype=torch.long), torch.tensor(top_p),
                             [None] * n, False, False, any_top_k=False, any_top_p=min(top_p) < 1)

    x = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)) * 3
    alone = apply_penalty_free_filters(x[:1], batch([1.0]))
    assert torch.equal(apply_penalty_free_filters(x, batch([1.0, 0.5]))[:1], alone)


def test_plain_f_linear_changes_a_rows_result_with_the_row_count():
    """Why the invariant linear exists (float32, this CPU's BLAS): if this ever passes
    unchanged, the default path's linears happen to be invariant here."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(576, 192, generator=g), torch.randn(64, 192, generator=g)
    results = {m: F.linear(x[:m], w)[0] for m in (1, 2, 4, 64)}
    assert any(not torch.equal(results[1], r) for r in results.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["cpp", "torch"])
def test_attention_reads_a_rows_keys_in_one_order_wherever_they_are(dtype, which):
    if which == "cpp":
        if invariant_attention.module() is None:
            pytest.skip("the C++ kernel is not built here (no compiler)")
        attend = invariant_attention.kernel(torch.device("cpu"))[0]
    else:
        attend = invariant_attention.attention_torch
    g = torch.Generator().manual_seed(1)
    bs, kv_heads, dim, heads, n = 16, 2, 32, 6, 150
    cache = torch.randn(2, 40, bs, kv_heads, dim, generator=g).to(dtype)
    blocks = torch.randperm(40, generator=g)[:10]
    q = torch.randn(n, heads, dim, generator=g).to(dtype)
    tables = blocks[None].expand(n, -1).contiguous()
    lens = torch.arange(1, n + 1)
    full = attend(q, cache, tables, lens, dim ** -0.5)
    # the same keys copied to other blocks: where a key lives does not matter
    moved = torch.randperm(40, generator=g)[:10]
    cache2 = cache.clone()
    cache2[:, moved] = cache[:, blocks]
    ref = F.scaled_dot_product_attention(  # and it is attention
        q.float().transpose(0, 1), *(cache[i][blocks].reshape(-1, kv_heads, dim)[:n].float()
                                     .repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
                                     for i in (0, 1)), is_causal=True).transpose(0, 1)
    assert (full.float() - ref).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)
    for r in (0, 15, 16, 17, 80, 149):
        one = attend(q[r:r + 1], cache, tables[r:r + 1, : r // bs + 1].contiguous(), lens[r:r + 1],
                     dim ** -0.5)
        assert torch.equal(one[0], full[r]), r
        elsewhere = attend(torch.cat([q[100:104], q[r:r + 1]]), cache2,
                           moved[None].expand(5, -1).contiguous(), torch.tensor([150, 3, 99, 1, r + 1]),
                           dim ** -0.5)
        assert torch.equal(elsewhere[4], full[r]), r


def test_the_kernels_exp_is_within_two_ulp_of_the_librarys():
    ext = invariant_attention.module()
    if ext is None:
        pytest.skip("the C++ kernel is not built here (no compiler)")
    x = -torch.rand(200_000, generator=torch.Generator().manual_seed(2)) * 80
    got, want = ext.fexp(x), torch.exp(x.double()).float()
    assert (got.view(torch.int32) - want.view(torch.int32)).abs().max() <= 2
    assert ext.fexp(torch.tensor([0.0, -88.0, -1e30]).float()).tolist() == [1.0, 0.0, 0.0]


# -- the engine --------------------------------------------------------------------------------
TARGET = [(7 * j) % 300 + 11 for j in range(57)]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=3,
                        prompt_logprobs=2)
SEEDED = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=11, logprobs=True,
                        top_logprobs=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_alone_and_amid_255_others_is_bitwise_the_same(dtype):
    for params in (GREEDY, SEEDED):
        report = check_batch_invariance(_cfg(dtype, num_kv_blocks=None), TARGET, params, others=255)
        assert report.identical, (params.temperature, report.first_difference)
        assert len(report.alone.tokens) == 24 and report.alone.logprobs


def test_the_torch_attention_path_is_invariant_in_the_engine_too(monkeypatch):
    """Where the C++ kernel cannot be had (its kill switch here), torch's ops run attention."""
    monkeypatch.setenv("ENGINECORE_CPU_EXT", "0")
    assert invariant_attention.kernel(torch.device("cpu"))[0] is invariant_attention.attention_torch
    report = check_batch_invariance(_cfg("float32", num_kv_blocks=None), TARGET, GREEDY, others=63)
    assert report.identical, report.first_difference


def test_tensor_parallel_two_ranks_are_batch_invariant_too():
    """TP=2 over gloo (worker processes): the row-parallel linears' partial products are
    invariant and the all-reduce adds two of them (measured: without the mode, the same check
    differs)."""
    report = check_batch_invariance(_cfg("float32", tensor_parallel_size=2, num_kv_blocks=512),
                                    TARGET, GREEDY, others=63)
    assert report.identical, report.first_difference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tensor_parallel_two_ranks_give_the_bits_of_one(hf_checkpoint, dtype):
    """TP=2 over gloo against TP=1 on the same checkpoint: the o and down projections are
    computed as one product per KV head's slice of the input, gathered from every rank and added
    in one order (engine/tp/layers.py), as TP=1 adds them (measured: without it the logprobs
    differed from the first token; the default model TP=3 against TP=1 as well)."""
    path, _ = hf_checkpoint("deterministic-tp")
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3)
    jobs = [(f"r{i}", [(37 * j + i) % 380 + 3 for j in range(20 + 9 * i)], params, i)
            for i in range(4)]
    diff = tensor_parallel_differences(EngineConfig(
        model=str(path), device="cpu", dtype=dtype, seed=3, deterministic=True,
        num_kv_blocks=256), jobs, world=2)
    assert not diff, diff


def test_a_qwen3_shape_with_q_k_norms_and_tied_embeddings_too():
    report = check_batch_invariance(EngineConfig(model="random:tiny-qwen3", device="cpu",
                                                 seed=3, deterministic=True, num_kv_blocks=512),
                                    TARGET, GREEDY, others=63)
    assert report.identical, report.first_difference


def test_without_the_mode_the_batch_changes_the_bits():
    """The same check on the default path (float32) finds a difference: the test above can
    fail. (bfloat16 on this AVX2 box: the default path happened to pass, measured.)"""
    cfg = EngineConfig(model=MODEL, device="cpu", dtype="float32", seed=3)
    report = check_batch_invariance(cfg, TARGET, GREEDY, others=255)
    assert not report.identical


SYSTEM = [(13 * j) % 400 + 20 for j in range(150)]  # a long shared system prompt


def _chat_jobs(n: int = 24) -> list:
    rng = random.Random(5)
    jobs = []
    for i in range(n):
        turn = [rng.randrange(20, VOCAB) for _ in range(rng.randint(3, 40))]
        params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2,
                                temperature=0.7 if i % 3 == 0 else 0.0, seed=i)
        jobs.append((f"chat-{i}", SYSTEM + turn, params, i // 6))  # arriving over 4 steps
    return jobs


def _run(cfg: EngineConfig, jobs) -> tuple[dict, object]:
    runner, core = load(cfg)
    try:
        return run_jobs(core, jobs), core.statistics()
    finally:
        runner.shutdown()


def _variants(dtype: str, deterministic: bool) -> dict:
    """The chat workload's outcomes with prefix caching off (the reference), then per variant
    the requests that differ from it."""
    jobs = _chat_jobs()
    base, _ = _run(_cfg(dtype, enable_prefix_caching=False, deterministic=deterministic), jobs)
    variants = {
        "prefix caching": _cfg(dtype),
        "preemption": _cfg(dtype, num_kv_blocks=30),  # (shared prefix: many admitted, then short)
        "chunked prefill": _cfg(dtype, max_num_batched_tokens=40),
        "overlap": _cfg(dtype, overlap_scheduling=True),
    }
    out = {}
    for name, cfg in variants.items():
        got, stats = _run(msgspec.structs.replace(cfg, deterministic=deterministic), jobs)
        if name == "prefix caching":
            assert stats.prefix_cache_hits > 20 * len(SYSTEM)
        if name == "preemption":
            assert stats.preemptions > 0
        out[name] = {rid: base[rid].difference(o) for rid, o in got.items() if base[rid].difference(o)}
    return out


def test_without_the_mode_the_cache_chunking_preemption_and_overlap_change_bits():
    """Measured on this box (float32, 24 requests): 17-20 of 24 differ in their logprob bits in
    every variant (bfloat16: 2-5, one in its tokens)."""
    diffs = _variants("float32", deterministic=False)
    assert all(diffs.values()), {k: len(v) for k, v in diffs.items()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cache_the_chunking_preemption_overlap_and_speculation_change_no_bit(dtype):
    diffs = _variants(dtype, deterministic=True)
    assert not any(diffs.values()), diffs
    # the n-gram speculator, on greedy requests that repeat themselves (drafts get accepted)
    greedy = [(f"rep-{i}", ([5 + i, 9, 14, 22] * 8)[: 20 + i], SamplingParams(
        max_tokens=24, ignore_eos=True, logprobs=True, top_logprobs=2), 0) for i in range(6)]
    plain, _ = _run(_cfg(dtype), greedy)
    spec, stats = _run(_cfg(dtype, speculator="ngram", num_speculative_tokens=3), greedy)
    assert stats.spec_accepted > 0
    assert all(plain[r].difference(spec[r]) is None for r in plain), \
        {r: plain[r].difference(spec[r]) for r in plain}


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprobs_equal_a_full_sequence_recomputation(dtype):
    """A trainer's recomputation -- one forward over prompt + output, log_softmax -- with the
    same invariant model gives the engine's logprobs bit for bit; the plain model's recomputation
    is close, not equal (measured here: float32 at most 1 ulp, 4.8e-7; bfloat16 up to 0.015 --
    its roundings fall between other ops; docs/deterministic.md)."""
    jobs = [*mixed_jobs(40, VOCAB, seed=2), ("t", TARGET, GREEDY, 1)]
    runner, core = load(_cfg(dtype))
    try:
        out = run_jobs(core, jobs)["t"]
        core.reset_kv()
        seq = TARGET + out.tokens
        lp = full_sequence_logprobs(runner, seq[:-1])
    finally:
        runner.shutdown()
    rows = logprob_rows(out, GREEDY.top_logprobs)
    n = len(TARGET)
    want = lp[torch.arange(n - 1, len(seq) - 1), torch.tensor(out.tokens)]
    assert [t for t, _ in rows] == out.tokens
    assert torch.equal(torch.tensor([v for _, v in rows]), want)
    # the prompt's too (row j: token j given the ones before; the first has none)
    words = np.frombuffer(out.prompt_logprobs, dtype="<i4").reshape(n, -1)
    prompt_lp = torch.from_numpy(words[1:, 1].view("<f4").copy())
    assert torch.equal(prompt_lp, lp[torch.arange(n - 1), torch.tensor(TARGET[1:])])
    plain = load(EngineConfig(model=MODEL, device="cpu", dtype=dtype, seed=3, num_kv_blocks=64))[0]
    try:
        other = full_sequence_logprobs(plain, seq[:-1])[torch.arange(n - 1, len(seq) - 1),
                                                         torch.tensor(out.tokens)]
    finally:
        plain.shutdown()
    assert (want - other).abs().max() < (1e-5 if dtype == "float32" else 0.06)


async def _streams(cfg: EngineConfig, jobs) -> dict:
    """Each job's (tokens, logprob rows) through an in-process engine, all submitted at once."""
    import anyio

    from engine import AsyncEngine

    out = {}
    async with AsyncEngine.open(cfg) as eng:
        async def one(rid, prompt, params):
            toks, rows = [], b""
            async for o in eng.generate(prompt, params):
                toks += o.token_ids
                rows += o.token_logprobs.rows if o.token_logprobs is not None else b""
            out[rid] = (toks, rows)

        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(one, *job)
    return out


@pytest.mark.asyncio
async def test_structured_outputs_and_a_draft_model_keep_the_bits():
    """A regex-constrained greedy request: alone, amid 7 others (half constrained), and amid
    them with a draft-model speculator: the same tokens and logprob rows (measured: without the
    mode neither the batch nor the speculator keeps them)."""
    from engine import StructuredOutputs

    rx = StructuredOutputs(regex=r"(ab|cd){10,14}x")
    target = ("t", list(b"cdcdabcdcdabcdcdab"),
              SamplingParams(max_tokens=40, structured=rx, logprobs=True, top_logprobs=2))
    others = [(f"o{i}", list(b"zz" * (i + 3)), SamplingParams(
        max_tokens=20, ignore_eos=True, logprobs=True, structured=rx if i % 2 else None))
        for i in range(7)]
    cfg = _cfg("float32")
    alone = (await _streams(cfg, [target]))["t"]
    assert len(alone[0]) >= 21 and alone[1]
    assert (await _streams(cfg, [*others, target]))["t"] == alone
    drafted = msgspec.structs.replace(cfg, speculator="draft", draft_model=MODEL)
    assert (await _streams(drafted, [*others, target]))["t"] == alone


# -- the switches around it --------------------------------------------------------------------
def test_the_mode_is_a_config_field_a_serve_flag_and_a_health_field():
    from entrypoints.args import add_model_args, config_from_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert config_from_args(p.parse_args(["--deterministic"])).deterministic
    assert not config_from_args(p.parse_args([])).deterministic
    with pytest.raises(BadRequestError, match="deterministic"):
        EngineConfig(deterministic=True, cpu_weights="woq").validate()
    h = Health(state=State.SERVING, live=True, ready=True, deterministic=True)
    from entrypoints.http.engine_metrics import EngineCollector

    m = EngineCollector()
    m.update(h)
    values = {s.name: s.value for fam in m.collect() for s in fam.samples}
    assert values["enginecore_deterministic"] == 1
    m.update(Health(state=State.SERVING, live=True, ready=True))
    assert {s.name: s.value for fam in m.collect() for s in fam.samples}["enginecore_deterministic"] == 0


@pytest.mark.asyncio
async def test_the_log_statistics_and_health_say_the_mode_is_on(caplog):
    from engine import AsyncEngine

    caplog.set_level("INFO", logger="enginecore.runner")
    async with AsyncEngine.open(_cfg("float32")) as eng:
        assert eng.statistics().deterministic and (await eng.health()).deterministic
    assert any("deterministic mode: on" in r.getMessage() for r in caplog.records)
    async with AsyncEngine.open(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=64)) as eng:
        assert not eng.statistics().deterministic and not (await eng.health()).deterministic


def test_the_default_model_loads_float_and_stays_invariant(caplog):
    """The embedded GGUF (packed by default on this CPU) runs float weights in the mode; a short
    greedy request alone and beside 7 others."""
    caplog.set_level("INFO", logger="enginecore.runner")
    cfg = EngineConfig(model="default", device="cpu", deterministic=True, num_kv_blocks=64,
                       max_num_seqs=8)
    report = check_batch_invariance(cfg, list(range(300, 340)), SamplingParams(
        max_tokens=6, logprobs=True, top_logprobs=2), others=7)
    assert report.identical, report.first_difference
    rows = np.frombuffer(report.alone.logprobs, dtype="<i4")
    assert rows.size == 6 * 7
    assert any("weights: float, 0 linears packed (deterministic mode" in r.getMessage()
               for r in caplog.records)

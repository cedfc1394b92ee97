"""engine/model/woq_forward.py: the woq model's forward in fewer ops computes what the generic forward
computes with the same packed weights (prefill, mixed and decode steps; K/V read through views
of consecutive blocks or gathered), and its pieces (rotation, spans) are exact."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, ModelRunner, SamplingParams
from engine.core.engine_core import EngineCore
from engine.forward.step_inputs import _spans, packed_forward
from engine.model import woq_forward
from engine.model.cpu_weights import pack_model
from engine.model.llama import Rotary
from engine.model.model_config import ModelConfig
from engine.request import Request, Status

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _packed_runner(num_kv_blocks: int, max_num_seqs: int, max_model_len: int) -> ModelRunner:
    """random:tiny-llama packed as woq (its linears as GGUF Q4_1 tensors, the head as Q8_0).
    No prefix cache: a second run's cached prompt would take other kernels (they go by row
    count) than the first's."""
    runner = ModelRunner(EngineConfig(model="random:tiny-llama", num_kv_blocks=num_kv_blocks,
                                      max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                      enable_prefix_caching=False))
    runner.load()
    model = runner.resource("weights")
    names = [n for n, _ in model.named_parameters() if n.endswith("proj.weight")]
    head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    pack_model(model, "woq", {**{n: "Q4_1" for n in names}, head: "Q8_0"})
    assert model.woq_forward  # usable: int4 q/k/v and gate/up fused, no q/k norm
    return runner


@pytest.fixture(scope="module")
def woq_runner():
    runner = _packed_runner(64, 4, 256)
    yield runner
    runner.shutdown()


def _greedy(runner, prompts, max_tokens=6):
    core = EngineCore(runner)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                       ignore_eos=True, logprobs=1))
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    while core.has_work():
        for o in core.step():
            toks.setdefault(o.request_id, []).extend(o.token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs or [])
    return toks, lps


@pytest.mark.parametrize("span_rows", [1, 8])
def test_woq_forward_generates_what_the_generic_forward_does(woq_runner, monkeypatch, span_rows):
    """One request alone (decode through views of its blocks), then three at once (prefills,
    mixed steps, decodes of blocks allocated interleaved: gathered, or with ``span_rows`` 8
    views where consecutive)."""
    monkeypatch.setattr(woq_forward, "MAX_SPAN_ROWS", span_rows)
    model = woq_runner.resource("weights")
    for prompts in ([list(range(3, 40))], [list(range(3, 40)), [5, 9, 200, 7], list(range(50, 90, 2))]):
        out = {}
        for flag in (False, True):
            model.woq_forward = flag
            out[flag] = _greedy(woq_runner, prompts)
        model.woq_forward = True
        # the same arithmetic up to float32 summation order (decode steps: engine/ops/cpu/csrc's loops)
        assert out[True][0] == out[False][0]
        for rid, ref in out[False][1].items():
            assert out[True][1][rid] == pytest.approx(ref, abs=1e-4)


def test_woq_forward_logits_match_after_a_cached_prefix(woq_runner):
    """A chunk after context (the generic attention of a prefill with earlier K/V)."""
    model = woq_runner.resource("weights")
    kv, state = woq_runner.resource("kv_cache").tensor, woq_runner.resource("model_state")
    ids = list(range(10, 60))
    blocks = list(range(8, 12))
    logits = {}
    with torch.inference_mode():
        for flag in (False, True):
            model.woq_forward = flag
            packed_forward(model, kv, state, None, woq_runner.device, woq_runner.block_size,
                           [(ids[:32], 0, blocks, False)])
            hidden = packed_forward(model, kv, state, None, woq_runner.device, woq_runner.block_size,
                                    [(ids[32:], 32, blocks, False)])
            logits[flag] = model.logits(hidden[-1:])[0]
    model.woq_forward = True
    assert torch.allclose(logits[True], logits[False], rtol=0, atol=1e-5)


def test_rotation_of_q_and_k_together_is_the_half_split_rotary_exactly():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=64)
    rot = Rotary(cfg)
    pos = torch.tensor([0, 5, 63])
    x = torch.randn(3, 3, 32)
    cos, sin = rot.tables(pos)
    cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
    swapped = x.view(3, 3, 2, 16).flip(2).view(3, 3, 32)
    assert torch.equal(x * cos2 + swapped * sin2, rot(x, pos))


def test_spans_only_for_consecutive_blocks():
    assert _spans([[4, 5, 6], [9]], [40, 3], 16) == [(64, 40), (144, 3)]
    assert _spans([[4, 5, 9]], [33], 16) is None  # the third block is not the next one
    assert _spans([[4, 5, 9]], [32], 16) == [(64, 32)]  # ... and not used yet
    assert _spans([[4, 5], [7, 6]], [20, 20], 16) is None


def test_cpu_argmax_and_top_indices_match_torch():
    """The sampler's CPU argmax (numpy) keeps torch's first-maximum rule; the head's top-k
    selection (numpy) returns topk's set where there are no ties."""
    from engine.ops.cpu.packed_linear import _top_indices
    from engine.sample.sampler import _argmax

    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(7))
    x[1, 10] = x[1, 20] = x[1].max() + 1  # a tie: the first wins
    assert torch.equal(_argmax(x), x.argmax(-1)) and _argmax(x)[1].item() == 10
    got = _top_indices(x, 40).sort(-1).values
    assert torch.equal(got, x.topk(40, -1).indices.sort(-1).values)


@pytest.fixture(scope="module")
def woq_runner_wide():
    """Room for 20 sequences: decode steps of 18 rows."""
    runner = _packed_runner(160, 20, 128)
    yield runner
    runner.shutdown()


@pytest.mark.parametrize("requests,span_rows", [(1, 64), (3, 64), (3, 1), (18, 64)])
def test_cpp_decode_step_is_the_python_step(woq_runner_wide, monkeypatch, requests, span_rows):
    """engine/ops/cpu/csrc/woq_decode.cpp computes what the Python decode loop does (its own norm,
    rotary and attention loops; the same matmuls): the same tokens, logprobs within float32
    summation order, for 1, 3 and 18 rows (the Python loop through views or gathered K/V)."""
    from engine.ops.cpu import cpu_ext

    ext = cpu_ext.module()
    if ext is None or not woq_forward.cpp_step_fits(woq_runner_wide.resource("weights")):
        pytest.skip("the C++ decode step does not run here (not built, or no AVX-512)")
    monkeypatch.setattr(woq_forward, "MAX_SPAN_ROWS", span_rows)
    calls = []
    real = woq_forward._decode_cpp
    monkeypatch.setattr(woq_forward, "_decode_cpp", lambda *a: calls.append(a[2].shape[0]) or real(*a))
    prompts = [list(range(3 + i, 30 + 2 * i)) for i in range(requests)]
    out = {}
    for flag in (True, False):
        monkeypatch.setattr(woq_forward, "CPP_STEP", flag)
        out[flag] = _greedy(woq_runner_wide, prompts, max_tokens=5)
    assert calls and max(calls) == requests  # the C++ step ran, for every row at once
    assert out[True][0] == out[False][0]
    for rid, ref in out[False][1].items():
        assert out[True][1][rid] == pytest.approx(ref, abs=1e-4)


def test_cpp_step_refuses_indices_out_of_range(woq_runner_wide):
    """The C++ step reads the cache through slots, block tables and lengths: any out of range
    is a RuntimeError naming it, never a read past the cache."""
    from engine.ops.cpu import cpu_ext

    ext = cpu_ext.module()
    if ext is None or not woq_forward.cpp_step_fits(woq_runner_wide.resource("weights")):
        pytest.skip("the C++ decode step does not run here")
    model = woq_runner_wide.resource("weights")
    kv = woq_runner_wide.resource("kv_cache").tensor
    cfg = model.config
    x = torch.zeros(1, cfg.hidden_size)
    cos2 = torch.ones(1, 1, cfg.head_dim)
    sin2 = torch.zeros(1, 1, cfg.head_dim)
    blocks, bs = kv.shape[2], kv.shape[3]

    def step(slot, table, n):
        return ext.woq_decode(x.clone(), woq_forward._weights(model), kv, cos2, sin2, torch.tensor([slot]),
                              torch.tensor([table]), torch.tensor([n]), cfg.num_heads, cfg.num_kv_heads,
                              cfg.head_dim, 1e-5, 0.125, 16, True, True)

    assert step(0, [0, 1], 3).shape == (1, cfg.hidden_size)  # in range: runs
    for slot, table, n in ((blocks * bs, [0, 1], 3), (-1, [0, 1], 3), (0, [0, blocks], 20),
                           (0, [0, 1], 2 * bs + 1), (0, [0, 1], 0)):
        with pytest.raises(RuntimeError, match="out of range"):
            step(slot, table, n)
    with pytest.raises(RuntimeError, match="float16"):
        lin = model.model.layers[0].mlp.down_proj
        ext.int4_mm(torch.zeros(1, lin.in_features), lin.q4, lin.d16.float(), lin.m16, True, True)

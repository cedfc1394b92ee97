"""q/k/v and gate/up fused into one linear each (engine/model/fused_linears.py): the same logits as
the separate linears on the plain torch path, and weight updates by checkpoint names written
into the fused weights' rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import EngineConfig, ModelRunner
from engine.forward.step_inputs import packed_forward
from engine.memory.owner import Resource as R
from engine.memory.weights import weight_spec
from engine.model import fused_linears

pytestmark = pytest.mark.usefixtures("torch_one_thread")
SEQS = [(list(range(3, 40)), 0, [0, 1, 2], False), (list(range(50, 61)), 0, [3], False)]


def _logits(r: ModelRunner) -> torch.Tensor:
    m, kv = r.resource(R.WEIGHTS), r.resource(R.KV_CACHE).tensor
    kv.zero_()
    with torch.inference_mode():
        h = packed_forward(m, kv, r.resource(R.MODEL_STATE), None, r.device, r.block_size, SEQS)
        return m.logits(h).float()


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3", "qwen2-qkv-bias"])
def test_fused_projections_match_and_take_weight_updates(model, hf_checkpoint):
    if not model.startswith("random:"):  # a Qwen2 checkpoint: q/k/v biases fused too
        model = str(hf_checkpoint(model, "Qwen2ForCausalLM", seed=5)[0])
    # float32: a checkpoint would run in bf16 on an AVX512-BF16 CPU (dtype auto), this compares
    # the fused rows with float32 tensors exactly
    cfg = EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=16, max_num_seqs=4,
                       enable_prefix_caching=False)
    r = ModelRunner(cfg)
    r.load()
    try:
        lm = r.resource(R.WEIGHTS)
        names = set(weight_spec(lm.config, torch.float32))
        before = _logits(r)
        n = fused_linears.fuse(lm)
        layer = lm.model.layers[0]
        assert n == 5 * len(lm.model.layers) and not hasattr(layer.self_attn, "q_proj")
        assert type(layer.mlp.gate_up_proj) is nn.Linear and fused_linears.fuse(lm) == 0
        views = fused_linears.views(lm)
        # every checkpoint name is a parameter or a fused view, and nothing else
        kept = {n for n, _ in lm.named_parameters() if "qkv_proj" not in n and "gate_up_proj" not in n}
        assert names == set(views) | kept and not set(views) & kept
        assert torch.allclose(_logits(r), before, rtol=1e-5, atol=1e-5)
        # new weights by their checkpoint names land in the fused rows
        g = torch.Generator().manual_seed(9)
        new = {k: torch.randn(shape, generator=g) * 0.1 for k, (shape, _) in
               weight_spec(lm.config, torch.float32).items()}
        r.update_weights_from_tensors(new)
        assert torch.equal(views["model.layers.0.self_attn.k_proj.weight"],
                           new["model.layers.0.self_attn.k_proj.weight"])
        got = _logits(r)
        ref = ModelRunner(cfg)
        ref.load()
        try:
            ref.update_weights_from_tensors(new)
            assert torch.allclose(got, _logits(ref), rtol=1e-5, atol=1e-5)
        finally:
            ref.shutdown()
    finally:
        r.shutdown()

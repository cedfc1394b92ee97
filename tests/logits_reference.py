"""The model's own logits, computed apart from the engine: a second ``ModelRunner`` on the same
checkpoint, one packed prefill of the whole sequence (no cache, no chunking, no batching)."""

from __future__ import annotations

import torch

from engine import EngineConfig
from engine.forward.step_inputs import packed_forward
from engine.memory.owner import Resource as R
from engine.runner.model_runner import ModelRunner


class Reference:
    def __init__(self, model: str = "default") -> None:
        # float32: the exact path (the engines these logits check pin it too)
        self.runner = ModelRunner(EngineConfig(model=model, dtype="float32", num_kv_blocks=64,
                                               max_num_seqs=2, enable_prefix_caching=False,
                                               cuda_graphs=False))
        self.runner.load()
        self.tokenizer = self.runner.tokenizer

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """fp32 logits [len(ids), V]: row j is the distribution of the token after ids[:j+1]."""
        r = self.runner
        blocks = list(range(-(-len(ids) // r.block_size)))
        hidden = packed_forward(r.resource(R.WEIGHTS), r.resource(R.KV_CACHE).tensor,
                                r.resource(R.MODEL_STATE), None, r.device, r.block_size,
                                [(list(ids), 0, blocks, False)])
        return r.resource(R.WEIGHTS).logits(hidden).float()

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        return self.logits(ids).log_softmax(-1)

    def close(self) -> None:
        self.runner.shutdown()

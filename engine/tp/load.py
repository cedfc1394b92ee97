"""A rank's weights: its shard's modules (``layers.create_tp_model``), adopted by the runner's
owner before they are filled from the sharded checkpoint (``shard.ShardedTensors``).

Packed CPU formats (engine/model/cpu_weights.py) are not used with TP: a rank keeps float weights.
Random presets are seeded per rank (each rank's shard is its own draw, not a slice of TP=1's
weights): for lifecycle tests and benchmarks, not for parity.
"""

from __future__ import annotations

from engine.memory.owner import Resource as R
from engine.memory.weights import weight_spec
from engine.model.invariant import make_invariant
from engine.model.model_config import ModelConfig

from .layers import create_tp_model
from .shard import ShardedTensors, local_config


def create_shard(runner, cfg: ModelConfig, tensors):
    tp = runner._tp
    runner._shapes = local_config(cfg, tp.world)  # refuses a size that does not divide
    model = runner._owner.adopt(R.WEIGHTS, create_tp_model(
        runner._shapes, tp.rank, tp.world, None, runner.device, runner.dtype))
    model.switches = runner.switches
    if runner.config.deterministic:  # RowParallelLinear's partial product too (its super())
        make_invariant(model)
    if tensors is not None:
        full = {n: shape for n, (shape, _) in weight_spec(cfg, runner.dtype).items()}
        tensors = ShardedTensors(tensors, full, tp.rank, tp.world, runner.config.model)
    return model, tensors

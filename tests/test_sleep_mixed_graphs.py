"""Sleep mode with graphed prompt steps (engine/forward/mixed_inputs.py, on by default on CUDA):
when the runner captures them. On CPU, with a stand-in for the CUDA graphs object."""

from __future__ import annotations

from engine import EngineConfig, ModelRunner


def cfg() -> EngineConfig:
    return EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=64, max_num_seqs=8)


def test_mixed_graphs_are_captured_only_with_the_weights_on_the_device(monkeypatch) -> None:
    """The graphed prompt steps (engine/forward/mixed_inputs.py) are captured by running the model: a
    wake of the KV cache alone, before the weights, must not capture (the weights are gone at
    level 2, in host memory at level 1); the weights' wake after it does. (A stand-in for the
    CUDA graphs object on CPU: what the runner asks of it.)"""
    from engine.forward import cuda_graphs
    from engine.runner import load as runner_mod  # where the runner reads cuda_graphs

    captures: list[int] = []

    class Graphs:
        mixed = object()

        def __init__(self, **kw):
            pass

        def capture_mixed(self, model, kv, state, max_tokens, should_stop=lambda: False):
            # what a capture runs: the runner's own weights, awake
            assert model is rn._owner.get("weights") and "weights" not in rn.asleep, rn.asleep
            captures.append(max_tokens)

        def close(self):
            pass

    monkeypatch.setattr(cuda_graphs, "CudaGraphs", Graphs)
    monkeypatch.setattr(cuda_graphs, "usable", lambda *a: True)
    assert runner_mod.cuda_graphs is cuda_graphs
    rn = ModelRunner(cfg())
    rn.load()
    n = rn.config.max_num_batched_tokens
    try:
        assert captures == [n]
        for level in (1, 2):
            captures.clear()
            rn.sleep(level)
            rn.wake(("kv_cache",))  # the stack first: nothing to capture with yet
            assert captures == [] and rn.asleep == ("weights",), level
            rn.wake(("weights",))
            assert captures == [n] and rn.asleep == (), level
            captures.clear()
            rn.sleep(level)
            rn.wake()  # both: captured once, with the stack
            assert captures == [n], level
    finally:
        rn.shutdown()

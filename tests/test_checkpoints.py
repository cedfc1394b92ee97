"""Bad checkpoints: each failure is a ``CheckpointError`` naming the file and the problem, from
``ModelRunner.load()`` and from ``AsyncEngine.open``, and a failed load leaves nothing allocated —
not in the runner, and not pinned by the exception's traceback while the caller holds it."""

from __future__ import annotations

import gc
import json
from pathlib import Path
import re
import shutil

import anyio
import pytest
import torch

from engine import AsyncEngine, EngineConfig, ModelRunner
from engine.errors import CheckpointError
from engine.memory.owner import reachable_tensors
from states import State

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def good(hf_checkpoint):
    """A valid single-file and a valid sharded checkpoint (never modified; cases copy them)."""
    single, _ = hf_checkpoint("bad-base-single", seed=11)
    sharded, _ = hf_checkpoint("bad-base-sharded", seed=11, max_shard_size="100KB")
    return single, sharded


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


# Each case builds a broken checkpoint and returns (model path, file the error must name,
# regex the problem must match).
def no_such_path(good, tmp):
    path = tmp / "does-not-exist"
    return path, path, r"does not exist"


def missing_config(good, tmp):
    path = _copy(good[0], tmp / "ckpt")
    (path / "config.json").unlink()
    return path, path / "config.json", r"config\.json is missing"


def unsupported_architecture(good, tmp):
    path = _copy(good[0], tmp / "ckpt")
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    return path, path / "config.json", r"unsupported architecture 'GPT2LMHeadModel'"


def missing_weight_file(good, tmp):
    path = _copy(good[1], tmp / "ckpt")
    shards = sorted(set(json.loads((path / "model.safetensors.index.json").read_text())
                        ["weight_map"].values()))
    assert len(shards) > 1
    (path / shards[-1]).unlink()
    return path, path / shards[-1], r"weight file is missing"


def truncated_weights(good, tmp):
    path = _copy(good[0], tmp / "ckpt")
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) * 3 // 5])
    return path, f, r"cannot read weights \(truncated or corrupt\?\)"


def truncated_header(good, tmp):
    path = _copy(good[0], tmp / "ckpt")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:20])
    return path, f, r"cannot read weights \(truncated or corrupt\?\)"


def shape_mismatch(good, tmp):
    path = _copy(good[0], tmp / "ckpt")
    _edit_config(path, hidden_size=96)  # head_dim is explicit, so only the hidden dim changes
    return path, path, r"shape mismatch for [\w.]+: checkpoint \(.*\b64\b.*\), model \(.*\b96\b.*\)"


def missing_tensor(good, tmp):
    from safetensors.torch import load_file, save_file

    path = _copy(good[0], tmp / "ckpt")
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    return path, path, r"missing weights: model\.layers\.1\.mlp\.up_proj\.weight"


CASES = [no_such_path, missing_config, unsupported_architecture, missing_weight_file,
         truncated_weights, truncated_header, shape_mismatch, missing_tensor]


@pytest.fixture
def built_models(monkeypatch):
    """Weak references to every model the loader builds during the test."""
    import weakref

    import engine.loader.checkpoint

    refs: list = []

    class Recorded(engine.loader.checkpoint.CausalLM):
        def __init__(self, cfg):
            super().__init__(cfg)
            refs.append(weakref.ref(self))

    monkeypatch.setattr(engine.loader.checkpoint, "CausalLM", Recorded)
    return refs


def _assert_nothing_held(models) -> None:
    """Models built by a failed load are gone, or at least hold no memory (the traceback of
    the error the test still holds may keep the emptied module object itself)."""
    for ref in models:
        model = ref()
        if model is not None:
            held = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.numel()]
            assert held == [], f"a failed load left {len(held)} tensors allocated: {held[:3]}..."


def live_tensor_bytes() -> int:
    """Bytes behind every live tensor's storage (each storage counted once)."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): some torch objects warn when their __class__ is read
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            st = obj.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def _check_error(err: CheckpointError, file: Path, problem: str) -> None:
    msg = str(err)
    assert err.path == str(file), msg
    assert str(file) in msg
    assert re.search(problem, msg), msg


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_runner_load(good, tmp_path, built_models, case):
    path, file, problem = case(good, tmp_path)
    runner = ModelRunner(EngineConfig(model=str(path), device="cpu"))
    with pytest.raises(CheckpointError) as info:
        runner.load()
    _check_error(info.value, file, problem)
    # released by load() itself: nothing owned, nothing reachable, nothing pinned by the error
    assert runner.released and runner._owner.names() == [] and not runner.loaded
    assert reachable_tensors(runner) == []
    _assert_nothing_held(built_models)
    assert runner.shutdown() == []  # and a later shutdown() is harmless


def test_failed_load_pins_no_memory(good, tmp_path):
    """Whole-process check for one failure inside weight loading: while the caller still holds
    the error, no tensor storage created by the load is alive."""
    path, _, _ = shape_mismatch(good, tmp_path)
    before = live_tensor_bytes()
    runner = ModelRunner(EngineConfig(model=str(path), device="cpu"))
    with pytest.raises(CheckpointError) as info:
        runner.load()
    assert info.value.__traceback__ is not None
    assert live_tensor_bytes() == before


class _Recorder(AsyncEngine):
    """Remembers the engine ``open`` created, so the test can inspect it after the failure."""

    made: list[AsyncEngine] = []

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        _Recorder.made.append(self)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_engine_open(good, tmp_path, built_models, case):
    path, file, problem = case(good, tmp_path)
    _Recorder.made.clear()

    async def main():
        async with _Recorder.open(EngineConfig(model=str(path), device="cpu")):
            pytest.fail("a bad checkpoint opened")

    with pytest.raises(CheckpointError) as info:  # itself, not wrapped in an ExceptionGroup
        anyio.run(main)
    _check_error(info.value, file, problem)
    (engine,) = _Recorder.made
    _Recorder.made.clear()
    assert engine.state is State.SHUTDOWN
    assert engine.core is None
    assert engine.runner.released
    assert reachable_tensors(engine.runner) == []
    _assert_nothing_held(built_models)


def test_good_checkpoints_load(good):
    """The cases' base checkpoints are fine, so each failure above is the one injected."""
    for path in good:
        runner = ModelRunner(EngineConfig(model=str(path), device="cpu", num_kv_blocks=4))
        runner.load()
        assert runner.loaded
        assert runner.shutdown() == ["grammar_bitmask", "model_state", "kv_cache", "weights"]

"""Hugging Face models by repo id from a local hub cache (never a download), ``--revision``, the
served name, and the error that says where it looked."""

from __future__ import annotations

import os
from pathlib import Path
import shutil
import subprocess
import sys

import pytest

from engine import EngineConfig, ModelRunner
from engine.errors import CheckpointError
from engine.loader.hf_hub import display_name, looks_like_repo_id, resolve_model_path

pytestmark = pytest.mark.usefixtures("torch_one_thread")
MAIN = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture()
def hub(tmp_path, monkeypatch, hf_checkpoint):
    """A hub cache with ``tiny-org/tiny-llama`` at two commits (main and an older one whose
    config has another context length), as huggingface_hub lays it out."""
    ckpt, _ = hf_checkpoint("hub-src", seed=3)
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    for commit in (MAIN, OLD):
        shutil.copytree(ckpt, repo / "snapshots" / commit)
    old_cfg = repo / "snapshots" / OLD / "config.json"
    old_cfg.write_text(old_cfg.read_text().replace('"max_position_embeddings": 256',
                                                   '"max_position_embeddings": 128'))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def _load(model: str, revision=None) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=model, revision=revision, device="cpu",
                                      num_kv_blocks=16))
    runner.load()
    return runner


def test_repo_id_loads_from_the_cache(hub):
    runner = _load("tiny-org/tiny-llama")
    try:
        assert runner.max_model_len == 256 and runner.model_config.num_layers == 2
    finally:
        runner.shutdown()
    old = _load("tiny-org/tiny-llama", revision=OLD)
    try:
        assert old.max_model_len == 128
    finally:
        old.shutdown()


def test_names(hub, tmp_path):
    snap = hub / "models--tiny-org--tiny-llama" / "snapshots" / MAIN
    assert resolve_model_path("tiny-org/tiny-llama") == snap
    assert display_name("tiny-org/tiny-llama") == "tiny-org/tiny-llama"
    assert display_name(str(snap)) == "tiny-org/tiny-llama"
    assert display_name("default") == "SmolLM2-135M-Instruct"
    assert display_name("random:tiny-llama") == "random:tiny-llama"
    plain = tmp_path / "my-model"
    plain.mkdir()
    assert display_name(str(plain)) == "my-model"
    assert looks_like_repo_id("Qwen/Qwen3-0.6B")
    for spec in ("/abs/path", "./rel/dir", "a/b/c", "model.gguf", "../x/y"):
        assert not looks_like_repo_id(spec), spec


def test_missing_repo_or_revision_says_where_it_looked(hub):
    for model, revision in (("tiny-org/absent", None), ("tiny-org/tiny-llama", "v9")):
        with pytest.raises(CheckpointError) as info:
            _load(model, revision)
        msg = str(info.value)
        assert model in msg and str(hub / ("models--" + model.replace("/", "--"))) in msg
        assert repr(revision or "main") in msg


@pytest.mark.slow
def test_serve_exits_2_for_a_missing_repo(hub):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "entrypoints.cli", "serve", "--model", "tiny-org/absent",
                        "--device", "cpu", "--listen", f"unix://{hub}/e.sock"],
                       capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert p.returncode == 2, p.stderr
    assert "tiny-org/absent" in p.stderr and "models--tiny-org--absent" in p.stderr

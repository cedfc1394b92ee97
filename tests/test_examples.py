"""The examples run: ``examples/rl_loop.py`` (generation, weights from a "trainer" through a gloo
group, generation again) on a small random model; the samples change with every update, every
output carries its weights' version, and nothing of the engine is left."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import anyio
import pytest

pytestmark = pytest.mark.usefixtures("torch_one_thread")

ROOT = Path(__file__).resolve().parent.parent


def test_rl_loop_example(capsys) -> None:
    spec = importlib.util.spec_from_file_location("rl_loop", ROOT / "examples" / "rl_loop.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    history = anyio.run(mod.main, "random:tiny-llama", 3, 2)
    assert len(history) == 3 and all(len(h) == 2 * len(mod.PROMPTS) for h in history)
    assert history[0] != history[1] != history[2]  # same seeds: the weights changed them
    out = capsys.readouterr().out
    assert "round 2: weights v[2]" in out and "still alive: 0" in out

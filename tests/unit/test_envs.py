"""engine/envs.py: the one place environment variables are declared and read."""

from __future__ import annotations

from pathlib import Path
import re

import pytest

from engine import envs

ROOT = Path(__file__).resolve().parents[2]


def test_kill_switches_read_from_the_given_environment():
    assert envs.switches({}) == envs.Switches(True, True, True, True)
    assert envs.switches({envs.TRITON: "0"}) == envs.Switches(False, False, True, True)
    assert envs.switches({envs.FUSED: "0"}) == envs.Switches(True, False, True, True)
    assert envs.switches({envs.CPU_EXT: "0", envs.GRAMMAR_WORKER: " 0 "}).cpu_ext is False
    assert envs.switches({envs.GRAMMAR_WORKER: "0"}).grammar_worker is False
    assert envs.switches({envs.FUSED: "1"}).fused is True


def test_only_declared_names_and_valid_values():
    with pytest.raises(KeyError):
        envs.get("ENGINECORE_NOT_A_SWITCH")
    assert envs.tp_timeout_s({}) == 30.0
    assert envs.tp_timeout_s({envs.TP_TIMEOUT_S: "2.5"}) == 2.5
    for bad in ("x", "0", "-1", "1e9"):
        with pytest.raises(ValueError, match=envs.TP_TIMEOUT_S):
            envs.tp_timeout_s({envs.TP_TIMEOUT_S: bad})


def test_every_declared_name_is_unique_and_documented():
    names = [v.name for v in envs.VARIABLES]
    assert len(names) == len(set(names))
    assert all(v.doc and v.kind in {"secret", "kill switch", "operations"} for v in envs.VARIABLES)


def test_no_product_module_names_an_environment_variable_but_envs():
    """``ENGINECORE_*`` appears in the product packages only in engine/envs.py: every other
    module asks it (a name read elsewhere would be a switch nobody documents)."""
    found = []
    for package in ("engine", "ipc", "entrypoints", "states"):
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix not in {".py", ".cc", ".cpp", ".h"} or path.name == "envs.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"ENGINECORE_[A-Z]", line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_a_runner_reads_the_switches_once_when_built_and_hands_them_down(monkeypatch):
    """The kill switches are read when the runner is built (not at import) and reach the model
    it loads; a change of the environment later changes nothing for it."""
    from engine.config import EngineConfig
    from engine.runner.model_runner import ModelRunner

    monkeypatch.setenv(envs.TRITON, "0")
    runner = ModelRunner(EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=8))
    monkeypatch.delenv(envs.TRITON)
    try:
        runner.load()
        assert runner.switches == envs.Switches(triton=False, fused=False)
        model = runner.resource("weights")
        assert model.switches is runner.switches
    finally:
        runner.shutdown()
    fresh = ModelRunner(EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=8))
    assert fresh.switches == envs.Switches()

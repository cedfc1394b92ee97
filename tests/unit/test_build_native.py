"""scripts/build_native.py (run by scripts/setup.sh): a C++ part this machine can build but that
does not build fails the setup; one it cannot build is skipped with a note."""

import importlib.util
from pathlib import Path

import pytest

from engine.ops.cpu import cpu_ext, invariant_attention
from engine.structured import native

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def build_native():
    spec = importlib.util.spec_from_file_location("build_native", ROOT / "scripts" / "build_native.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_compiler_is_a_note_not_a_failure(build_native, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setattr(cpu_ext, "module", lambda: pytest.fail("must not build"))
    monkeypatch.setattr(invariant_attention, "module", lambda: pytest.fail("must not build"))
    monkeypatch.setattr(native, "worker_module", lambda: pytest.fail("must not build"))
    assert build_native.main() == 0
    err = capsys.readouterr().err
    assert err.count("cannot be built here: no C++ compiler") == 3, err


def test_switched_off_is_not_built(build_native, monkeypatch, capsys):
    monkeypatch.setenv("ENGINECORE_CPU_EXT", "0")
    monkeypatch.setenv("ENGINECORE_GRAMMAR_WORKER", "0")
    assert build_native.main() == 0
    assert capsys.readouterr().err.count("switched off") == 2


@pytest.mark.parametrize("part", ["cpu_ext", "invariant_attention", "grammar_worker"])
def test_a_failed_build_where_it_can_build_fails_the_setup(build_native, monkeypatch, capsys,
                                                            part):
    monkeypatch.setattr(build_native, "_cannot_build", lambda ninja=False: None)
    if part == "cpu_ext":
        monkeypatch.setattr(cpu_ext, "module", lambda: None)
    elif part == "invariant_attention":
        monkeypatch.setattr(invariant_attention, "module", lambda: None)
    else:
        monkeypatch.setattr(native, "worker_module", lambda: None)
    assert getattr(build_native, part)() is False
    assert "ERROR" in capsys.readouterr().err

"""entrypoints.malloc.tune_malloc: applied only at entry points, and only when the user set nothing."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from entrypoints.malloc import tune_malloc

ROOT = Path(__file__).resolve().parents[1]
glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc only")


def _in_fresh_process(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.pop("ENGINECORE_MALLOC_TUNING", None)
    env.update(env_extra)
    code = "from entrypoints.malloc import tune_malloc; print(tune_malloc())"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()


@glibc
def test_applies_in_a_fresh_process():
    assert _in_fresh_process({}) == "True"


@pytest.mark.parametrize("extra", [{"ENGINECORE_MALLOC_TUNING": "0"}, {"MALLOC_TOP_PAD_": "0"},
                                   {"MALLOC_ARENA_MAX": "2"},
                                   {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}])
def test_user_settings_win(extra):
    assert tune_malloc(extra) is False
    assert _in_fresh_process(extra) == "False"


def test_only_entry_points_call_it():
    """Process-wide settings are the entry point's business: the enginecore CLI."""
    callers = sorted(str(p.relative_to(ROOT)) for pkg in ("engine", "ipc", "states", "bench", "entrypoints")
                     for p in (ROOT / pkg).rglob("*.py")
                     if "tune_malloc(" in p.read_text() and p.name != "malloc.py")
    assert callers == ["entrypoints/cli.py"]


def test_trimmer_gives_memory_back_at_most_once_per_interval():
    from entrypoints.malloc import Trimmer

    t = Trimmer(min_interval=3600)
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert t() is on_glibc
    assert t() is False  # within the interval: no second trim

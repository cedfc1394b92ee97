"""entrypoints.malloc: one arena and trims for the HTTP frontends, applied only at their entry point
and only when the user set nothing; the engine process keeps glibc's defaults."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from entrypoints.malloc import one_arena

ROOT = Path(__file__).resolve().parents[1]
glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc only")


def _in_fresh_process(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.pop("ENGINECORE_MALLOC_TUNING", None)
    env.update(env_extra)
    code = "from entrypoints.malloc import one_arena; print(one_arena())"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60).stdout.strip()


@glibc
def test_applies_in_a_fresh_process():
    assert _in_fresh_process({}) == "True"


@pytest.mark.parametrize("extra", [{"ENGINECORE_MALLOC_TUNING": "0"}, {"MALLOC_TOP_PAD_": "0"},
                                   {"MALLOC_ARENA_MAX": "2"},
                                   {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}])
def test_user_settings_win(extra):
    assert one_arena(extra) is False
    assert _in_fresh_process(extra) == "False"


def test_the_engine_entry_point_leaves_malloc_alone():
    """A 64 MiB M_TOP_PAD made the engine process fault 667k times and run at half speed once
    the load ran on the step thread (entrypoints/malloc.py): its entry point sets nothing."""
    assert "mallopt" not in (ROOT / "entrypoints" / "cli.py").read_text()
    assert "M_TOP_PAD" not in (ROOT / "entrypoints" / "malloc.py").read_text().split('"""', 2)[2]


def test_trimmer_gives_memory_back_at_most_once_per_interval():
    from entrypoints.malloc import Trimmer

    t = Trimmer(min_interval=3600)
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert t() is on_glibc
    assert t() is False  # within the interval: no second trim


@glibc
def test_trimmer_trims_the_last_of_a_burst_later():
    """A call inside the interval schedules one trim for its end (not dropped, not repeated)."""
    import asyncio
    from entrypoints.malloc import Trimmer

    async def burst() -> int:
        t = Trimmer(min_interval=0.05)
        calls = []
        real = t._trim
        t._trim = lambda pad: calls.append(pad) or real(pad)
        assert t() is True and t() is False and t() is False  # one trim now, one scheduled
        await asyncio.sleep(0.2)
        return len(calls)

    assert asyncio.run(burst()) == 2


def test_one_arena_only_in_the_frontend_entry_point():
    from entrypoints.malloc import one_arena

    assert one_arena({"MALLOC_ARENA_MAX": "4"}) is False  # the user's setting wins
    callers = sorted(str(p.relative_to(ROOT)) for pkg in ("engine", "ipc", "states", "bench", "entrypoints")
                     for p in (ROOT / pkg).rglob("*.py")
                     if "one_arena(" in p.read_text() and p.name != "malloc.py")
    assert callers == ["entrypoints/http/frontend.py"]


_PARSE_ON_THREADS = """
import ctypes, gc, json, sys, threading
from entrypoints.malloc import one_arena
from entrypoints.http import protocol as P
if sys.argv[1] == "1":
    assert one_arena()
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
body = json.dumps({"model": "m", "prompt": "x", "stop_token_ids": list(range(200_000))}).encode()
def parse():
    try:
        P.CompletionRequest.model_validate_json(body)
    except Exception:
        pass
parse(); gc.collect(); ctypes.CDLL(None).malloc_trim(0)
start = rss()
for _ in range(8):
    t = threading.Thread(target=parse); t.start(); t.join()
gc.collect(); ctypes.CDLL(None).malloc_trim(0)
print(rss() - start)
"""


@glibc
def test_one_arena_gives_back_what_worker_threads_parsed():
    """The frontend parses large bodies on worker threads; with one arena a refused 200k-entry
    stop_token_ids list leaves nothing behind (12 MB stayed with glibc's per-thread arenas)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.pop("ENGINECORE_MALLOC_TUNING", None)
    run = lambda flag: float(subprocess.run(  # noqa: E731
        [sys.executable, "-c", _PARSE_ON_THREADS, flag], env=env, cwd=ROOT, capture_output=True,
        text=True, check=True, timeout=120).stdout)
    assert run("1") < 3.0


@glibc
def test_trim_every_keeps_trimming():
    import anyio
    from entrypoints import malloc

    calls = []

    class Counting(malloc.Trimmer):
        def _now(self) -> None:
            calls.append(1)
            super()._now()

    async def main():
        real, malloc.Trimmer = malloc.Trimmer, Counting
        try:
            with anyio.move_on_after(0.3):
                await malloc.trim_every(0.05)
        finally:
            malloc.Trimmer = real

    anyio.run(main)
    assert len(calls) >= 3

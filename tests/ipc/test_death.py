"""Process death: the engine SIGKILLed under its clients, the spawning parent SIGKILLed under
its engine, and an engine that fails to start."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import anyio
import pytest

from engine import EngineConfig
from engine.errors import EngineDeadError
from engine.params import SamplingParams
from ipc.client import EngineClient
from ipc.spawn import EngineStartupError
from ipc.sync_client import SyncEngineClient
from states import State

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:tiny-llama"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
LONG = SamplingParams(max_tokens=1500, ignore_eos=True)

# A client in another process: long streams; reports when (wall clock) and how each one ended.
REMOTE_CLIENT = """
import json, sys, time, anyio
from engine.params import SamplingParams
from ipc.client import EngineClient

async def main():
    ends = []
    async with EngineClient.connect(sys.argv[1]) as c:
        streams = [c.generate([i + 3, 4], SamplingParams(max_tokens=1500, ignore_eos=True))
                   for i in range(4)]
        for s in streams:
            await s.__anext__()
        print("STARTED", flush=True)
        async def run(s):
            try:
                async for _ in s:
                    pass
                ends.append([time.time(), "finished", ""])
            except Exception as exc:
                ends.append([time.time(), type(exc).__name__, str(exc)])
        async with anyio.create_task_group() as tg:
            for s in streams:
                tg.start_soon(run, s)
        try:
            await c.health()
        except Exception as exc:
            ends.append([time.time(), type(exc).__name__, "later call"])
    print(json.dumps(ends), flush=True)

anyio.run(main)
"""

# Spawns an engine, prints its pid, waits to be killed.
SPAWNING_PARENT = """
import anyio
from engine import EngineConfig
from ipc.client import EngineClient

async def main():
    async with EngineClient.spawn(EngineConfig(model="random:tiny-llama")) as c:
        print(c.process.pid, flush=True)
        await anyio.sleep_forever()

anyio.run(main)
"""


def gone(pid: int) -> bool:
    """No such process, or only a zombie left to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.alone  # asserts wall-clock bounds
async def test_engine_sigkill_fails_every_client_within_a_second(alone_from_here):
    remote = None
    async with EngineClient.spawn(EngineConfig(model=MODEL)) as a:
        address = a.process.bound_address
        # (the engine's start: beside other tests; from here on its streams run against time)
        await anyio.to_thread.run_sync(alone_from_here)
        remote = await anyio.open_process([sys.executable, "-c", REMOTE_CLIENT, address], env=ENV)
        async with remote, EngineClient.connect(address) as b, EngineClient.connect(address) as idle:
            streams = [c.generate([i + 1, 2, 3], LONG) for c in (a, b) for i in range(4)]
            for s in streams:
                await s.__anext__()
            # (the remote's stdout is a byte stream: a line may come in pieces, or two at once)
            buffered = bytearray()

            async def line() -> bytes:
                while b"\n" not in buffered:
                    buffered.extend(await remote.stdout.receive())
                end = buffered.index(b"\n") + 1
                out = bytes(buffered[:end])
                del buffered[:end]
                return out

            with anyio.fail_after(60):
                assert (await line()).startswith(b"STARTED")
            ends: list = []

            async def run(s) -> None:
                try:
                    async for _ in s:
                        pass
                    ends.append((time.monotonic(), None))
                except EngineDeadError as exc:
                    ends.append((time.monotonic(), exc))

            async def watch_idle() -> None:  # no frame in flight on this connection
                while not idle.closed:
                    await anyio.sleep(0.002)
                ends.append((time.monotonic(), "idle"))

            async with anyio.create_task_group() as tg:
                for s in streams:
                    tg.start_soon(run, s)
                tg.start_soon(watch_idle)
                await anyio.sleep(0.1)
                t_wall, t0 = time.time(), time.monotonic()
                os.kill(a.process.pid, signal.SIGKILL)
            local = [t - t0 for t, _ in ends]
            assert len(ends) == 9 and all(e is not None for _, e in ends)
            with anyio.fail_after(10):
                out = await line()
            remote_ends = json.loads(out)
            await remote.wait()
            assert remote.returncode == 0
            assert [n for _, n, _ in remote_ends] == ["EngineDeadError"] * 5
            remote_lat = [t - t_wall for t, _, _ in remote_ends[:4]]
            print(f"\ndeath detected after: in-process clients {min(local) * 1000:.0f}-"
                  f"{max(local) * 1000:.0f} ms, other process {min(remote_lat) * 1000:.0f}-"
                  f"{max(remote_lat) * 1000:.0f} ms")
            assert max(local) < 1.0 and max(remote_lat) < 1.0
            # The spawning client knows the exit code and says so.
            spawned_errors = [str(e) for _, e in ends[:9] if isinstance(e, EngineDeadError)]
            assert any("-9 (SIGKILL)" in m for m in spawned_errors)
            assert a.exit_code == -9 and a.state is State.FAILED and b.state is State.FAILED
            # Later calls raise too.
            for c in (a, b, idle):
                with pytest.raises(EngineDeadError):
                    c.generate([1])
                with pytest.raises(EngineDeadError):
                    await c.health()
                with pytest.raises(EngineDeadError):
                    await c.drain(1)
                with pytest.raises(EngineDeadError):
                    await c.shutdown()
            with pytest.raises(EngineDeadError, match="code -9"):
                await a.health()
    assert a.exit_code == -9


@pytest.mark.slow
def test_engine_exits_when_the_spawning_parent_is_killed():
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c", SPAWNING_PARENT], env=ENV,
                              stdout=subprocess.PIPE)
    try:
        line = parent.stdout.readline()
        engine_pid = int(line)
        assert not gone(engine_pid)
        parent.kill()
        parent.wait(10)
        t0 = time.monotonic()
        while not gone(engine_pid) and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        waited = time.monotonic() - t0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()
    print(f"\nengine {engine_pid} gone {waited:.2f} s after its parent's SIGKILL")
    assert gone(engine_pid) and waited < 5.0


@pytest.mark.slow
def test_startup_failure_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(EngineStartupError) as info:
        with SyncEngineClient.spawn(EngineConfig(model=str(missing)), startup_timeout=120):
            pass
    err = info.value
    assert err.exit_code == 2
    assert "exited with code 2 during startup" in str(err)
    assert "startup failed" in str(err) and "does not exist" in str(err)
    assert str(missing) in err.stderr_tail

"""Finding 2 and 7: more connections than the engine's file-descriptor limit.

Before: under a low ``RLIMIT_NOFILE`` a flood of bare connects made ``accept`` fail with EMFILE,
anyio's ``Listener.serve`` stopped at the first failure, the engine process exited and the good
client's running request died with EngineDeadError; the accept error was logged millions of
times. Now the accept loop backs off and retries, logs a summary, and the good client is served
through the flood and after it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from engine.params import SamplingParams
from ipc.client import EngineClient

HERE = Path(__file__).resolve().parent
NOFILE = 64
FLOOD = 300  # bare connections: several times the engine's limit


def _start(address: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(HERE / "fd_limited_server.py"), address, str(NOFILE)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline()
    assert line.startswith("READY "), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.split(" ", 1)[1].strip()


@pytest.mark.asyncio
async def test_engine_survives_more_connections_than_file_descriptors(tmp_path):
    proc, address = _start(f"unix://{tmp_path}/e.sock")
    flood: list[socket.socket] = []
    err = ""
    try:
        async with EngineClient.connect(address) as good:
            long = good.generate([1, 2], SamplingParams(max_tokens=400))
            first = await long.__anext__()
            for _ in range(FLOOD):  # no handshake: each holds one of the engine's descriptors
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(address[len("unix://"):])
                flood.append(s)
            outs = [first] + [o async for o in long]  # served all through the flood
            assert outs[-1].finish_reason == "length" and len(outs) == 400
            assert proc.poll() is None
            for s in flood:
                s.close()
            flood.clear()
        # After the flood: new connections are accepted and served again.
        with anyio.fail_after(20):
            while True:
                try:
                    async with EngineClient.connect(address) as again:
                        out = await again.complete([5], SamplingParams(max_tokens=3))
                        assert out.token_ids == [1, 2, 3]
                        await again.shutdown()
                    break
                except (OSError, TimeoutError):  # the backlog still drains
                    await anyio.sleep(0.2)
        assert proc.wait(20) == 0
    finally:
        for s in flood:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    accept_lines = [ln for ln in err.splitlines() if "accept failed" in ln]
    assert accept_lines and "EMFILE" in accept_lines[0], err[-2000:]  # the limit was reached
    assert len(accept_lines) <= 30, accept_lines[:5]  # first + at most one summary a second

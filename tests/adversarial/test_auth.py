"""Finding 8: the token could only be given in argv (readable in /proc/PID/cmdline by every
local user), a loopback TCP listener could be left without authentication although a token was
configured in the environment, wrong tokens were not throttled (2,784 guesses/s) and their log
lines lacked the peer address. The throttle holds failures only: a right token is admitted at
once whatever it has counted (test_auth_flood.py puts that under a 40-thread flood)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import anyio
import pytest

from engine import EngineConfig
from engine.params import SamplingParams
from helpers import serving
from ipc.auth import AuthThrottle
from ipc.client import EngineClient
from ipc.errors import AuthError
from ipc.spawn import EngineProcess

MODEL = "random:tiny-llama"
TOKEN = "s3cret-" + "x" * 24


async def _attempt(addr: str, token: str | None) -> tuple[float, str]:
    t0 = time.monotonic()
    try:
        async with EngineClient.connect(addr, token=token, timeout=20):
            return time.monotonic() - t0, "ok"
    except AuthError as exc:
        return time.monotonic() - t0, str(exc)


@pytest.mark.asyncio
@pytest.mark.alone  # asserts wall-clock bounds
async def test_failed_authentications_are_throttled_and_logged_with_the_peer(caplog):
    caplog.set_level(logging.WARNING, logger="enginecore.ipc")
    throttle = AuthThrottle(free_failures=3, base_delay=1.0, max_delay=2.0, max_waiting=1)
    async with serving(token=TOKEN, auth_throttle=throttle) as (eng, server, addr):
        free = [await _attempt(addr, "guess") for _ in range(3)]
        assert all(msg == "missing or wrong token" and dt < 0.8 for dt, msg in free), free
        lines = [r.getMessage() for r in caplog.records if "failed authentication" in r.getMessage()]
        assert lines and "127.0.0.1:" in lines[0], lines  # the peer, with its port

        results: list = []

        async def attempt(token):
            results.append((token, *await _attempt(addr, token)))

        async with anyio.create_task_group() as tg:  # now throttled: one is held, one answered at once
            tg.start_soon(attempt, "guess")
            await anyio.sleep(0.1)
            tg.start_soon(attempt, "guess2")
            await anyio.sleep(0.1)
            tg.start_soon(attempt, TOKEN)  # while a failure is held and the bound is reached
        held = [r for r in results if r[0] == "guess"][0]
        at_once = [r for r in results if r[0] == "guess2"][0]
        right = [r for r in results if r[0] == TOKEN][0]
        assert held[1] >= 1.0 and held[2] == "missing or wrong token"
        assert at_once[1] < 0.8 and "too many failed authentications" in at_once[2]
        # The right token is neither delayed nor locked out.
        assert right[2] == "ok" and right[1] < 0.8, right
        dt, msg = await _attempt(addr, TOKEN)
        assert msg == "ok" and dt < 0.8


@pytest.mark.asyncio
async def test_the_right_token_is_admitted_whatever_the_throttle_has_counted():
    throttle = AuthThrottle(max_waiting=4)
    for _ in range(1000):
        throttle.failed("127.0.0.1")
    throttle.waiting = throttle.max_waiting  # as if the bound were reached by held failures
    async with serving(token=TOKEN, auth_throttle=throttle) as (eng, server, addr):
        async with EngineClient.connect(addr, token=TOKEN) as c:
            assert (await c.health()).ready
        with pytest.raises(AuthError, match="too many failed authentications"):
            async with EngineClient.connect(addr, token="guess"):  # answered at once, not held
                pass
    assert throttle.waiting == throttle.max_waiting  # neither held anything


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.asyncio
async def test_spawned_engine_gets_its_token_outside_argv_and_loopback_tcp_requires_it():
    async with EngineClient.spawn(EngineConfig(model=MODEL), token=TOKEN, address="tcp://127.0.0.1:0",
                                  startup_timeout=180) as c:
        proc = c.process
        assert TOKEN not in _cmdline(proc.pid) and proc.bound_address.startswith("tcp://127.0.0.1:")
        assert (await c.complete([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))).finish_reason == "length"
        for token in (None, "wrong"):  # loopback TCP, but a token is configured: required
            with pytest.raises(AuthError):
                async with EngineClient.connect(proc.bound_address, token=token):
                    pass
    assert c.exit_code == 0


@pytest.mark.asyncio
async def test_token_file_and_its_permissions(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    os.chmod(path, 0o644)
    proc = EngineProcess.start(EngineConfig(model=MODEL), args=["--token-file", str(path)], echo=False)
    try:
        addr = await proc.wait_ready_async(180)
        assert TOKEN not in _cmdline(proc.pid)
        with pytest.raises(AuthError):
            async with EngineClient.connect(addr):
                pass
        async with EngineClient.connect(addr, token=TOKEN) as c:  # whitespace stripped
            await c.shutdown()
        assert await proc.wait_async(30) == 0
    finally:
        await proc.stop_async(10)
    assert "accessible by group/others" in proc.stderr_tail()

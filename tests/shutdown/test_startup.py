"""Startup errors and a signal during startup."""

from __future__ import annotations

import re
import signal
import time

import pytest

from serve_helpers import ServeProcess, pid_alive

pytestmark = pytest.mark.slow


def test_bad_model_path_exits_2_with_clear_message(tmp_path) -> None:
    sp = ServeProcess(tmp_path, model=str(tmp_path / "no-such-model"))
    try:
        code = sp.wait(60)
    finally:
        sp.kill()
    assert code == 2
    assert "no-such-model" in sp.log and "does not exist" in sp.log
    assert not pid_alive(sp.proc.pid)
    assert not sp.sock.exists()


def test_signal_during_startup_stops_loading(tmp_path) -> None:
    # ~2.4 GB of fp32 weights filled tensor by tensor: the signal lands mid-load
    sp = ServeProcess(tmp_path, model="random:qwen3-0.6b")
    try:
        sp.wait_for_log("loading random:qwen3-0.6b", 60)
        time.sleep(0.3)
        t = sp.signal(signal.SIGTERM)
        code = sp.wait(30)
        elapsed = time.monotonic() - t
    finally:
        sp.kill()
    assert code == 128 + signal.SIGTERM, sp.log
    assert "during startup" in sp.log
    # it stopped mid-load, not after it (a bound on time alone fails on a loaded 2-core machine)
    m = re.search(r"loading stopped: (\d+) of (\d+) weight tensors filled", sp.log)
    assert m and int(m[1]) < int(m[2]), sp.log
    assert elapsed < 20.0, f"took {elapsed:.1f}s to stop loading"
    assert "serving " not in sp.log
    assert not pid_alive(sp.proc.pid)

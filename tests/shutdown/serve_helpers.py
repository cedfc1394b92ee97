"""Start and watch real ``enginecore serve`` processes for the shutdown suite."""

from __future__ import annotations

import os
from pathlib import Path
import signal
import subprocess
import sys
import time
from typing import Optional

import msgspec

from engine.config import EngineConfig


class ServeProcess:
    """``python -m entrypoints.cli serve`` with stderr captured to a file we can poll."""

    def __init__(self, tmp: Path, config: Optional[EngineConfig] = None, *, args: tuple = (),
                 drain_timeout: float = 30.0, model: Optional[str] = None,
                 fault_at_step: Optional[int] = None):
        self.sock = tmp / "engine.sock"
        self.address = f"unix://{self.sock}"
        self.log_path = tmp / "serve.log"
        # with a fault: tests/faults.py arms it, then runs the same command line
        entry = ("entrypoints.cli",) if fault_at_step is None else ("tests.faults", str(fault_at_step))
        cmd = [sys.executable, "-m", *entry, *(("-v",) if os.environ.get("SERVE_VERBOSE") else ()), "serve", "--listen", self.address,
               "--drain-timeout", str(drain_timeout), *args]
        if config is not None:
            cmd += ["--config-json", msgspec.json.encode(config).decode()]
        elif model is not None:
            cmd += ["--model", model]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).resolve().parents[2])

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode} before {text!r}:\n{self.log}")
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in the log after {timeout}s:\n{self.log}")

    def wait_serving(self, timeout: float = 120.0) -> None:
        self.wait_for_log("enginecore.serve: serving ", timeout)  # the IPC socket is up

    def signal(self, signum: int = signal.SIGTERM) -> float:
        os.kill(self.proc.pid, signum)
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); look at its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False

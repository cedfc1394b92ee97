"""Start a private engine process and connect to it: ``EngineClient.spawn(config)``.

The child is ``python -m entrypoints.cli serve --config-json <config> --listen <address>
--parent-pid <us> --ready-fd <pipe>``:

* The address defaults to a Unix socket in a fresh temporary directory of mode 0700 (only we
  can even reach the socket), removed when the engine is reaped.
* The engine writes ``READY <address>`` to the pipe once it serves; if it exits first (bad
  checkpoint, bad config, address in use), :class:`EngineStartupError` carries its exit code
  and the tail of its stderr.
* The child's stdout and stderr go through a pipe that a thread copies to our stderr (fd 2)
  line by line, keeping the last lines for error messages.
* ``--parent-pid``: the engine drains and exits when we die (even by SIGKILL).
* A ``token`` travels in the child's environment (``TOKEN_ENV``; ``/proc/<pid>/environ``
  is readable by the same user only), never on its command line, which every local user can
  read (``ps``); the default private socket needs none.
* On exit of the context: ``Shutdown`` (running requests are aborted), wait for the process to
  exit (killed after ``shutdown_timeout``), reap it; ``client.exit_code`` tells how it ended.
  If the engine process dies, the connection's EOF makes every call raise ``EngineDeadError``
  (with the exit code) at once.
"""

from __future__ import annotations

from collections import deque
from contextlib import asynccontextmanager
import logging
import os
from pathlib import Path
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, AsyncIterator, Optional, Sequence

import anyio
import msgspec

from engine.errors import EngineError
from states import InvalidTransitionError

from .auth import TOKEN_ENV

log = logging.getLogger("enginecore.ipc.spawn")

_MAX_UNIX_PATH = 107
_TAIL_LINES = 40


class EngineStartupError(EngineError):
    """The engine process exited (or timed out) before serving. ``exit_code`` (None: it was
    killed by us after ``startup_timeout``) and ``stderr_tail`` tell why."""

    def __init__(self, message: str, exit_code: Optional[int] = None, stderr_tail: str = ""):
        super().__init__(message)
        self.exit_code = exit_code
        self.stderr_tail = stderr_tail


def _private_dir() -> str:
    d = tempfile.mkdtemp(prefix="enginecore-")  # mode 0700
    if len(os.fsencode(d)) + len("/engine.sock") > _MAX_UNIX_PATH:  # a long $TMPDIR
        shutil.rmtree(d, ignore_errors=True)
        d = tempfile.mkdtemp(prefix="enginecore-", dir="/tmp")
    os.chmod(d, 0o700)
    return d


def _engine_env(env: Optional[dict], token: Optional[str]) -> dict:
    """The child's environment: ours (or ``env``), with this checkout's root on PYTHONPATH so
    ``-m entrypoints.cli`` runs the very code we run, and the token (or none) in TOKEN_ENV."""
    out = dict(os.environ if env is None else env)
    if token:
        out[TOKEN_ENV] = token
    elif env is None:
        out.pop(TOKEN_ENV, None)  # ours is not meant for a child we start without a token
    root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        out["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return out


class EngineProcess:
    """A child ``enginecore serve`` process (see the module docstring). Sync methods, plus
    async ``wait_ready_async`` / ``wait_async`` / ``stop_async``."""

    def __init__(self, popen: subprocess.Popen, address: str, token: Optional[str],
                 ready_fd: int, output_fd: int, tmpdir: Optional[str], echo: bool) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.address = address
        self.token = token
        self.bound_address: Optional[str] = None
        self._ready_fd: Optional[int] = ready_fd
        self._ready_buf = b""
        self._tmpdir = tmpdir
        self._echo = echo
        self._tail: deque[bytes] = deque(maxlen=_TAIL_LINES)
        self._pump = threading.Thread(target=self._copy_output, args=(output_fd,),
                                      name=f"enginecore-{self.pid}-stderr", daemon=True)
        self._pump.start()

    @classmethod
    def start(cls, config: Any = None, *, address: Optional[str] = None,
              token: Optional[str] = None, drain_timeout: float = 30.0,
              args: Sequence[str] = (), env: Optional[dict] = None,
              python: Optional[str] = None, echo: bool = True) -> "EngineProcess":
        """Start the engine process (returns at once; then :meth:`wait_ready`).

        ``config``: an ``EngineConfig`` (sent as ``--config-json``) or None (then ``args`` must
        say which model). ``address``: default a private Unix socket. ``args``: more ``serve``
        flags. ``echo``: copy the engine's output to our stderr."""
        tmpdir = None
        if address is None:
            tmpdir = _private_dir()
            address = f"unix://{tmpdir}/engine.sock"
        ready_r, ready_w = os.pipe()
        out_r, out_w = os.pipe()
        argv = [python or sys.executable, "-m", "entrypoints.cli", "serve", "--listen", address,
                "--ready-fd", str(ready_w), "--parent-pid", str(os.getpid()),
                "--drain-timeout", repr(float(drain_timeout))]
        if config is not None:
            argv += ["--config-json", msgspec.json.encode(config).decode()]
        argv += list(args)
        try:
            popen = subprocess.Popen(argv, pass_fds=(ready_w,), stdin=subprocess.DEVNULL,
                                     stdout=out_w, stderr=out_w, env=_engine_env(env, token),
                                     close_fds=True)
        except BaseException:
            for fd in (ready_r, out_r):
                os.close(fd)
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        finally:
            os.close(ready_w)
            os.close(out_w)
        log.info("started engine process %d on %s", popen.pid, address)
        return cls(popen, address, token, ready_r, out_r, tmpdir, echo)

    # ------------------------------------------------------------------ output

    def _copy_output(self, fd: int) -> None:
        with open(fd, "rb") as f:
            for line in f:
                self._tail.append(line)
                if self._echo:
                    try:
                        os.write(2, line)
                    except OSError:
                        pass

    def stderr_tail(self, lines: int = _TAIL_LINES) -> str:
        """The engine's last ``lines`` lines of output (stdout and stderr)."""
        tail = list(self._tail)[-lines:] if lines > 0 else []
        return b"".join(tail).decode("utf-8", "replace").strip()

    # ------------------------------------------------------------------ the process

    def poll(self) -> Optional[int]:
        """The exit code (negative: killed by that signal), or None while running."""
        return self.popen.poll()

    @property
    def returncode(self) -> Optional[int]:
        return self.popen.poll()

    def send_signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:  # pragma: no cover - just exited
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.popen.wait(timeout)

    async def wait_async(self, timeout: Optional[float] = None) -> int:
        """Wait for the exit (``TimeoutError`` after ``timeout``); cancellable."""
        with anyio.fail_after(timeout):
            delay = 0.005
            while (code := self.popen.poll()) is None:
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.05)
        return code

    async def stop_async(self, timeout: float = 30.0) -> int:
        """Wait up to ``timeout`` for the exit, then SIGKILL; reap, clean up; the exit code."""
        try:
            code = await self.wait_async(timeout)
        except TimeoutError:
            log.warning("engine process %d did not exit within %.0fs; killing it", self.pid, timeout)
            self.kill()
            with anyio.CancelScope(shield=True):
                code = await self.wait_async(10.0)
        finally:
            if self.popen.poll() is None:  # cancelled: do not leave it behind
                self.kill()
                self.popen.wait(10.0)
            self.cleanup()
        return code

    def stop(self, timeout: float = 30.0) -> int:
        """Sync :meth:`stop_async`: wait, SIGKILL after ``timeout``, reap, clean up."""
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.popen.wait(10.0)
        finally:
            self.cleanup()
        return code

    def cleanup(self) -> None:
        """Close our end of the ready pipe, remove the private directory (after the exit)."""
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None
        if self.popen.poll() is not None:
            self._pump.join(2.0)
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                self._tmpdir = None

    # ------------------------------------------------------------------ readiness

    def _parse_ready(self) -> Optional[str]:
        line, nl, _ = self._ready_buf.partition(b"\n")
        if not nl:
            return None
        text = line.decode("utf-8", "replace").strip()
        if not text.startswith("READY "):
            raise EngineStartupError(f"engine process {self.pid} wrote {text!r} instead of READY",
                                     None, self.stderr_tail())
        self.bound_address = text[len("READY "):].strip()
        return self.bound_address

    def _read_ready(self) -> bool:
        """Read what is in the ready pipe; False at EOF."""
        assert self._ready_fd is not None
        try:
            chunk = os.read(self._ready_fd, 4096)
        except BlockingIOError:
            return True
        self._ready_buf += chunk
        return bool(chunk)

    def _startup_failed(self, code: Optional[int], timeout: Optional[float] = None) -> EngineStartupError:
        self._pump.join(2.0)  # the last lines of its output
        tail = self.stderr_tail()
        last = _reason(tail)
        if code is None:
            what = "did not signal readiness" + (f" within {timeout:g} s" if timeout else "")
        elif code < 0:
            what = f"was killed by signal {-code} during startup"
        else:
            what = f"exited with code {code} during startup"
        msg = f"engine process {self.pid} {what}" + (f": {last}" if last else "")
        return EngineStartupError(msg, code, tail)

    def wait_ready(self, timeout: float = 600.0) -> str:
        """Block until the engine serves; its address. Raises :class:`EngineStartupError`
        (the process is killed after ``timeout``)."""
        deadline = time.monotonic() + timeout
        try:
            while (addr := self._parse_ready()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                assert self._ready_fd is not None
                readable, _, _ = select.select([self._ready_fd], [], [], min(left, 0.25))
                if readable and not self._read_ready():
                    break  # EOF: the engine exited (or closed the pipe) without READY
            if addr is not None:
                return addr
            try:
                code: Optional[int] = self.popen.wait(10.0)
            except subprocess.TimeoutExpired:
                self.kill()
                self.popen.wait(10.0)
                code = None
            raise self._startup_failed(code)
        except TimeoutError:
            self.kill()
            self.popen.wait(10.0)
            raise self._startup_failed(None, timeout) from None
        except BaseException:
            if self.bound_address is None:
                self.kill()
                self.popen.wait(10.0)
            raise

    async def wait_ready_async(self, timeout: float = 600.0) -> str:
        """:meth:`wait_ready` for async code (cancellable: cancelling kills the process)."""
        assert self._ready_fd is not None
        os.set_blocking(self._ready_fd, False)
        try:
            with anyio.fail_after(timeout):
                while (addr := self._parse_ready()) is None:
                    await anyio.wait_readable(self._ready_fd)
                    if not self._read_ready():
                        break
                if addr is not None:
                    return addr
                try:
                    code: Optional[int] = await self.wait_async(10.0)
                except TimeoutError:
                    self.kill()
                    code = None
            raise self._startup_failed(code)
        except TimeoutError:
            self.kill()
            with anyio.CancelScope(shield=True):
                await self.wait_async(10.0)
            raise self._startup_failed(None, timeout) from None
        except BaseException:
            if self.bound_address is None and self.popen.poll() is None:
                self.kill()
                with anyio.CancelScope(shield=True):
                    await self.wait_async(10.0)
            raise

    def __repr__(self) -> str:
        return f"<EngineProcess pid={self.pid} address={self.address!r} returncode={self.poll()}>"


def _reason(tail: str) -> str:
    """The line of the engine's output that says why it stopped: its own "enginecore: ..."
    message (e.g. "enginecore: startup failed: <path>: <problem>"), else an exception's last
    line, else the last line."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for pick in (lambda ln: ln.startswith("enginecore:"),
                 lambda ln: ln.split(":", 1)[0].endswith(("Error", "Exception", "Interrupt"))):
        found = [ln for ln in lines if pick(ln)]
        if found:
            return found[-1]
    return lines[-1] if lines else ""


@asynccontextmanager
async def spawn_engine(client_cls: Any, config: Any, *, address: Optional[str] = None,
                       token: Optional[str] = None, startup_timeout: float = 600.0,
                       drain_timeout: float = 30.0, shutdown_timeout: float = 30.0,
                       client_name: str = "enginecore-client") -> AsyncIterator[Any]:
    """``EngineClient.spawn``: start the engine for ``config``, wait for READY (up to
    ``startup_timeout`` s), connect, yield the client; on exit shut the engine down and reap it.

    ``drain_timeout``: the engine's grace for running requests when it is stopped by a signal
    or by our death (``--drain-timeout``). ``shutdown_timeout``: how long to wait for the
    process to exit after ``Shutdown`` before killing it."""
    proc = EngineProcess.start(config, address=address, token=token, drain_timeout=drain_timeout)
    try:
        bound = await proc.wait_ready_async(startup_timeout)
        connected = False
        try:
            async with client_cls.connect(bound, token=token, client_name=client_name) as client:
                connected = True
                client.process = proc
                try:
                    yield client
                finally:
                    if not client.closed and proc.poll() is None:
                        with anyio.move_on_after(shutdown_timeout, shield=True):
                            try:
                                await client.shutdown()
                            except (EngineError, InvalidTransitionError):  # already stopping / dead
                                pass
        except OSError as exc:
            if not connected and proc.poll() is not None:  # it died between READY and connect
                raise proc._startup_failed(proc.poll()) from exc
            raise
    finally:
        with anyio.CancelScope(shield=True):
            await proc.stop_async(shutdown_timeout)


__all__ = ["EngineProcess", "EngineStartupError", "spawn_engine"]

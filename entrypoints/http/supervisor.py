"""The engine process's side of the HTTP frontends: the shared listening socket (bound before the
model loads), how many frontend processes to start (``--api-servers``), and :class:`Frontends`,
the ``on_serving`` hook of :func:`entrypoints.serve.run` that starts them once the engine serves
and supervises them (the frontend process itself: ``frontend.py``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

import anyio

from .frontend import EXIT_ENGINE_DIED, EXIT_OK, TOKEN_ENV
from .limits import HttpLimits

log = logging.getLogger("enginecore.http")


#: The most API server processes the default starts.
MAX_DEFAULT_API_SERVERS = 4


def default_api_servers(device_type: str, cpus: int) -> int:
    """``--api-servers`` when not given: on an accelerator, one API server per 4 CPUs this
    process may use, 1 to :data:`MAX_DEFAULT_API_SERVERS` -- one process's event loop streams
    a few ten thousand tokens a second, less than one GPU makes under a burst of 256 streams
    (``bench.serve``; the issue's H100 figures: 0.71 of in-process throughput with 1, 0.94 with
    4). On the CPU, 1: the engine's own threads use the CPUs, and a second API server only
    takes from them (measured on 2 cores: no faster)."""
    if device_type == "cpu":
        return 1
    return max(1, min(MAX_DEFAULT_API_SERVERS, cpus // 4))


def parse_http_address(spec: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``; an empty host is 0.0.0.0) -> (host, port)."""
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or not (0 <= int(port) <= 65535):
        raise ValueError(f"--http {spec!r}: expected HOST:PORT")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def is_loopback_http(spec: str) -> bool:
    """Whether ``--http HOST:PORT`` listens where only this machine can connect."""
    import ipaddress

    host = parse_http_address(spec)[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind_http(spec: str, backlog: int = 2048) -> socket.socket:
    """The shared listening socket (``OSError`` e.g. when the address is in use)."""
    host, port = parse_http_address(spec)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def _frontend_env(token: Optional[str], metrics_dir: Optional[str] = None) -> dict:
    from .metrics import MULTIPROC_ENV

    env = dict(os.environ)
    if metrics_dir:
        env[MULTIPROC_ENV] = metrics_dir
    root = str(Path(__file__).resolve().parents[2])  # this checkout's code, like ipc.spawn
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    if token:
        env[TOKEN_ENV] = token
    else:
        env.pop(TOKEN_ENV, None)
    return env


class Frontends:
    """The ``on_serving`` hook: start ``n`` frontend processes on ``sock`` once the engine
    serves, and keep the engine process (its IPC server's task group) alive until they exited.

    A frontend that exits while the engine serves is a failure: the engine process is stopped
    (SIGTERM to itself: it drains) and ``failed`` is set (the process then exits non-zero).
    Frontends still running :data:`STRAGGLER_TIMEOUT` seconds after the engine is over (and the
    drain allowance) are killed.

    Metrics: the frontends share a private ``PROMETHEUS_MULTIPROC_DIR`` created here before they
    start (its counters outlive a frontend, so totals never go back); a frontend that exits is
    marked dead there (its live gauges drop out); :meth:`close` removes the directory.

    ``args``: more command-line arguments for every frontend (log settings, served names);
    ``describe(engine)``: more, computed from the serving engine (the cache_config_info)."""

    STRAGGLER_TIMEOUT = 30.0

    def __init__(self, sock: socket.socket, n: int, token: Optional[str],
                 drain_timeout: float = 30.0, limits: HttpLimits = HttpLimits(),
                 args: Sequence[str] = (), describe=None) -> None:
        self.sock = sock
        self.limits = limits
        self.n = n
        self.token = token
        self.drain_timeout = drain_timeout
        self.args = list(args)
        self.describe = describe
        self.metrics_dir: Optional[str] = None
        self.procs: list = []
        self.codes: dict[int, int] = {}
        self.failed = False
        self._stopping = False

    @property
    def address(self) -> tuple:
        return self.sock.getsockname()

    async def __call__(self, bound: str, tg, engine=None) -> None:
        fd = self.sock.fileno()
        host, port = self.address[:2]
        self.metrics_dir = tempfile.mkdtemp(prefix="enginecore-metrics-")
        env = _frontend_env(self.token, self.metrics_dir)
        extra = [*self.args, *(self.describe(engine) if self.describe and engine else ())]
        try:
            for i in range(self.n):
                argv = [sys.executable, "-m", "entrypoints.http.frontend", "--connect", bound,
                        "--fd", str(fd), "--parent-pid", str(os.getpid()), "--index", str(i),
                        *self.limits.to_argv(), *extra]
                self.procs.append(await anyio.open_process(
                    argv, stdin=subprocess.DEVNULL, stdout=None, stderr=None, pass_fds=(fd,),
                    env=env))
        except OSError as exc:
            log.error("cannot start the HTTP frontends: %s", exc)
            self._fail()
        finally:
            self.sock.close()  # the frontends hold it now
        if self.procs:
            log.info("HTTP on http://%s:%d (%d API server process%s; metrics in %s)", host, port,
                     len(self.procs), "" if len(self.procs) == 1 else "es", self.metrics_dir)
            tg.start_soon(self._supervise)

    def _fail(self) -> None:
        self.failed = True
        if not self._stopping:
            self._stopping = True
            os.kill(os.getpid(), signal.SIGTERM)  # the engine process drains (serve._Stopper)

    async def _supervise(self) -> None:
        over = anyio.Event()

        async def wait_one(i: int, proc) -> None:
            code = await proc.wait()
            self.codes[i] = code
            self._mark_dead(proc.pid)
            if code == EXIT_OK or (code == EXIT_ENGINE_DIED and not self._stopping):
                log.info("HTTP frontend %d (pid %d) exited with %d", i, proc.pid, code)
            else:
                log.error("HTTP frontend %d (pid %d) exited with %d", i, proc.pid, code)
            if code not in (EXIT_OK, EXIT_ENGINE_DIED):
                self._fail()  # it crashed or could not start: stop serving
            over.set()

        async with anyio.create_task_group() as tg:
            for i, proc in enumerate(self.procs):
                tg.start_soon(wait_one, i, proc)
            await over.wait()
            # One has exited: the engine is over (or is being stopped because of it).
            with anyio.move_on_after(self.drain_timeout + self.STRAGGLER_TIMEOUT):
                while len(self.codes) < len(self.procs):
                    await anyio.sleep(0.05)
            for i, proc in enumerate(self.procs):
                if proc.returncode is None:
                    log.error("HTTP frontend %d (pid %d) did not exit; killing it", i, proc.pid)
                    self.failed = True
                    proc.kill()
                    await proc.wait()
                    self._mark_dead(proc.pid)

    def _mark_dead(self, pid: int) -> None:
        if self.metrics_dir:
            from prometheus_client.multiprocess import mark_process_dead

            mark_process_dead(pid, self.metrics_dir)

    def close(self) -> None:
        """Remove the metrics directory (after the frontends exited)."""
        if self.metrics_dir:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = None



__all__ = ["Frontends", "bind_http", "default_api_servers", "is_loopback_http",
           "parse_http_address"]

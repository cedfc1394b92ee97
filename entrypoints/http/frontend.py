"""HTTP frontend processes: ``python -m entrypoints.http.frontend`` and their supervisor.

``enginecore serve --http HOST:PORT --api-servers N`` binds the HTTP socket once in the engine
process (``SO_REUSEADDR``; before loading, so "address in use" is a startup error), and once the
engine is SERVING starts N frontend processes (:class:`Frontends`, the ``on_serving`` hook of
:func:`entrypoints.serve.run`). Each inherits the listening socket (``pass_fds``) -- the kernel spreads
connections over them -- connects to the engine's private IPC socket as an ``ipc.EngineClient``
and serves the OpenAI-compatible app (:mod:`entrypoints.http.app`) with uvicorn on that socket
(hardened: :mod:`entrypoints.http.server`), under the HTTP limits given on the engine's command
line (:mod:`entrypoints.http.limits`; the supervisor passes them on as the same flags).

The engine process owns the lifecycle; a frontend follows it:

* It ignores SIGINT and SIGTERM. A SIGTERM to the whole process group (Kubernetes, Ctrl-C) makes
  the engine drain; the frontends keep serving meanwhile: ``/ready`` is 503 at once, new requests
  get 503 with ``Retry-After``, open streams run to their end.
* Engine SHUTDOWN after a clean drain: the frontend finishes writing the open responses, closes
  and exits 0.
* The engine died (its connection broke, it FAILED, or the parent process is gone): ``/health``
  turns 503 for :data:`DEAD_GRACE` seconds, then the frontend exits 3.

Exit codes: 0 the engine shut down cleanly; 3 the engine died; 2 startup error (no engine to
connect to); 1 a bug (an uncaught exception). The engine process waits for its frontends before
it exits; one that exits while the engine serves makes the engine process stop (it drains) and
exit non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from pathlib import Path
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Any, Optional, Sequence

import anyio

from engine import envs
from states import State

from ..logs import add_log_args, configure
from .limits import HttpLimits, add_http_limit_args, limits_from_args

if TYPE_CHECKING:  # the engine process imports this module without uvicorn and FastAPI
    from .server import Server

log = logging.getLogger("enginecore.http")

#: How long a frontend answers 503 after the engine died, before it exits 1.
DEAD_GRACE = 1.0
TOKEN_ENV = envs.TOKEN
EXIT_OK, EXIT_CRASH, EXIT_STARTUP, EXIT_ENGINE_DIED = 0, 1, 2, 3


async def watch_engine(fe, server: Server, *, parent_pid: Optional[int] = None,
                       dead_grace: float = DEAD_GRACE) -> int:
    """Follow the engine of ``fe`` (an :class:`~entrypoints.http.context.Frontend`); once it has
    stopped (shut down, died, or the connection to it ended) or ``parent_pid`` is no longer our
    parent, make ``server`` exit. Returns the frontend's exit code (0 or 3)."""
    engine = fe.engine
    reason = None
    async with anyio.create_task_group() as tg:
        async def watch_parent() -> None:
            nonlocal reason
            while os.getppid() == parent_pid:
                await anyio.sleep(0.1)
            reason = f"the engine process {parent_pid} exited"
            tg.cancel_scope.cancel()

        if parent_pid is not None:
            tg.start_soon(watch_parent)
        await engine.wait_stopped()
        tg.cancel_scope.cancel()
    if reason is None:
        if fe.failed or engine.state is State.FAILED:
            reason = "the engine failed"
        elif engine.state is not State.SHUTDOWN:
            reason = "lost the engine"
        else:
            log.info("frontend %d: the engine shut down; exiting", os.getpid())
            server.should_exit = True
            return EXIT_OK
    log.error("frontend %d: %s; /health is 503, exiting in %.1fs", os.getpid(), reason, dead_grace)
    fe.dead = reason
    await anyio.sleep(dead_grace)
    server.should_exit = True
    return EXIT_ENGINE_DIED


async def serve_frontend(engine, sock: socket.socket, *, limits: HttpLimits = HttpLimits(),
                         parent_pid: Optional[int] = None, dead_grace: float = DEAD_GRACE,
                         model_names: Optional[list[str]] = None,
                         cache_info: Optional[dict] = None, sleep_mode: bool = False,
                         admin_token: Optional[str] = None, **server_options: Any) -> int:
    """Serve ``engine`` (an ``engine.interface.Engine``) over HTTP on ``sock`` until the engine
    has shut down (returns 0) or died (returns 3). ``model_names``: the names it is served
    under; ``cache_info``: the labels of ``enginecore_cache_config_info``; ``sleep_mode``: the
    admin endpoints too (``admin_token``: required on them)."""
    from .app import create_app
    from .server import make_server

    app = create_app(engine, limits=limits, model_name=model_names, cache_info=cache_info,
                     sleep_mode=sleep_mode, admin_token=admin_token)
    server = make_server(app, limits, **server_options)
    code = EXIT_OK
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            nonlocal code
            code = await watch_engine(app.state.frontend, server, parent_pid=parent_pid,
                                      dead_grace=dead_grace)

        tg.start_soon(watch)
        await server.serve(sockets=[sock])
        tg.cancel_scope.cancel()
    if not server.started:
        return EXIT_STARTUP
    return code


#: How often a frontend process gives its freed heap back (entrypoints.malloc.trim_every).
TRIM_EVERY_S = 10.0
#: The collector's youngest generation threshold while a frontend serves (the engine's default).
GC_YOUNG_THRESHOLD = 2_000


async def _main(a: argparse.Namespace) -> int:
    from engine.errors import EngineError
    from ipc.client import EngineClient

    sock = socket.socket(fileno=a.fd)
    sock.setblocking(False)
    token = os.environ.pop(TOKEN_ENV, None) or None
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(sock.close)
        try:
            client = await stack.enter_async_context(EngineClient.connect(
                a.connect, token=token, client_name=f"http-frontend-{a.index}"))
        except (OSError, TimeoutError, EngineError) as exc:
            print(f"enginecore frontend {a.index}: cannot connect to {a.connect}: {exc}",
                  file=sys.stderr)
            return EXIT_ENGINE_DIED if await _orphaned(a.parent_pid) else EXIT_STARTUP
        import msgspec

        cache_info = msgspec.json.decode(a.cache_info, type=dict[str, str]) if a.cache_info else None
        from ..malloc import trim_every

        from engine.runner import gc_freeze

        # What a frontend allocates per token and per request is freed by reference counting;
        # the collector walking the startup heap (FastAPI, pydantic, the schemas) and collecting
        # the young generation every 700 allocations cost ~10 % of its CPU under a burst of
        # 256 streams (bench.serve). The engine's own settings, for the same reasons
        # (engine/runner/gc_freeze.py).
        gc_freeze.hold(GC_YOUNG_THRESHOLD)
        async with anyio.create_task_group() as tg:
            tg.start_soon(trim_every, TRIM_EVERY_S)
            code = await serve_frontend(client, sock, limits=a.limits, parent_pid=a.parent_pid,
                                        model_names=a.served_model_name, cache_info=cache_info,
                                        sleep_mode=a.enable_sleep_mode,
                                        admin_token=token if a.admin_auth else None)
            tg.cancel_scope.cancel()
        return code


async def _orphaned(parent_pid: Optional[int], within: float = 1.0) -> bool:
    """Whether the engine process (our parent) is gone: a handshake it broke off by dying is
    "the engine died" (3), not a startup failure (2). A killed process closes its sockets a
    moment before its children are re-parented, hence the short wait."""
    if parent_pid is None:
        return False
    with anyio.move_on_after(within):
        while os.getppid() == parent_pid:
            await anyio.sleep(0.02)
    return os.getppid() != parent_pid


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m entrypoints.http.frontend",
                                 description="One OpenAI-compatible HTTP frontend of an engine "
                                             "process (started by `enginecore serve --http`).")
    ap.add_argument("--connect", required=True, help="the engine's IPC address")
    ap.add_argument("--fd", type=int, required=True, help="an inherited listening socket")
    ap.add_argument("--parent-pid", type=int, default=None,
                    help="exit (3) when this process is no longer our parent")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME")
    ap.add_argument("--cache-info", default=None, help="cache_config_info labels (JSON object)")
    ap.add_argument("--enable-sleep-mode", action="store_true", help="the admin endpoints too")
    ap.add_argument("--admin-auth", action="store_true",
                    help=f"the admin endpoints need the token (from ${TOKEN_ENV})")
    add_log_args(ap)
    add_http_limit_args(ap)
    a = ap.parse_args(argv)
    if a.admin_auth and not os.environ.get(TOKEN_ENV):
        ap.error(f"--admin-auth needs the token in ${TOKEN_ENV}")
    try:
        a.limits = limits_from_args(a)
    except ValueError as exc:
        ap.error(str(exc))
    from ..malloc import one_arena

    one_arena()  # before any worker thread exists: this process's entry point
    # The engine process drives the lifecycle (see the module docstring).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure(a.log_level, a.log_format)
    from .server import raise_fd_limit

    raise_fd_limit()  # process-wide: the entry point's to set (the connection cap follows it)
    if a.parent_pid is not None and os.getppid() != a.parent_pid:
        return EXIT_ENGINE_DIED
    return anyio.run(_main, a)


# --------------------------------------------------------------------------- the engine's side

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


if __name__ == "__main__":
    sys.exit(main())

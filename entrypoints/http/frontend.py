"""The HTTP frontend process: ``python -m entrypoints.http.frontend`` (its supervisor in the
engine process: ``supervisor.py``).

``enginecore serve --http HOST:PORT --api-servers N`` binds the HTTP socket once in the engine
process (``SO_REUSEADDR``; before loading, so "address in use" is a startup error), and once the
engine is SERVING starts N frontend processes (``supervisor.Frontends``, the ``on_serving`` hook of
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
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any, Optional

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


def _bound_host(sock: socket.socket) -> Optional[str]:
    """The address ``sock`` listens on (None for a Unix socket)."""
    name = sock.getsockname()
    return name[0] if isinstance(name, tuple) else None


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
                     sleep_mode=sleep_mode, admin_token=admin_token, bound=_bound_host(sock))
    server = make_server(app, limits, **server_options)
    await app.state.frontend.prefetch()  # (connections wait in the socket's backlog meanwhile)
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
    from .server import event_loop_factory, raise_fd_limit

    raise_fd_limit()  # process-wide: the entry point's to set (the connection cap follows it)
    if a.parent_pid is not None and os.getppid() != a.parent_pid:
        return EXIT_ENGINE_DIED
    # The event loop too is the entry point's to choose: uvloop under httptools, when installed.
    factory = event_loop_factory(a.limits)
    logging.getLogger("enginecore.http").info("event loop: %s", "uvloop" if factory else "asyncio")
    return anyio.run(_main, a, backend_options={"loop_factory": factory} if factory else None)


if __name__ == "__main__":
    sys.exit(main())

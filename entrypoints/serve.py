"""``enginecore serve``: the engine process's entry point — with ``cli.main``, the only code that
touches signals (``cli.main`` catches them from its first line, ``startup_signals``; ``run``
takes over once its event loop runs, and exits 128+N for one that came before).

Exit codes (also in docs/serving.md):
  0    clean shutdown: drained (or aborted at the drain deadline / second signal), released
  1    the engine failed (an exception in a step, a lost device); clients got EngineDeadError
  2    startup error (bad model path, bad config, bad/in-use listen address -- checked before
       the model loads)
  128+N  signal N arrived during startup: loading stopped, what was allocated was released

With ``--http HOST:PORT [--api-servers N]`` the HTTP socket is bound before loading (2 if that
fails), N frontend processes (entrypoints/http/frontend.py) start once the engine serves, and this
process exits after them; a frontend that fails while the engine serves stops the engine
(drain) and makes the exit code 1.
"""

from __future__ import annotations

from functools import partial
import logging
import os
import signal
import sys
import tempfile
import time
from typing import Optional

import anyio
import msgspec

from engine import envs
from engine.errors import EngineError
from engine.loader.hf_hub import display_name
from engine.serving.async_engine import AsyncEngine
from states import State

from . import startup_signals
from .args import config_from_args, token_from_args
from .logs import log_argv

log = logging.getLogger("enginecore.serve")

EXIT_OK, EXIT_FAILED, EXIT_STARTUP = 0, 1, 2


def default_address() -> str:
    return f"unix://{tempfile.gettempdir()}/enginecore-{os.getpid()}.sock"


class _Stopper:
    """What a signal (or the parent's death) does, by lifecycle state."""

    def __init__(self, engine: AsyncEngine, tg, drain_timeout: float):
        self.engine = engine
        self.tg = tg
        self.drain_timeout = drain_timeout
        self.startup = anyio.CancelScope()
        self.signal_in_startup: Optional[int] = None
        self.count = 0

    def stop(self, signum: int, why: str) -> None:
        self.count += 1
        state = self.engine.state
        log.info("%s in state %s", why, state.value, extra={"state": state.value})
        if state in (State.INIT, State.LOADED):
            self.signal_in_startup = signum
            self.startup.cancel()
        elif state in (State.SERVING, State.PAUSED, State.SLEEPING):  # asleep: release, exit 0
            self.tg.start_soon(self._drain, self.drain_timeout if self.count == 1 else 0.0)
        elif state is State.DRAINING:
            self.tg.start_soon(self._drain, 0.0)  # second signal: abort the rest now
        # SHUTDOWN / FAILED: the release is under way; never cut it short.

    async def _drain(self, timeout: float) -> None:
        try:
            await self.engine.drain(timeout, reason="shutdown")
        except EngineError as exc:
            log.info("drain ended: %s", exc)


async def _watch_signals(stopper: _Stopper) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        stopper.ready.set()
        async for signum in signals:
            stopper.stop(signum, f"signal {signal.Signals(signum).name}")


async def _watch_parent(stopper: _Stopper, parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        await anyio.sleep(0.25)
    stopper.stop(signal.SIGTERM, f"parent {parent_pid} died")
    await anyio.sleep(0.5)
    stopper.stop(signal.SIGTERM, "parent still gone")  # a second stop: no drain grace


async def run(config, *, listen: Optional[str], token: Optional[str], drain_timeout: float,
              parent_pid: Optional[int] = None, ready_fd: Optional[int] = None,
              on_serving=None, max_connections: int = 256,
              stats_interval: Optional[float] = None) -> int:
    from ipc.transport import ListenError, close_listener, preflight_listen

    t0 = time.monotonic()
    engine = AsyncEngine(config)
    address = listen or default_address()
    async with anyio.create_task_group() as tg:
        stopper = _Stopper(engine, tg, drain_timeout)
        stopper.ready = anyio.Event()
        tg.start_soon(_watch_signals, stopper)
        await stopper.ready.wait()  # handlers are in place before loading starts
        early = startup_signals.pending()  # one recorded before these handlers (cli.main)
        if early is not None:
            log.info("signal %s before the event loop", signal.Signals(early).name)
            print(f"enginecore: stopped by signal {early} during startup", file=sys.stderr)
            tg.cancel_scope.cancel()
            return 128 + early
        if parent_pid:
            tg.start_soon(_watch_parent, stopper, parent_pid)
        try:  # the address is checked and bound before the (slow) model load
            listener = await preflight_listen(address, token)
        except ListenError as exc:
            print(f"enginecore: cannot listen on {address}: {exc}", file=sys.stderr)
            tg.cancel_scope.cancel()
            return EXIT_STARTUP
        log.info("loading %s (pid %d)", config.model, os.getpid())
        try:
            with stopper.startup:
                await engine.start(tg)
        except EngineError as exc:
            print(f"enginecore: startup failed: {exc}", file=sys.stderr)
            with anyio.CancelScope(shield=True):
                await close_listener(listener, address)
            tg.cancel_scope.cancel()
            return EXIT_STARTUP
        if stopper.signal_in_startup is not None:
            print(f"enginecore: stopped by signal {stopper.signal_in_startup} during startup",
                  file=sys.stderr)
            with anyio.CancelScope(shield=True):
                await close_listener(listener, address)
            tg.cancel_scope.cancel()
            return 128 + stopper.signal_in_startup
        from ipc.server import serve_ipc

        try:
            async with anyio.create_task_group() as server:
                bound = await server.start(partial(serve_ipc, listener=listener,
                                                   max_connections=max_connections),
                                           engine, address, token)
                log.info("serving %s on %s (%.1f s to serving)", config.model, bound,
                         time.monotonic() - t0, extra={"seconds_to_serving": time.monotonic() - t0})
                if stats_interval:
                    from .stats_log import log_stats

                    tg.start_soon(log_stats, engine, stats_interval)
                if ready_fd is not None:
                    os.write(ready_fd, f"READY {bound}\n".encode())
                    os.close(ready_fd)
                if on_serving is not None:
                    await on_serving(bound, server, engine)
                # serve_ipc returns by itself once the engine stopped, after flushing every
                # terminal output, closing connections and removing the socket.
        except (OSError, ValueError, ExceptionGroup) as exc:
            if isinstance(exc, ExceptionGroup):  # a task group wraps the listener's error
                _, rest = exc.split((OSError, ValueError))
                if rest is not None:
                    raise
            print(f"enginecore: cannot listen on {address}: {exc}", file=sys.stderr)
            with anyio.CancelScope(shield=True):
                await engine.shutdown()
            tg.cancel_scope.cancel()
            return EXIT_STARTUP
        await engine.wait_stopped()
        tg.cancel_scope.cancel()
    return EXIT_FAILED if engine.failure is not None else EXIT_OK


def serve_main(a) -> int:
    try:
        config = config_from_args(a)
        config.validate()
        a.token = token_from_args(a)  # --token-file, the token variable or --token
        if a.max_ipc_connections < 1:
            raise ValueError("--max-ipc-connections must be >= 1")
    except (EngineError, ValueError, OSError) as exc:
        print(f"enginecore: bad configuration: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    os.environ.pop(envs.TOKEN, None)  # read; children get it only when meant to
    if config.node_rank > 0:  # multi-host TP: this host only runs its ranks (entrypoints/tp_node.py)
        from entrypoints.tp_node import run_node

        if startup_signals.pending() is not None:  # recorded since cli.main; no ranks started yet
            return 128 + startup_signals.pending()

        return run_node(config)
    if not getattr(a, "http", None):
        code = anyio.run(lambda: run(config, listen=a.listen, token=a.token,
                                     drain_timeout=a.drain_timeout, parent_pid=a.parent_pid,
                                     ready_fd=a.ready_fd, max_connections=a.max_ipc_connections,
                                     stats_interval=_stats_interval(a)))
        log.info("event loop closed; exiting %d", code)
        return code
    return _serve_http(a, config)


def _cache_info_argv(engine) -> list[str]:
    from .http.metrics import cache_info

    return ["--cache-info", msgspec.json.encode(cache_info(engine)).decode()]


def _sleep_argv(token: Optional[str]) -> list[str]:
    """The frontends' flags for the admin endpoints; a server token (--token) guards them."""
    return ["--enable-sleep-mode", *(("--admin-auth",) if token else ())]


def _stats_interval(a) -> Optional[float]:
    if getattr(a, "disable_log_stats", False):
        return None
    return max(0.1, float(getattr(a, "log_stats_interval", 10.0)))


def _serve_http(a, config) -> int:
    """``--http HOST:PORT [--api-servers N]``: the engine (IPC on a private socket unless
    ``--listen``) plus N HTTP frontend processes sharing one listening socket, bound here before
    loading. They start once the engine serves and exit after it (entrypoints/http/frontend.py); this
    process exits after them."""
    import secrets

    from .http.supervisor import Frontends, bind_http, default_api_servers, is_loopback_http
    from .http.limits import limits_from_args

    if a.api_servers is None:
        from engine.serving.cpu_threads import cpu_budget

        cpus, why = cpu_budget()
        a.api_servers = default_api_servers(config.resolved_device().type, cpus)
        log.info("%d API server process%s (%s; --api-servers to choose)", a.api_servers,
                 "" if a.api_servers == 1 else "es", why)
    if a.api_servers < 1:
        print("enginecore: bad configuration: --api-servers must be >= 1", file=sys.stderr)
        return EXIT_STARTUP
    sleep_mode = bool(getattr(a, "enable_sleep_mode", False))
    try:
        open_admin = sleep_mode and not a.token and not is_loopback_http(a.http)
    except ValueError:
        open_admin = False  # a bad --http: bind_http says so below
    if open_admin:
        print("enginecore: bad configuration: --enable-sleep-mode on a non-loopback --http "
              f"address needs a token (--token-file or ${envs.TOKEN}): the admin endpoints "
              "require it", file=sys.stderr)
        return EXIT_STARTUP
    try:
        limits = limits_from_args(a)
    except ValueError as exc:
        print(f"enginecore: bad configuration: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    try:
        sock = bind_http(a.http)
    except (OSError, ValueError) as exc:
        print(f"enginecore: cannot listen on {a.http}: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    token = a.token or secrets.token_urlsafe(24)  # the IPC socket is private to the frontends
    names = a.served_model_name or [display_name(config.model)]
    frontends = Frontends(sock, a.api_servers, token, drain_timeout=a.drain_timeout,
                          limits=limits, describe=_cache_info_argv,
                          args=[*log_argv(a.log_level, a.log_format), "--served-model-name", *names,
                                *(_sleep_argv(a.token) if sleep_mode else ())])
    try:
        code = anyio.run(lambda: run(config, listen=a.listen, token=token,
                                     drain_timeout=a.drain_timeout, parent_pid=a.parent_pid,
                                     ready_fd=a.ready_fd, on_serving=frontends,
                                     max_connections=a.max_ipc_connections,
                                     stats_interval=_stats_interval(a)))
    finally:
        sock.close()  # if the engine never got to serving
        frontends.close()  # the metrics directory
    if code == EXIT_OK and frontends.failed:
        return EXIT_FAILED
    return code

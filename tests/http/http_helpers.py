"""Helpers of the HTTP frontend tests: an in-process server (AsyncEngine + uvicorn on a loopback
port, one task) and ``enginecore serve --http`` processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

import anyio
import httpx
import openai

from engine import AsyncEngine, EngineConfig
from entrypoints.http.app import create_app
from entrypoints.http.frontend import watch_engine
from entrypoints.http.limits import HttpLimits
from entrypoints.http.server import make_server

ROOT = Path(__file__).resolve().parents[2]
TINY = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=512,
                    max_num_seqs=64, max_num_batched_tokens=512)


def listening_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    return sock


class Served:
    def __init__(self, engine, app, base_url: str, server=None) -> None:
        self.engine = engine
        self.app = app
        self.base_url = base_url
        self.port = int(base_url.rsplit(":", 1)[1])
        self.server = server
        self.frontend = app.state.frontend

    def openai(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused",
                                  max_retries=0, **kw)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=60)


@asynccontextmanager
async def served(config: EngineConfig = TINY, engine=None, *, limits: HttpLimits = HttpLimits(),
                 via: str = "engine", **app_options) -> AsyncIterator[Served]:
    """An engine (opened here unless given) and the app on uvicorn, on 127.0.0.1:<free port>.
    ``via="client"``: the app serves an ``ipc.EngineClient`` connected to the engine over an
    in-process IPC server (as a frontend process does), not the engine itself.
    ``app_options``: more of ``create_app``'s (``sleep_mode``, ``admin_token``). On exit the engine is drained (if still serving) and the server has stopped."""
    async with AsyncEngine.open(config) if engine is None else _given(engine) as eng:
        async with _engine_for_app(eng, via) as served_engine:
            sock = listening_socket()
            app = create_app(served_engine, limits=limits, **app_options)
            server = make_server(app, limits, timeout_graceful_shutdown=5)
            port = sock.getsockname()[1]
            stopped = anyio.Event()
            async with anyio.create_task_group() as tg:
                async def run_server() -> None:
                    try:
                        await server.serve([sock])
                    finally:
                        stopped.set()

                tg.start_soon(watch_engine, app.state.frontend, server)
                tg.start_soon(run_server)
                while not server.started:
                    await anyio.sleep(0.01)
                try:
                    yield Served(eng, app, f"http://127.0.0.1:{port}", server)
                finally:
                    server.should_exit = True
                    with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                        await stopped.wait()
                    tg.cancel_scope.cancel()
            sock.close()


@asynccontextmanager
async def _engine_for_app(eng, via: str):
    if via == "engine":
        yield eng
        return
    assert via == "client", via
    from ipc.client import EngineClient
    from ipc.server import serve_ipc

    with tempfile.TemporaryDirectory(prefix="ec-http-ipc-") as tmp:
        async with anyio.create_task_group() as tg:
            address = await tg.start(serve_ipc, eng, f"unix://{tmp}/engine.sock")
            async with EngineClient.connect(address, client_name="http-test") as client:
                yield client
            tg.cancel_scope.cancel()


@asynccontextmanager
async def _given(engine):
    yield engine


# --------------------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            out.append(int(d))
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServeProcess:
    """``enginecore serve --http 127.0.0.1:<port> ...`` (torch on one thread: the test box has
    two cores and runs the frontends too). ``--parent-pid``: it drains if the test dies."""

    def __init__(self, model: str = "random:tiny-llama", api_servers: int = 1,
                 drain_timeout: float = 60.0, extra: tuple = (), capture_stderr: bool = False) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.tmpdir = tempfile.mkdtemp(prefix="ec-http-")  # the IPC socket: gone even after SIGKILL
        env = dict(os.environ, OMP_NUM_THREADS="1")
        argv = [sys.executable, "-m", "entrypoints.cli", "serve", "--model", model, "--device", "cpu",
                "--listen", f"unix://{self.tmpdir}/engine.sock",
                "--http", f"127.0.0.1:{self.port}", "--api-servers", str(api_servers),
                "--drain-timeout", str(drain_timeout), "--parent-pid", str(os.getpid()),
                "--kv-cache-bytes", str(64 * 2**20), *extra]
        # its own process group, like a container's: signal_group() is Kubernetes' SIGTERM
        #: with ``capture_stderr``: the engine's and its frontends' stderr (their logs)
        self.log_path = Path(self.tmpdir) / "stderr.log" if capture_stderr else None
        err = open(self.log_path, "wb") if self.log_path else None
        try:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                         stderr=err, start_new_session=True)
        finally:
            if err is not None:
                err.close()
        self.pid = self.proc.pid
        self.frontends: list[int] = []

    async def wait_ready(self, n_frontends: int, timeout: float = 90.0) -> None:
        """Until /ready answers 200 and all frontends run."""
        with anyio.fail_after(timeout):
            async with httpx.AsyncClient(base_url=self.base_url, timeout=5) as c:
                while True:
                    assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}"
                    try:
                        if (await c.get("/ready")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await anyio.sleep(0.1)
            while len(self.frontends) < n_frontends:
                self.frontends = children(self.pid)
                await anyio.sleep(0.05)
        assert len(self.frontends) == n_frontends, self.frontends

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0,
                                  timeout=120)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=30)

    async def wait(self, timeout: float) -> int:
        with anyio.fail_after(timeout):
            while self.proc.poll() is None:
                await anyio.sleep(0.05)
        return self.proc.returncode

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        """``sig`` to the engine and its frontends at once."""
        os.killpg(self.pid, sig)

    def cleanup(self) -> None:
        """Whatever happened: nothing of ours keeps running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.frontends:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]

"""The driver's side of tensor parallelism (rank 0, in the engine process).

``start`` launches the local workers as plain subprocesses (``python -m entrypoints.tp_worker``;
ranks of other hosts are started there by ``enginecore serve --node-rank R``), accepts one
control connection per rank, hands each the rendezvous and the EngineConfig, and joins the
process group. ``agree_blocks`` / ``wait_ready`` make LOADED mean "every rank loaded".

While serving, one thread per worker reads its connection: a closed connection or a ``Failed``
frame is a dead rank, reported through ``on_failure`` at once (the engine fails its streams
without waiting for a collective to time out). ``close`` is the one teardown: ``Shutdown`` to
every rank, their release reports collected, the process group destroyed, every process
waited for -- killed after :data:`EXIT_GRACE_S`.
"""

from __future__ import annotations

from datetime import timedelta
import logging
import os
from pathlib import Path
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import msgspec
import torch
import torch.distributed as dist

from engine import envs

from ..errors import EngineError
from .channel import (_HEADER, Blocks, Channel, Closed, Failed, Hello, Init, Loaded, Ready,
                      Released, Shutdown, Step, _encoder)
from .control import DriverCalls, RankFailed

log = logging.getLogger("enginecore.tp")

TOKEN_ENV = envs.TP_TOKEN
CONNECT_TIMEOUT_S = 120.0  # for every rank to connect (torch's import is seconds)
EXIT_GRACE_S = 10.0  # for a worker to release and exit after Shutdown, then SIGKILL
FAIL_GRACE_S = 2.0  # after a failure: for the other ranks to report theirs, then SIGKILL


class TPStartupError(EngineError):
    """A rank could not start or load (a startup error: ``enginecore serve`` exits 2)."""


def backend_for(device: torch.device, ranks_per_node: int = 1) -> str:
    """NCCL when every rank of a host has a GPU of its own; gloo on CPU, and when the ranks
    share GPUs (NCCL refuses two ranks on one device): then the collectives stage through host
    memory (engine/tp/layers.py) -- for tests on one GPU, not for speed."""
    if device.type != "cuda":
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= ranks_per_node else "gloo"


class DriverGroup(DriverCalls):
    rank = 0

    def __init__(self, config):
        self.config = config
        self.world = config.tensor_parallel_size
        self.on_failure: Optional[Callable[[BaseException], None]] = None
        self.reports: dict[int, Released] = {}
        self._procs: dict[int, subprocess.Popen] = {}
        self._chans: dict[int, Channel] = {}
        self._inbox: "queue.Queue[tuple[int, object]]" = queue.Queue()
        self._serving = False
        self._closing = False
        self._pg = False
        self._failed = False  # a rank failed: shorter grace at close

    # -- startup -------------------------------------------------------------------------------
    def start(self, should_stop) -> None:
        """Start the local workers, accept every rank, join the process group; any failure is
        a TPStartupError (a startup error), and what was started is stopped by ``close``."""
        try:
            self._start(should_stop)
        except TPStartupError:
            self._failed = True
            raise
        except Exception as exc:  # a port in use, a rendezvous that timed out, ...
            self._failed = True
            raise TPStartupError(f"tensor-parallel startup failed: {type(exc).__name__}: {exc}") from exc

    def _start(self, should_stop) -> None:
        cfg = self.config
        per_node = self.world // cfg.nnodes
        token = os.environ.get(TOKEN_ENV)
        if not token and cfg.nnodes > 1:
            raise TPStartupError(f"multi-host tensor parallel needs ${TOKEN_ENV} (the same "
                                 "secret on every host)")
        token = token or secrets.token_hex(16)
        host = cfg.master_addr
        listener = socket.create_server((host, cfg.master_port), backlog=self.world)
        try:
            port = listener.getsockname()[1]
            env = {**os.environ, TOKEN_ENV: token, "PYTHONPATH": _pythonpath()}
            for r in range(1, per_node):
                self._procs[r] = subprocess.Popen(
                    [sys.executable, "-m", "entrypoints.tp_worker", "--connect", f"{host}:{port}",
                     "--rank", str(r), "--local-rank", str(r), "--parent-pid", str(os.getpid())],
                    env=env, stdin=subprocess.DEVNULL)
            log.info("tensor parallel: %d ranks (%d local workers started, %d from other "
                     "hosts expected) on %s:%d", self.world, per_node - 1,
                     self.world - per_node, host, port)
            self._accept(listener, token, should_stop)
        finally:
            listener.close()
        store_port = self._rendezvous_port(host)
        backend = backend_for(cfg.resolved_device(), per_node)
        # a collective that waits longer than this raises on every rank (no hanging collective)
        timeout_s = envs.tp_timeout_s()
        init = Init(self.world, host, store_port, backend, timeout_s, msgspec.json.encode(cfg))
        for ch in self._chans.values():
            ch.send(init)
        for r, ch in self._chans.items():
            threading.Thread(target=self._read, args=(r, ch), name=f"tp-rank{r}", daemon=True).start()
        store = dist.TCPStore(host, store_port, self.world, True,
                              timeout=timedelta(seconds=CONNECT_TIMEOUT_S))
        dist.init_process_group(backend, store=store, rank=0, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        self._pg = True
        log.info("tensor parallel: process group of %d ranks (%s) formed", self.world, backend)

    def _rendezvous_port(self, host: str) -> int:
        if self.config.master_port:
            return self.config.master_port + 1
        with socket.create_server((host, 0)) as s:  # a free port for the TCPStore
            return s.getsockname()[1]

    def _accept(self, listener: socket.socket, token: str, should_stop) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        listener.settimeout(0.1)
        while len(self._chans) < self.world - 1:
            self._check_procs("before connecting")
            if should_stop():
                raise TPStartupError("stopped while the ranks connected")
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.world)) - set(self._chans))
                raise TPStartupError(f"ranks {missing} did not connect within {CONNECT_TIMEOUT_S:.0f} s")
            try:
                sock, peer = listener.accept()
            except socket.timeout:
                continue
            ch = Channel(sock)
            try:
                hello = ch.recv(timeout=10.0)
            except (Closed, socket.timeout) as exc:
                log.warning("tensor parallel: bad connection from %s: %s", peer, exc)
                ch.close()
                continue
            ok = (isinstance(hello, Hello) and secrets.compare_digest(hello.token, token)
                  and 0 < hello.rank < self.world and hello.rank not in self._chans)
            if not ok:
                log.warning("tensor parallel: refused a connection from %s (bad hello)", peer)
                ch.close()
                continue
            self._chans[hello.rank] = ch

    def _check_procs(self, when: str) -> None:
        for r, p in self._procs.items():
            if p.poll() is not None:
                raise TPStartupError(f"rank {r} exited with code {p.returncode} {when}")

    def _read(self, rank: int, ch: Channel) -> None:
        """One worker's frames, for as long as the connection lives."""
        while True:
            try:
                msg = ch.recv()
            except (Closed, OSError) as exc:
                self._inbox.put((rank, Closed(str(exc))))
                self._peer_failed(rank, f"connection lost ({exc})")
                return
            self._inbox.put((rank, msg))
            if isinstance(msg, Failed):
                self._peer_failed(rank, msg.error)

    def _peer_failed(self, rank: int, why: str) -> None:
        if self._closing:
            return
        self._failed = True
        if not self._serving:
            return  # startup: _collect raises it
        p = self._procs.get(rank)
        code = ""
        if p is not None:
            try:
                code = f", exit code {p.wait(0.2)}"
            except subprocess.TimeoutExpired:
                pass
        cb = self.on_failure
        if cb is not None:
            cb(RankFailed(f"tensor-parallel rank {rank} failed: {why}{code}"))

    def _collect(self, kind, what: str, should_stop=lambda: False) -> dict[int, object]:
        """One ``kind`` frame from every worker; any failure raises TPStartupError naming
        every rank's error that arrives within FAIL_GRACE_S."""
        got: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = None
        while len(got) + len(errors) < self.world - 1:
            if should_stop():
                raise TPStartupError(f"stopped while waiting for the ranks {what}")
            timeout = 0.1 if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rank, msg = self._inbox.get(timeout=timeout)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                self._check_procs(what)
                continue
            if isinstance(msg, kind):
                got[rank] = msg
            elif isinstance(msg, (Failed, Closed)):
                errors.setdefault(rank, msg.error if isinstance(msg, Failed) else f"lost ({msg})")
                deadline = deadline or time.monotonic() + FAIL_GRACE_S
        if errors:
            self._failed = True
            raise TPStartupError("; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
        return got

    def agree_blocks(self, mine: int) -> int:
        loaded = self._collect(Loaded, "loaded")
        n = min([mine] + [m.max_blocks for m in loaded.values()])
        for ch in self._chans.values():
            ch.send(Blocks(n))
        return n

    def wait_ready(self) -> None:
        self._collect(Ready, "built their KV caches")
        self._serving = True

    # -- serving -------------------------------------------------------------------------------
    def step(self, seqs, logits_rows) -> None:
        body = _encoder.encode(Step(seqs, logits_rows))
        frame = _HEADER.pack(len(body)) + body
        for r, ch in self._chans.items():
            try:
                ch.sock.sendall(frame)
            except OSError as exc:
                raise RankFailed(f"tensor-parallel rank {r} is gone: {exc}") from None

    # -- teardown ------------------------------------------------------------------------------
    def close(self, released: list[str], own: tuple[int, int], reachable) -> None:
        """After the driver's own release: every rank releases and reports; then the process
        group is destroyed and every local worker waited for (SIGKILL after the grace)."""
        if self._closing:
            return
        self._closing = True
        failed = self._failed
        self.on_failure = None
        self.reports[0] = Released(0, released, own[0], own[1], reachable())
        for ch in self._chans.values():
            try:
                ch.send(Shutdown())
            except Closed:
                pass
        deadline = time.monotonic() + (FAIL_GRACE_S if failed else EXIT_GRACE_S)
        pending = set(self._chans)
        while pending and time.monotonic() < deadline:
            try:
                rank, msg = self._inbox.get(timeout=0.1)
            except queue.Empty:
                pending -= {r for r, p in self._procs.items() if p.poll() is not None}
                continue
            if isinstance(msg, Released):
                self.reports[rank] = msg
            if isinstance(msg, (Released, Closed, Failed)):
                pending.discard(rank)
        for r in sorted(self.reports):
            m = self.reports[r]
            log.info("rank %d released %s: %d tensors alive (%d B), %d reachable", r,
                     ", ".join(m.released) or "nothing", m.alive, m.alive_bytes, len(m.reachable),
                     extra={"rank": r, "alive": m.alive, "alive_bytes": m.alive_bytes})
        missing = sorted(set(range(1, self.world)) - set(self.reports))
        if missing and not failed:
            log.warning("tensor parallel: no release report from ranks %s", missing)
        if self._pg:
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group after a failure: nothing left to free
                log.debug("destroy_process_group: %r", exc)
            self._pg = False
        for ch in self._chans.values():
            ch.close()
        _reap(self._procs, max(0.0, deadline - time.monotonic()))


def _reap(procs: dict[int, subprocess.Popen], grace: float) -> None:
    deadline = time.monotonic() + grace
    for r, p in procs.items():
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("tensor parallel: rank %d did not exit; killing it", r)
            p.kill()
            p.wait()


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parents[2])  # the directory holding engine/
    old = os.environ.get("PYTHONPATH")
    return root if not old else f"{root}{os.pathsep}{old}"

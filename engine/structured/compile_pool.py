"""``CompilePool``: grammar compiles in processes that can be killed (``compile_worker.py``).

xgrammar cannot interrupt a compile, and a thread cannot be stopped: a compile past its deadline
on a thread keeps its core busy and its memory held until it ends (minutes, for a hostile
schema). In a process of its own it is stopped: the process is killed, and the CPU and the
memory go with it.

* One compile server per pool, started on the first compile (``sys.executable -m
  engine.structured.compile_worker``): it imports xgrammar once, gets the engine's tokenizer
  info once (``TokenizerInfo.serialize_json``), and forks its compile workers from itself (a
  killed one is replaced by a fork: milliseconds). A compiled grammar comes back serialized
  (``CompiledGrammar.serialize_json``) and is deserialized here against the same info. The wire
  is msgspec frames over the server's pipes (``compile_wire.py``), bounded before decoding; a
  thread here reads the server's answers and hands each to its job.
* At most ``workers`` compiles run at once: a slot is held from the job's start until its answer,
  or, past its deadline, until the server reports its worker killed *and* reaped -- the bound
  counts the compiles that run. A compile's deadline counts its time in the server only; the wait
  for a slot has a bound of its own; the server's start counts in neither.
* :meth:`CompilePool.close` closes the server's stdin: it kills and reaps its workers and exits
  (killed after :data:`CLOSE_TIMEOUT`); the engine's release calls it. The server also ends when
  the engine dies (the end of its stdin), and its workers with it.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
import weakref
from typing import Callable, Optional

import anyio
from anyio import to_thread

from .. import envs
from ..errors import BadRequestError, EngineError, EngineShutdownError
from .compile_wire import (MAX_FROM_WORKER, Cancel, Done, Ended, Failed,
                           FrameReader, FromWorker, Job, PeerGone, Ready, Start, write_frame)

log = logging.getLogger("enginecore.structured")

#: added to a compile's niceness once it has run for GRACE seconds: long compiles (a hostile
#: one too) take the CPU the engine's own threads leave, so they can only slow themselves (CFS
#: weight 110 against 1024 at nice 0), while the usual compile (0.2-0.5 s for a JSON schema
#: with SmolLM2's vocabulary, measured) runs at the engine's priority, however busy the host.
#: The server itself (its start, its relaying) runs at the engine's priority.
NICE = 10
GRACE = 0.5
#: how long the server may take to start (import xgrammar, torch and transformers: 2.5 s on
#: the 2-core box, 8 s with its cores busy, measured)
START_TIMEOUT = 120.0
#: how long the server may take to kill and reap a worker, or to end at close()
CLOSE_TIMEOUT = 10.0
#: the environment the server does not get (secrets)
_SECRETS = frozenset(v.name for v in envs.VARIABLES if v.kind == "secret")
#: its thread pools held to one thread: the server forks, so it must stay single-threaded
#: (numpy's OpenBLAS, imported with xgrammar, starts a pool thread otherwise)
_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_CLOSED = "the grammar compiler is closed (the engine stopped)"


class CompileTimeout(Exception):
    """A compile outlived its deadline; its process was killed."""


class SlotTimeout(Exception):
    """No compile slot came free in time (every slot busy with other compiles)."""


class _Box:
    """What the server said about one job, as the reader thread hands it over. Nothing is taken
    out: a wait abandoned by a cancellation cannot take the answer its cancel waits for."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.items: list = []  # None: the server is gone
        self._woken = False

    def put(self, item) -> None:
        with self._cond:
            self.items.append(item)
            self._cond.notify_all()

    def wake(self) -> None:
        """End the waits of :meth:`first` (an abandoned one returns)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def first(self, timeout: float, wake: bool = True):
        """The first thing said (None: the server is gone), waiting up to ``timeout`` seconds
        (``TimeoutError``); with ``wake``, None once :meth:`wake` was called."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.items or (wake and self._woken), timeout):
                raise TimeoutError
            return self.items[0] if self.items else None


class _Server:
    """The compile server's process, and the thread that reads its answers into job boxes."""

    def __init__(self, workers: int) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {k: v for k, v in os.environ.items() if k not in _SECRETS}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.update(dict.fromkeys(_ONE_THREAD, "1"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.structured.compile_worker", "--nice", str(NICE),
             "--grace", str(GRACE), "--max-jobs", str(workers)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.pid = self.proc.pid
        self._boxes: dict[int, _Box] = {0: _Box()}  # 0: Ready's
        self._lock = threading.Lock()  # the boxes, gone
        self._send_lock = threading.Lock()
        self.gone: Optional[str] = None  # why its answers ended
        self._reader = threading.Thread(target=self._read, name=f"compile-server-{self.pid}",
                                        daemon=True)
        self._reader.start()

    def _read(self) -> None:
        reader = FrameReader(self.proc.stdout.fileno(), FromWorker, MAX_FROM_WORKER)
        why = "ended"
        try:
            while True:
                msg = reader.read()
                box = self._boxes.get(0 if isinstance(msg, Ready) else msg.id)
                if box is not None:  # (an answer to a job no one waits for is dropped)
                    box.put(msg)
        except PeerGone as exc:
            why = str(exc)
        finally:
            with self._lock:
                self.gone = why
                for box in self._boxes.values():
                    box.put(None)

    def box(self, job: int) -> _Box:
        with self._lock:
            if self.gone is not None:
                raise PeerGone(self.gone)
            box = self._boxes[job] = _Box()
            return box

    def drop(self, job: int) -> None:
        with self._lock:
            self._boxes.pop(job, None)

    def send(self, msg) -> None:
        with self._send_lock:
            if self.proc.stdin.closed:
                raise PeerGone("closed")
            write_frame(self.proc.stdin.fileno(), msg)

    def usable(self) -> bool:
        return self.gone is None and self.proc.poll() is None

    def close(self) -> Optional[int]:
        """End the server (its stdin closed: it kills its workers and exits; killed if it
        does not in time), wait for it and its reader; its exit status."""
        if self._send_lock.acquire(timeout=CLOSE_TIMEOUT):  # (no sender is mid-frame)
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            finally:
                self._send_lock.release()
        try:
            code = self.proc.wait(CLOSE_TIMEOUT)
        except subprocess.TimeoutExpired:
            log.error("the grammar compile server %d did not end; killing it", self.pid)
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(CLOSE_TIMEOUT)
        if not self._reader.is_alive():  # (a pipe is closed once no thread reads it)
            self.proc.stdout.close()
        return code


class CompilePool:
    """Compiles in a compile server's workers, ``workers`` at once at most."""

    def __init__(self, tokenizer_info: Callable[[], object], workers: int = 2) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._make_info = tokenizer_info  # -> xgrammar.TokenizerInfo (called once, on a thread)
        self._info = None
        self._info_json: Optional[str] = None
        self._slots = anyio.Semaphore(workers)
        self.workers = workers
        self._server: Optional[_Server] = None
        self._starting = anyio.Lock()
        self._ids = itertools.count(1)
        self._jobs: set[int] = set()  # sent, not answered
        self._closed = False
        self.started = 0  # servers started, ever (the tests read it)
        # a pool dropped without close() (a test's) still ends its server: when collected,
        # or at the interpreter's exit
        self._servers: list[_Server] = []
        self._finalizer = weakref.finalize(self, _close_all, self._servers)

    @property
    def server_pid(self) -> Optional[int]:
        s = self._server
        return s.pid if s is not None and s.usable() else None

    def compiling(self) -> int:
        """Jobs sent to the server and not answered yet."""
        return len(self._jobs)

    async def compile(self, kind: str, text: str, timeout: float, wait: float):
        """(the compiled grammar, the compile's seconds) of a constraint; :class:`CompileTimeout`
        if the compile takes over ``timeout`` seconds (its process is then killed),
        :class:`SlotTimeout` if no slot came free within ``wait`` seconds,
        :class:`BadRequestError` if it does not compile or its process died meanwhile."""
        if self._closed:
            raise EngineShutdownError(_CLOSED)
        with anyio.move_on_after(wait) as waited:
            await self._slots.acquire()
        if waited.cancelled_caught:
            raise SlotTimeout
        try:
            return await self._run(await self._server_now(), kind, text, timeout)
        finally:
            self._slots.release()

    async def _server_now(self) -> _Server:
        async with self._starting:
            s = self._server
            if s is not None and s.usable():
                return s
            if s is not None:  # it died: say why, and reap it
                await self._end(s, "ended")
            if self._closed:
                raise EngineShutdownError(_CLOSED)
            s = self._server = _Server(self.workers)  # (a vfork + exec: no wait for the loop)
            self._servers.append(s)
            self.started += 1
            try:
                info_json = (await to_thread.run_sync(self._vocabulary))[1]
                await to_thread.run_sync(s.send, Start(info_json))
                ready = await to_thread.run_sync(s._boxes[0].first, START_TIMEOUT,
                                                 abandon_on_cancel=True)
                if not isinstance(ready, Ready):
                    raise PeerGone(s.gone or "no ready frame")
            except BaseException as exc:
                await self._end(s, "did not start")
                if isinstance(exc, (PeerGone, TimeoutError)):
                    raise EngineError(f"the grammar compiler did not start: "
                                      f"{exc or 'timed out'}") from None
                raise
            log.info("grammar compile server %d ready (%.2f s)", s.pid, ready.seconds)
            return s

    def _vocabulary(self):
        if self._info is None:  # (under _starting: built once)
            info = self._make_info()
            self._info_json = info.serialize_json()
            self._info = info
        return self._info, self._info_json

    async def _run(self, s: _Server, kind: str, text: str, timeout: float):
        job = next(self._ids)
        try:
            box = s.box(job)
        except PeerGone:
            raise EngineError("the grammar compile server ended") from None
        self._jobs.add(job)
        try:
            try:
                await to_thread.run_sync(s.send, Job(job, kind, text))
                reply = await to_thread.run_sync(box.first, timeout, abandon_on_cancel=True)
            except PeerGone:
                raise
            except TimeoutError:
                await self._cancel(s, job, box)
                raise CompileTimeout from None
            except BaseException:  # cancelled (the engine stopping): the compile is stopped too
                await self._cancel(s, job, box)
                raise
        except PeerGone:
            reply = None
        finally:
            self._jobs.discard(job)
            s.drop(job)
        if reply is None:  # the server ended meanwhile
            if self._closed:
                raise EngineShutdownError(_CLOSED)
            raise EngineError(f"the grammar compile server ended during a compile ({s.gone})")
        if isinstance(reply, Failed):
            raise BadRequestError(reply.message)
        if isinstance(reply, Ended):
            log.warning("a grammar compile of a %s constraint died (%s)", kind, reply.status)
            raise BadRequestError(f"invalid structured output: compiling the {kind} constraint "
                                  f"ended its process ({reply.status})")
        if not isinstance(reply, Done):
            raise EngineError(f"the grammar compile server answered {type(reply).__name__}")
        grammar = await to_thread.run_sync(_deserialize, reply.grammar, self._info)
        return grammar, reply.seconds

    async def _cancel(self, s: _Server, job: int, box: _Box) -> None:
        """Have the server kill job ``job``'s worker and wait until it reports it reaped
        (shielded: the job's slot is given back once its process is gone). A server that does
        not answer in time is ended, its workers with it."""
        with anyio.CancelScope(shield=True):
            box.wake()  # (a wait abandoned by the cancellation returns)
            try:
                await to_thread.run_sync(s.send, Cancel(job))
                # Cancelled, or the answer that crossed the cancel, or None: the server is gone
                await to_thread.run_sync(box.first, CLOSE_TIMEOUT, False)
            except PeerGone:
                return  # the server is gone, and its workers with it
            except TimeoutError:
                log.error("the grammar compile server did not stop a compile within %g s; "
                          "ending it", CLOSE_TIMEOUT)
                await self._end(s, "did not stop a compile")

    async def _end(self, s: _Server, why: str) -> None:
        """End ``s`` and wait for it (shielded)."""
        with anyio.CancelScope(shield=True):
            code = await to_thread.run_sync(s.close)
        if not self._closed:
            log.warning("grammar compile server %d %s (exit status %s)", s.pid, why, code)
        if self._server is s:
            self._server = None
        if s in self._servers:
            self._servers.remove(s)

    def close(self) -> None:
        """End the server and its compiles (waits for their end); later compiles raise
        :class:`EngineShutdownError`."""
        self._closed = True
        self._finalizer()
        self._server = None


def _close_all(servers: list) -> None:
    for s in list(servers):
        s.close()
    servers.clear()


def _deserialize(text: str, info):
    import xgrammar as xgr

    return xgr.CompiledGrammar.deserialize_json(text, info)


__all__ = ["CompilePool", "CompileTimeout", "SlotTimeout", "NICE", "GRACE", "START_TIMEOUT"]

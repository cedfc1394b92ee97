"""``CompilePool``: grammar compiles in worker processes (``compile_worker.py``) that can be killed.

xgrammar cannot interrupt a compile, and a thread cannot be stopped: a compile past its deadline
on a thread keeps its core busy and its memory held until it ends (minutes, for a hostile
schema). In a process of its own it is stopped: the pool kills the process, and the CPU and the
memory go with it.

* At most ``workers`` compiles run at once: a slot is held from the job's start until its answer
  came back or its process is dead (killed *and* reaped), so the bound counts the compiles that
  actually run. A process serves one job at a time and is kept, warm, for the next. A compile's
  deadline counts its time in the worker only; the wait for a slot has a bound of its own.
* Processes are started on demand (the first compile, a compile finding none idle, as after a
  kill) with ``sys.executable -m engine.structured.compile_worker``; the engine's tokenizer info
  is handed over once at start (``TokenizerInfo.serialize_json``) and compiled grammars come back
  serialized (``CompiledGrammar.serialize_json``), deserialized here against the same info. The
  wire is msgspec frames over the pipes (``compile_wire.py``), bounded before decoding.
* :meth:`CompilePool.close` kills and reaps every process (the engine's release calls it); a
  worker also ends by itself when the engine's end of its stdin closes (``compile_worker.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Callable, Optional

import anyio
from anyio import to_thread

from ..errors import BadRequestError, EngineError, EngineShutdownError
from .compile_wire import (MAX_FROM_WORKER, Done, Failed, FrameReader, FromWorker, Job,
                           PeerGone, Ready, Start, write_frame)

log = logging.getLogger("enginecore.structured")

#: added to a worker's niceness: compiles (a hostile one too) take the CPU the engine's own
#: threads leave, so they can only slow themselves (CFS weight 110 against 1024 at nice 0)
NICE = int(os.environ.get("GC_EXP_NICE", "10"))  # EXPERIMENT
#: how long a worker may take to start (import xgrammar, torch and transformers: 2.5 s on the
#: 2-core box, 8 s with its cores busy, measured), not counted in a compile's deadline
START_TIMEOUT = 120.0
#: the environment a worker does not get (secrets)
_SECRETS = ("ENGINECORE_TOKEN", "ENGINECORE_TP_TOKEN")


class CompileTimeout(Exception):
    """A compile outlived its deadline; its process was killed."""


class SlotTimeout(Exception):
    """No compile slot came free in time (every worker busy with other compiles)."""


class _Worker:
    """One compile process. Its blocking methods run on a worker thread, one call at a time;
    :meth:`kill` may be called from any thread."""

    def __init__(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {k: v for k, v in os.environ.items() if k not in _SECRETS}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"  # its torch (imported by xgrammar) computes nothing
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.structured.compile_worker", "--nice", str(NICE)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.pid = self.proc.pid
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        self._reader = FrameReader(self._out, FromWorker, MAX_FROM_WORKER)
        self._idle = threading.Event()  # no thread uses the pipes
        self._idle.set()
        self._jobs = 0
        self.busy = False  # a job is sent and not answered

    def start(self, tokenizer_info: str) -> float:
        """Hand over the vocabulary, wait until the worker is ready; its start's seconds."""
        reply = self._call(Start(tokenizer_info), time.monotonic() + START_TIMEOUT)
        if not isinstance(reply, Ready):
            raise PeerGone(f"answered {type(reply).__name__} to the start")
        return reply.seconds

    def compile(self, kind: str, text: str, timeout: float):
        self._jobs += 1
        self.busy = True
        try:
            reply = self._call(Job(self._jobs, kind, text), time.monotonic() + timeout)
        finally:
            self.busy = False
        if not isinstance(reply, (Done, Failed)) or reply.id != self._jobs:
            raise PeerGone(f"answered {type(reply).__name__} to job {self._jobs}")
        return reply

    def _call(self, msg, deadline: float):
        self._idle.clear()
        try:
            write_frame(self._in, msg)
            return self._reader.read(deadline)
        finally:
            self._idle.set()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (the pipes stay open: a thread may be reading them; :meth:`reap` closes)."""
        if self.proc.returncode is None:
            try:
                self.proc.send_signal(signal.SIGKILL)
            except OSError:
                pass

    def reap(self) -> Optional[int]:
        """Kill, wait for the process's end and for the thread using its pipes, then close
        them; its exit status (negative: the signal)."""
        self.kill()
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # not expected after SIGKILL
            log.error("grammar compile worker %d did not end after SIGKILL", self.pid)
            return None
        # a pipe is closed only once no thread reads it (its fd could be reused meanwhile)
        if self._idle.wait(10):
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        return code


def _ended(code: Optional[int]) -> str:
    if code is None:
        return "did not end"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class CompilePool:
    """Up to ``workers`` compile processes; :meth:`compile` runs one job on one of them."""

    def __init__(self, tokenizer_info: Callable[[], object], workers: int = 2) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._make_info = tokenizer_info  # -> xgrammar.TokenizerInfo (called once, on a thread)
        self._info = None
        self._info_json: Optional[str] = None
        self._info_lock = threading.Lock()
        self._slots = anyio.Semaphore(workers)
        self.workers = workers
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()  # started and not reaped
        self._closed = False
        self.started = 0  # processes started, ever (the tests read it)
        # a pool dropped without close() (a test's) still ends its processes: when collected,
        # or at the interpreter's exit
        self._finalizer = weakref.finalize(self, _end_all, self._all)

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return sorted(w.pid for w in self._all)

    @property
    def running(self) -> int:
        """Workers not idle: starting, or compiling (each job in a process of its own)."""
        return len(self._all) - len(self._idle)

    def compiling(self) -> list[int]:
        """The process ids of the workers with a job sent and not answered yet."""
        return sorted(w.pid for w in self._all if w.busy)

    def _vocabulary(self):
        with self._info_lock:
            if self._info is None:
                info = self._make_info()
                self._info_json = info.serialize_json()
                self._info = info
        return self._info, self._info_json

    async def compile(self, kind: str, text: str, timeout: float, wait: float):
        """(the compiled grammar, the compile's seconds in the worker) of a constraint;
        :class:`CompileTimeout` if the compile takes over ``timeout`` seconds (its process is
        then killed), :class:`SlotTimeout` if no slot came free within ``wait`` seconds,
        :class:`BadRequestError` if it does not compile or its worker died meanwhile. A
        worker's start counts in neither."""
        if self._closed:
            raise EngineShutdownError("the grammar compiler is closed (the engine stopped)")
        with anyio.move_on_after(wait) as waited:
            await self._slots.acquire()
        if waited.cancelled_caught:
            raise SlotTimeout
        try:
            return await self._run(await self._worker(), kind, text, timeout)
        finally:
            self._slots.release()

    async def _worker(self) -> _Worker:
        """An idle live worker, or a new one."""
        while self._idle:
            w = self._idle.pop()
            if w.alive():
                return w
            self._forget(w, "died while idle")
        w = _Worker()  # (a vfork + exec: no wait for the loop)
        self._all.add(w)
        self.started += 1
        try:
            info_json = (await to_thread.run_sync(self._vocabulary))[1]
            if self._closed:
                raise EngineShutdownError("the grammar compiler is closed (the engine stopped)")
            seconds = await self._blocking(w, w.start, info_json)
        except BaseException as exc:
            await self._reap(w)
            if isinstance(exc, PeerGone):
                raise EngineError(f"the grammar compiler did not start: {exc}") from None
            if isinstance(exc, TimeoutError):
                raise EngineError(f"the grammar compiler did not start within "
                                  f"{START_TIMEOUT:g} s") from None
            raise
        log.info("grammar compile worker %d ready (%.2f s)", w.pid, seconds)
        return w

    async def _run(self, w: _Worker, kind: str, text: str, timeout: float):
        try:
            reply = await self._blocking(w, w.compile, kind, text, timeout)
        except TimeoutError:
            await self._reap(w)
            raise CompileTimeout from None
        except PeerGone as exc:
            code = await self._reap(w)
            if self._closed:
                raise EngineShutdownError("the grammar compiler is closed (the engine "
                                          "stopped)") from None
            log.warning("grammar compile worker %d failed on a %s constraint (%s; %s)",
                        w.pid, kind, _ended(code), exc)
            raise BadRequestError(f"invalid structured output: compiling the {kind} constraint "
                                  f"ended the grammar compiler's process ({_ended(code)})") from None
        except BaseException:  # cancelled (the engine stopping): the compile is stopped too
            await self._reap(w)
            raise
        self._idle.append(w)
        if isinstance(reply, Failed):
            raise BadRequestError(reply.message)
        grammar = await to_thread.run_sync(_deserialize, reply.grammar, self._info)
        return grammar, reply.seconds

    @staticmethod
    async def _blocking(w: _Worker, fn, *args):
        """``fn(*args)`` on a thread; if the wait is cancelled, ``w`` is killed (its thread then
        sees the end of the pipe and returns)."""
        try:
            return await to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except BaseException:
            w.kill()
            raise

    async def _reap(self, w: _Worker) -> Optional[int]:
        """Kill ``w`` and wait for its end (shielded: the slot it holds is given back only once
        the process is gone)."""
        w.kill()
        with anyio.CancelScope(shield=True):
            code = await to_thread.run_sync(w.reap)
        self._all.discard(w)
        return code

    def _forget(self, w: _Worker, why: str) -> None:
        code = w.reap()
        self._all.discard(w)
        log.warning("grammar compile worker %d %s (%s)", w.pid, why, _ended(code))

    def close(self) -> None:
        """Kill every worker and wait for their end; later compiles raise
        :class:`EngineShutdownError`."""
        self._closed = True
        self._finalizer()
        self._idle.clear()


def _end_all(workers: set) -> None:
    for w in workers:
        w.kill()
    for w in list(workers):
        w.reap()
    workers.clear()


def _deserialize(text: str, info):
    import xgrammar as xgr

    return xgr.CompiledGrammar.deserialize_json(text, info)


__all__ = ["CompilePool", "CompileTimeout", "SlotTimeout", "NICE", "START_TIMEOUT"]

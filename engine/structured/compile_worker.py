"""The compile server: ``python -m engine.structured.compile_worker``, started and owned by the
engine's :class:`~engine.structured.compile_pool.CompilePool`.

It imports xgrammar once (seconds: xgrammar imports torch and transformers), takes the
vocabulary once (:class:`Start`: ``TokenizerInfo.serialize_json()``), and forks its compile
workers from itself: up to ``--max-jobs`` processes, each compiling one :class:`Job` at a time
(``compiler.compile_constraint``) and answering with the compiled grammar serialized
(:class:`Done`) or the problem (:class:`Failed`), which the server relays to the engine, or
:class:`Ended` if the worker died first. A :class:`Cancel` kills the job's worker and reaps it
before :class:`Cancelled` answers, so the engine counts only compiles that run. xgrammar cannot
interrupt a compile: killing its process is what stops it, and its memory goes with it. A new
worker is a fork (milliseconds), where a fresh process would import xgrammar again; a worker
is kept for the next job (a first compile in a fresh fork ran ~3x slower for a small regex: its
heap's pages are new). The server stays single-threaded (one poll loop; BLAS and OpenMP pools
held to one thread by the engine's environment), so forking it is safe.

A compile that outlives its grace (``--grace`` seconds: the usual compile is done by then) goes
on at a lower CPU priority (``--nice``): a long compile, a hostile one too, then takes only the
CPU the engine's own threads leave; its worker is retired after it (its priority cannot be
raised again), as is a worker whose heap grew by :data:`RETIRE_GROWTH`. The server dies with
the engine: the end of its stdin (the engine closed it, or died) kills every worker and ends the
server; a worker dies with the server (``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from typing import Optional

import msgspec

from .compile_wire import (HEADER, MAX_FROM_WORKER, MAX_TO_WORKER, Cancel, Cancelled, Done,
                           Ended, Failed, FrameBuffer, FrameReader, Job, PeerGone, Ready, Start,
                           ToWorker, frame, write_all)

_READ = 1 << 20
#: a worker whose resident memory grew past the server's by this much is retired after its job
#: (its heap keeps what a large compile took; a new fork starts from the server's pages)
RETIRE_GROWTH = 512 * 2**20


def _take_stdout() -> int:
    """A private fd for frames; fd 1 then points at stderr, so that nothing a library prints
    can land inside a frame."""
    out = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _answer(compiler, job: Job):
    from ..errors import BadRequestError
    from .compiler import compile_constraint

    t0 = time.perf_counter()
    try:
        text = compile_constraint(compiler, job.kind, job.text).serialize_json()
    except BadRequestError as exc:
        return Failed(job.id, str(exc))
    except Exception as exc:  # noqa: BLE001 - one job's failure is that job's answer
        return Failed(job.id, f"invalid structured output: the {job.kind} constraint does not "
                              f"compile: {type(exc).__name__}: {str(exc)[:300]}")
    if len(text) > MAX_FROM_WORKER - 4096:
        return Failed(job.id, f"invalid structured output: the {job.kind} constraint's "
                              f"compiled grammar is too large ({len(text) / 2**20:.0f} MB)")
    return Done(job.id, text, time.perf_counter() - t0)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the server ends (Linux; elsewhere a worker ends at its next read)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the server ended before the call
        os._exit(0)


def _worker(compiler, jobs: int, answers: int, server: int) -> None:
    """In a forked worker: compile the jobs read from ``jobs``, answer each on ``answers``;
    exit at the end of ``jobs``."""
    code = 0
    try:
        _die_with_parent(server)
        keep = sorted((2, jobs, answers))  # stderr, our pipes: not the server's others
        for lo, hi in zip([-1] + keep, keep + [1 << 16]):
            os.closerange(lo + 1, hi)
        reader = FrameReader(jobs, Job, MAX_TO_WORKER)
        while True:
            try:
                job = reader.read()
            except PeerGone:
                break
            write_all(answers, frame(_answer(compiler, job)))
    except BaseException:  # noqa: BLE001 - nothing may escape into the server's loop
        code = 1
    finally:
        os._exit(code)


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _rss(pid: int) -> int:
    """``pid``'s resident bytes (0 where ``/proc`` does not say)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Proc:
    """A worker, seen from the server."""

    def __init__(self, pid: int, jobs: int, answers: int) -> None:
        self.pid, self.jobs, self.answers = pid, jobs, answers
        self.inbox = FrameBuffer(MAX_FROM_WORKER)
        self.job: Optional[int] = None  # the job it compiles
        self.grace_ends = 0.0  # when its job goes on at a lower priority
        self.niced = False  # retired after its job


class Server:
    def __init__(self, out: int, nice: int, grace: float, max_jobs: int) -> None:
        self.out, self.max_jobs = out, max_jobs
        self.max_rss = 0  # a worker resident beyond it after a job is retired
        # a long compile's niceness
        self.niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + max(0, nice))
        self.grace = grace
        self.compiler = None
        self.poller = select.poll()
        self.procs: dict[int, _Proc] = {}  # by its answers pipe

    def deprioritize(self) -> float:
        """Lower the priority of the workers whose job outlived its grace; the seconds to the
        next one's end of grace (1 at most)."""
        now, wait = time.monotonic(), 1.0
        for p in self.procs.values():
            if p.job is None or p.niced:
                continue
            if p.grace_ends <= now:
                p.niced = True
                try:
                    os.setpriority(os.PRIO_PROCESS, p.pid, self.niceness)
                except OSError:  # (it just ended)
                    pass
            else:
                wait = min(wait, p.grace_ends - now)
        return wait

    def handle(self, msg, t0: float) -> None:
        if isinstance(msg, Start):
            if self.compiler is not None:
                raise PeerGone("a second start frame")
            import xgrammar as xgr

            info = xgr.TokenizerInfo.deserialize_json(msg.tokenizer_info)
            # its own cache is off: the engine's is keyed by the constraint, bounded in
            # entries and bytes
            self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self.max_rss = _rss(os.getpid()) + RETIRE_GROWTH
            self.fork()  # one worker ready before the first job
            write_all(self.out, frame(Ready(os.getpid(), time.monotonic() - t0)))
        elif self.compiler is None:
            raise PeerGone("a job before the start frame")
        elif isinstance(msg, Job):
            busy = [p for p in self.procs.values() if p.job is not None]
            idle = [p for p in self.procs.values() if p.job is None]
            if msg.id in (p.job for p in busy) or (not idle and len(busy) >= self.max_jobs):
                write_all(self.out, frame(Failed(msg.id, "the grammar compile server is busy")))
                return
            p = idle[0] if idle else self.fork()
            try:
                write_all(p.jobs, frame(msg))
            except PeerGone:  # it died while idle: a new one takes the job
                self.end(p, kill=True)
                p = self.fork()
                write_all(p.jobs, frame(msg))  # (a fresh fork reads it; else the server fails)
            p.job, p.grace_ends = msg.id, time.monotonic() + self.grace
        elif isinstance(msg, Cancel):
            p = next((p for p in self.procs.values() if p.job == msg.id), None)
            if p is not None:
                self.end(p, kill=True)
                write_all(self.out, frame(Cancelled(msg.id)))

    def fork(self) -> _Proc:
        jobs_r, jobs_w = os.pipe()
        answers_r, answers_w = os.pipe()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            _worker(self.compiler, jobs_r, answers_w, server)
        os.close(jobs_r)
        os.close(answers_w)
        os.set_blocking(answers_r, False)
        p = self.procs[answers_r] = _Proc(pid, jobs_w, answers_r)
        self.poller.register(answers_r, select.POLLIN)
        return p

    def end(self, p: _Proc, kill: bool) -> str:
        """Reap worker ``p`` (killed first if ``kill``, else its jobs pipe closed: it exits);
        how it ended."""
        if kill:
            os.kill(p.pid, signal.SIGKILL)
        os.close(p.jobs)
        _, status = os.waitpid(p.pid, 0)
        self.poller.unregister(p.answers)
        del self.procs[p.answers]
        os.close(p.answers)
        return _status(status)

    def from_worker(self, fd: int) -> None:
        p = self.procs[fd]
        try:
            data = os.read(fd, _READ)
        except BlockingIOError:
            return
        if not data:  # it died
            job, status = p.job, self.end(p, kill=False)
            if job is not None:
                write_all(self.out, frame(Ended(job, status)))
            return
        try:
            bodies = p.inbox.feed(data)
        except PeerGone:  # over the bound
            job = p.job
            self.end(p, kill=True)
            write_all(self.out, frame(Failed(job or 0, "invalid structured output: the "
                                                       "compiled grammar is too large")))
            return
        for body in bodies:
            write_all(self.out, HEADER.pack(len(body)) + body)
            p.job = None
        if p.job is None and (p.niced or _rss(p.pid) > self.max_rss):
            # retired: it would compile at a low priority from now on, or its heap grew
            self.end(p, kill=True)

    def stop(self) -> None:
        for p in list(self.procs.values()):
            self.end(p, kill=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="grammar compile server (started by the engine)")
    ap.add_argument("--nice", type=int, default=0,
                    help="added to a compile's niceness once it outlives its grace")
    ap.add_argument("--grace", type=float, default=0.0,
                    help="seconds a compile runs at the server's priority")
    ap.add_argument("--max-jobs", type=int, default=2, help="workers (compiles at once), at most")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    parent = os.getppid()
    # a SIGTERM or Ctrl-C to the process group (Kubernetes sends one) is the engine's to act on:
    # it drains, its compiles in flight finish, then it closes us (the workers inherit this)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    server = Server(_take_stdout(), args.nice, args.grace, args.max_jobs)
    import xgrammar  # noqa: F401  (before the start frame: while the engine builds it)

    # what each worker needs, imported once here (ctypes alone took 11 ms a process)
    import ctypes  # noqa: F401

    from . import compiler  # noqa: F401

    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:
        print(f"compile server: {threads} threads after importing xgrammar; a forked compile "
              f"could deadlock (then its deadline stops it)", file=sys.stderr, flush=True)
    decoder = msgspec.msgpack.Decoder(ToWorker)
    inbox = FrameBuffer(MAX_TO_WORKER)
    os.set_blocking(0, False)
    server.poller.register(0, select.POLLIN)
    try:
        while True:
            events = server.poller.poll(int(1e3 * server.deprioritize()) + 1)
            if not events and os.getppid() != parent:
                return 0  # the engine died; a pipe end lives on elsewhere
            for fd, _ in events:
                if fd != 0:
                    server.from_worker(fd)
                    continue
                try:
                    data = os.read(0, _READ)
                except BlockingIOError:
                    continue
                if not data:
                    return 0  # the engine closed our stdin, or died
                for body in inbox.feed(data):
                    server.handle(decoder.decode(body), t0)
    except (PeerGone, msgspec.DecodeError) as exc:
        print(f"compile server: a broken frame from the engine ({exc})", file=sys.stderr)
        return 2
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())

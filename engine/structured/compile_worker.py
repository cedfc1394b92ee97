"""The compile server: ``python -m engine.structured.compile_worker``, started and owned by the
engine's :class:`~engine.structured.compile_pool.CompilePool`.

It imports xgrammar once (seconds: xgrammar imports torch and transformers), takes the
vocabulary once (:class:`Start`: ``TokenizerInfo.serialize_json()``), then forks one child per
:class:`Job`: the child compiles (``compiler.compile_constraint``), writes its answer -- the
compiled grammar serialized (:class:`Done`) or the problem (:class:`Failed`) -- to a pipe of its
own and exits; the server relays that frame to the engine, or :class:`Ended` if the child died
first. A :class:`Cancel` kills the child and reaps it before :class:`Cancelled` answers, so
the engine counts only compiles that run. xgrammar cannot interrupt a compile: killing its
process is what stops it, and its memory goes with it. A fork costs milliseconds, where a fresh
process would import xgrammar again; the server stays single-threaded (one poll loop; BLAS and
OpenMP pools held to one thread by the engine's environment), so forking it is safe.

A compile that outlives its grace (``--grace`` seconds: the usual compile is done by then) goes
on at a lower CPU priority (``--nice``): a long compile, a hostile one too, then takes only the
CPU the engine's own threads leave. The server dies with the engine: the end of its stdin (the
engine closed it, or died) kills every child and ends the server; a child dies with the server
(``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time

import msgspec

from .compile_wire import (HEADER, MAX_FROM_WORKER, MAX_TO_WORKER, Cancel, Cancelled, Done,
                           Ended, Failed, FrameBuffer, Job, PeerGone, Ready, Start, ToWorker,
                           frame, write_all)

_READ = 1 << 20


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
    """SIGKILL when the server ends (Linux; elsewhere a child ends when its compile does)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the server ended before the call
        os._exit(0)


def _child(compiler, job: Job, w: int, server: int) -> None:
    """In the forked child: compile ``job``, write its answer to ``w``, exit."""
    code = 0
    try:
        _die_with_parent(server)
        os.closerange(0, 2)  # stdin, stdout: the server's
        os.closerange(3, w)  # the server's other pipes
        os.closerange(w + 1, 1 << 16)
        write_all(w, frame(_answer(compiler, job)))
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


class Server:
    def __init__(self, out: int, nice: int, grace: float, max_jobs: int) -> None:
        self.out, self.max_jobs = out, max_jobs
        # a long compile's niceness
        self.niceness = min(19, os.getpriority(os.PRIO_PROCESS, 0) + max(0, nice))
        self.grace = grace
        self.compiler = None
        self.poller = select.poll()
        self.children: dict[int, tuple[int, int, bytearray]] = {}  # job -> (pid, fd, bytes)
        self.by_fd: dict[int, int] = {}  # a child's pipe -> its job
        self.lower: dict[int, float] = {}  # the children still at our priority -> when not

    def deprioritize(self) -> float:
        """Lower the priority of the children that compile past their grace; the seconds to
        the next one's end of grace (1 at most)."""
        now, wait = time.monotonic(), 1.0
        for pid, at in list(self.lower.items()):
            if at <= now:
                del self.lower[pid]
                try:
                    os.setpriority(os.PRIO_PROCESS, pid, self.niceness)
                except OSError:  # (it just ended)
                    pass
            else:
                wait = min(wait, at - now)
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
            write_all(self.out, frame(Ready(os.getpid(), time.monotonic() - t0)))
        elif self.compiler is None:
            raise PeerGone("a job before the start frame")
        elif isinstance(msg, Job):
            if msg.id in self.children or len(self.children) >= self.max_jobs:
                write_all(self.out, frame(Failed(msg.id, "the grammar compile server is busy")))
                return
            self.fork(msg)
        elif isinstance(msg, Cancel) and msg.id in self.children:
            self.end(msg.id, kill=True)
            write_all(self.out, frame(Cancelled(msg.id)))

    def fork(self, job: Job) -> None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(self.compiler, job, w, os.getppid())
        os.close(w)
        self.lower[pid] = time.monotonic() + self.grace
        os.set_blocking(r, False)
        self.children[job.id] = (pid, r, bytearray())
        self.by_fd[r] = job.id
        self.poller.register(r, select.POLLIN)

    def end(self, job: int, kill: bool) -> str:
        """Reap job ``job``'s child (killed first if ``kill``); how it ended."""
        pid, fd, _ = self.children.pop(job)
        self.lower.pop(pid, None)
        if kill:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        self.poller.unregister(fd)
        del self.by_fd[fd]
        os.close(fd)
        return _status(status)

    def from_child(self, fd: int) -> None:
        job = self.by_fd[fd]
        buf = self.children[job][2]
        try:
            data = os.read(fd, _READ)
        except BlockingIOError:
            return
        if data:
            buf += data
            if len(buf) <= HEADER.size + MAX_FROM_WORKER:
                return
            self.end(job, kill=True)
            answer = frame(Failed(job, "invalid structured output: the compiled grammar is "
                                       "too large"))
        else:  # the child closed its pipe: it wrote its answer, or died
            n = HEADER.unpack_from(buf)[0] if len(buf) >= HEADER.size else -1
            whole = len(buf) == HEADER.size + n
            status = self.end(job, kill=False)
            answer = bytes(buf) if whole else frame(Ended(job, status))
        write_all(self.out, answer)

    def stop(self) -> None:
        for job in list(self.children):
            self.end(job, kill=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="grammar compile server (started by the engine)")
    ap.add_argument("--nice", type=int, default=0,
                    help="added to a compile's niceness once it outlives its grace")
    ap.add_argument("--grace", type=float, default=0.0,
                    help="seconds a compile runs at the server's priority")
    ap.add_argument("--max-jobs", type=int, default=2, help="compiles at once, at most")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when a compile ends
    server = Server(_take_stdout(), args.nice, args.grace, args.max_jobs)
    import xgrammar  # noqa: F401  (before the start frame: while the engine builds it)

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
                    server.from_child(fd)
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

"""The compile process: ``python -m engine.structured.compile_worker [--nice N]``, started and
owned by the engine's :class:`~engine.structured.compile_pool.CompilePool`.

It reads :mod:`compile_wire` frames on stdin -- the vocabulary once (:class:`Start`), then one
:class:`Job` at a time -- compiles each with xgrammar (``compiler.compile_constraint``) and
answers on stdout with the compiled grammar serialized (:class:`Done`) or the problem
(:class:`Failed`). A compile cannot be interrupted in-process: the engine kills this process
when a compile outlives its deadline, and its memory goes with it.

It dies with its parent: a reader thread takes the frames off stdin as they come, and the end of
stdin (the engine closed it, or died and the kernel closed it) ends the process at once, even in
the middle of a compile; the parent's pid is checked too whenever the worker is idle. It lowers
its own CPU priority first (``--nice``): a compile, a hostile one included, then takes only the
CPU the engine's own threads leave.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
import time

from .compile_wire import (MAX_FROM_WORKER, MAX_TO_WORKER, Done, Failed, FrameReader, Job,
                           PeerGone, Ready, Start, ToWorker, write_frame)


def _take_stdout() -> int:
    """A private fd for frames; fd 1 then points at stderr, so that nothing a library prints
    can land inside a frame."""
    out = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _read_stdin(jobs: queue.Queue) -> None:
    reader = FrameReader(0, ToWorker, MAX_TO_WORKER)
    try:
        while True:
            jobs.put(reader.read())
    except PeerGone:
        pass
    except BaseException as exc:  # noqa: BLE001 - any failure here ends the process
        print(f"compile worker: stdin reader failed: {exc!r}", file=sys.stderr, flush=True)
    os._exit(0)  # the engine closed our stdin, or is gone: nothing left to compile for


def _next(jobs: queue.Queue, parent: int):
    while True:
        try:
            return jobs.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # our parent died; a pipe end may live on elsewhere
                os._exit(0)


def _answer(compiler, job: Job):
    from ..errors import BadRequestError
    from .compiler import compile_constraint

    t0 = time.perf_counter()
    try:
        grammar = compile_constraint(compiler, job.kind, job.text)
        text = grammar.serialize_json()
    except BadRequestError as exc:
        return Failed(job.id, str(exc))
    except Exception as exc:  # noqa: BLE001 - one job's failure is that job's answer
        return Failed(job.id, f"invalid structured output: the {job.kind} constraint does not "
                              f"compile: {type(exc).__name__}: {str(exc)[:300]}")
    if len(text) > MAX_FROM_WORKER - 4096:
        return Failed(job.id, f"invalid structured output: the {job.kind} constraint's "
                              f"compiled grammar is too large ({len(text) / 2**20:.0f} MB)")
    return Done(job.id, text, time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="grammar compile worker (started by the engine)")
    ap.add_argument("--nice", type=int, default=0, help="added to this process's niceness")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when a compile ends
    if args.nice > 0:
        os.nice(args.nice)
    out = _take_stdout()
    jobs: queue.Queue = queue.Queue()
    threading.Thread(target=_read_stdin, args=(jobs,), name="compile-stdin",
                     daemon=True).start()
    import xgrammar as xgr  # (seconds: it imports torch and transformers)

    start = _next(jobs, parent)
    if not isinstance(start, Start):
        print("compile worker: the first frame is not a start frame", file=sys.stderr)
        return 2
    info = xgr.TokenizerInfo.deserialize_json(start.tokenizer_info)
    del start
    # its own cache is off: the engine's is keyed by the constraint, bounded in entries and bytes
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    try:
        write_frame(out, Ready(os.getpid(), time.monotonic() - t0))
        while True:
            job = _next(jobs, parent)
            if not isinstance(job, Job):
                print("compile worker: a start frame after the start", file=sys.stderr)
                return 2
            write_frame(out, _answer(compiler, job))
    except PeerGone:
        return 0


if __name__ == "__main__":
    sys.exit(main())

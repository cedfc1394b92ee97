"""``StepThread``: the one worker thread that runs :class:`engine.AsyncEngine`'s steps and its
other device work (the load, sleep/wake, weight updates, the release), handed each call
without first yielding to the event loop.

NOTE: the load runs here too, not on a pool thread: every thread that runs a parallel torch op
gets its own OpenMP team, and libgomp cuts its workers' spinning to ~100 iterations once it
manages more threads than there are CPUs. With the load's team beside the steps', two
intra-op threads on two cores made each parallel op wake its worker through the kernel:
1-stream decode of the default GGUF 25 ms a step against 17 ms with one team (measured).

Why not ``anyio.to_thread.run_sync``: it yields to the event loop twice before the worker gets
the call (a checkpoint, then the limiter's) and took 47-73 µs of CPU a call against 22-24 µs
here (measured on a 2-core CPU); at one call per step that is host time taken from every step.
When the consumers woken by a step's outputs run is the engine loop's choice
(``AsyncEngine._loop``): before the next step, or, overlapped, in its device wait.

asyncio only (the step's result comes back through ``loop.call_soon_threadsafe``); on another
backend ``run`` falls back to ``to_thread.run_sync``. The thread is started on the first call
and ended by :meth:`close`.
"""

from __future__ import annotations

import asyncio
from functools import partial
import queue
import threading
from typing import Any, Callable, Optional

import anyio
from anyio import to_thread


class StepThread:
    def __init__(self, limiter: anyio.CapacityLimiter, name: str = "enginecore-step"):
        """``limiter``: held while a step runs (the engine's one device limiter: loads, sleeps
        and the release wait for a step still running)."""
        self._limiter = limiter
        self._name = name
        self._jobs: "Optional[queue.SimpleQueue[Optional[tuple]]]" = None  # while the thread runs

    async def run(self, fn: Callable[[], Any], *, abandon_on_cancel: bool = False) -> Any:
        """``fn()`` on the step thread; its result (or its exception). Cancellation waits for
        ``fn`` to return (a step is never orphaned), then is raised as usual; with
        ``abandon_on_cancel`` it is raised at once while ``fn`` runs on (the load: the caller
        stops it and waits for it)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - not asyncio (trio)
            return await to_thread.run_sync(fn, limiter=self._limiter)
        try:
            self._limiter.acquire_nowait()
        except anyio.WouldBlock:  # the device is busy (a load): wait for it
            await self._limiter.acquire()
        try:
            jobs = self._jobs
            if jobs is None:
                jobs = self._jobs = queue.SimpleQueue()
                threading.Thread(target=_work, args=(jobs,), name=self._name, daemon=True).start()
            future = loop.create_future()
            jobs.put((fn, future, loop))
            with anyio.CancelScope(shield=not abandon_on_cancel):
                return await future
        finally:
            self._limiter.release()

    @staticmethod
    def poster(fn: Callable[..., None]) -> Optional[Callable[..., None]]:
        """A callable for the step thread that has ``fn(*args)`` run on this event loop (None
        when the backend is not asyncio). Call it from the loop's thread."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - not asyncio (trio)
            return None
        return partial(loop.call_soon_threadsafe, fn)

    def close(self) -> None:
        """End the thread once its current call (if any) returns. Idempotent; a later ``run``
        starts a new thread."""
        jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.put(None)


def _work(jobs: "queue.SimpleQueue[Optional[tuple]]") -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, future, loop = job
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            error = exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # pragma: no cover - the event loop is closed: no one is waiting
            pass
        del job, fn, future, loop, result, error


def _settle(future: "asyncio.Future", result: Any, exc: Optional[BaseException]) -> None:
    if future.done():  # an abandoned call (``abandon_on_cancel``): no one is waiting
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)

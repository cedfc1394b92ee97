"""``StepThread``: the one worker thread that runs :class:`engine.AsyncEngine`'s steps, handed
each step without first yielding to the event loop.

Why not ``anyio.to_thread.run_sync``: it yields to the event loop twice before the worker gets
the call (a checkpoint, then the limiter's). After a step, the engine loop dispatches the
outputs and every woken consumer (one task per stream, up to hundreds) runs during those
yields, so the next step started only once all of them had run: their whole time was added to
every step. Handed over at once, the next step runs on this thread while the consumers run on
the event loop (whenever the step leaves the GIL: model kernels, device waits).

asyncio only (the step's result comes back through ``loop.call_soon_threadsafe``); on another
backend ``run`` falls back to ``to_thread.run_sync``. The thread is started on the first step
and ended by :meth:`close`.
"""

from __future__ import annotations

import asyncio
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
        self._jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    async def run(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the step thread; its result (or its exception). Cancellation waits for
        ``fn`` to return (a step is never orphaned), then is raised as usual."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - not asyncio (trio)
            return await to_thread.run_sync(fn, limiter=self._limiter)
        try:
            self._limiter.acquire_nowait()
        except anyio.WouldBlock:  # something else holds the device: wait for it, as to_thread would
            return await to_thread.run_sync(fn, limiter=self._limiter)
        try:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
            future = loop.create_future()
            self._jobs.put((fn, future, loop))
            with anyio.CancelScope(shield=True):
                return await future
        finally:
            self._limiter.release()

    def close(self) -> None:
        """End the thread once its current step (if any) returns. Idempotent."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, future, loop = job
            result = None
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)
            del job, fn, future, loop, result


def _settle(future: "asyncio.Future", result: Any, exc: Optional[BaseException]) -> None:
    if future.done():  # pragma: no cover - the awaiting task is shielded, so never cancelled
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)

"""The engine loop of :class:`engine.AsyncEngine` (a mixin, like ``IntakeAPI`` and
``SleepAPI``): what happens around every step, top-down in :meth:`EngineLoop._loop`:

1. the inbox is applied (adds and aborts queued by the API, ``intake.py``);
2. the lifecycle is consulted (a drain's deadline, sleep, a dead rank);
3. one step -- ``EngineCore.step``: schedule, execute, update -- runs on the step thread, or a
   burst of steps back to back while nothing needs the loop (:meth:`EngineLoop._burst`);
4. its outputs go to their streams: at once, or held until the next step is launched and the
   step thread waits for the device (``_hold``; ``launched`` hands them over).

A failure anywhere ends every stream with ``EngineDeadError`` and releases the runner on the
step thread (``_die``); a clean end releases it too (``_release``).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Callable

import anyio
from anyio import from_thread

from engine.core.engine_core import EngineCore
from engine.errors import EngineDeadError
from engine.params import RequestOutput
from states import State

from .cpu_threads import governed
from .intake import _Add

log = logging.getLogger("enginecore.engine")


class EngineLoop:
    def _wake(self) -> None:
        self._wakeup.set()

    async def _loop(self) -> None:
        core = self.core
        assert core is not None
        post = self._stepper.poster(self._deliver_handed)

        def launched() -> None:  # on the step thread: the next step is launched
            if self._pending:  # taken here: in a step burst the step thread holds the next
                with self._held_lock:
                    self._handed.append(self._pending)
                    self._pending = []
                post()

        step = partial(core.step, launched) if post is not None else core.step
        runner = self.runner
        # deterministic mode keeps torch's thread count as it is: a BLAS may split a GEMM of
        # one shape differently at another count (not seen with MKL here, not promised)
        if (runner.device.type == "cpu" and not runner.tensor_parallel
                and not self.config.deterministic):
            step = governed(step, self.config.cpu_threads_max)
        if post is not None and self.config.step_burst_ms > 0:
            step = partial(self._burst, step, core, self.config.step_burst_ms * 1e-3)

        try:
            while True:
                if self._rank_error is not None:
                    raise self._rank_error
                self._apply_inbox(core)
                if self.lifecycle.state is State.DRAINING:
                    if time.monotonic() >= self._drain_deadline:
                        self._dispatch(core.abort_all(self._drain_reason))
                        self._abort_preparing(self._drain_reason)
                    if not core.has_work() and not self._tokenizing:
                        break
                elif self.lifecycle.state is State.SLEEPING and await self._sleep.tick(core):
                    break  # shut down while asleep
                elif self.lifecycle.state is State.PAUSED and not await self._pause.tick(core):
                    await self._wakeup.wait()  # settled: nothing steps until resume
                    self._wakeup = anyio.Event()
                    continue
                if not core.has_work():
                    await self._wakeup.wait()
                    self._wakeup = anyio.Event()
                    continue
                # NOTE: overlapped, a step's outputs are held until the next step is launched
                # and the step thread waits for the device (``launched``): the consumers they
                # wake run in that wait, while the step thread needs no GIL, instead of before
                # the launch. Otherwise the consumers run *before* the next step starts: run
                # beside it, they fight the step thread for the GIL (5 ms switch interval; on
                # CPU, measured 3-5 % slower). Their aborts are applied before the step after.
                # Except a request's first token (once per request): it is dispatched before the
                # next step is scheduled and launched, which would add their host time to its
                # TTFT. Its consumers then run while that step is launched and on the device,
                # not before it: in a burst of arrivals they are the clients' next requests too
                # (the loop's `then`, 4.3-5.3 ms with the device idle in H100 timelines); on a
                # simulated H200 (bench.prefix) the cached TTFT p50 went from 22.0-22.6 ms
                # (consumers first) to 19.8-21.8.
                self._bursting = True
                try:
                    outputs = await self._on_device(step)
                finally:
                    self._bursting = False
                if post is not None and core.in_flight and not _has_first_token(outputs):
                    self._hold(outputs)
                else:
                    self._dispatch(outputs)
                    if not core.in_flight:
                        await anyio.lowlevel.checkpoint()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._die(exc)
            if not isinstance(exc, Exception):
                raise
            return
        with anyio.CancelScope(shield=True):
            await self._release()

    def _burst(self, step: Callable[[], list], core: EngineCore, seconds: float) -> list:
        """On the step thread: steps back to back while nothing needs the event loop, for up to
        ``seconds``; the last step's outputs (the loop holds or dispatches them as one step's).

        NOTE: a round trip through the event loop between two steps (the step's result handed
        to the loop, the next step handed back) cost 0.2-0.3 ms a step on the H200 -- two
        thread wake-ups and the loop's own pass -- 4-5 % of a 7 ms decode step: the in-process
        engine's whole gap to the bare loop (``bench.throughput --timeline``). Here a
        step whose outputs are held (the next step's launch posts their delivery, as in the
        loop) is followed at once by the next. The burst ends -- and the loop takes over as
        before -- when the loop has work: adds or aborts queued (``_inbox``), a transition
        (drain, sleep, failure), a step that carries first tokens (dispatched before the next
        launch), nothing in flight; and after ``seconds``, which bounds how long a
        cancellation of the loop waits. Until it ends, ``_pending`` is the step thread's."""
        end = time.perf_counter() + seconds
        while True:
            outputs = step()
            if not (core.in_flight and not self._inbox and self._rank_error is None
                    and self.lifecycle.state is State.SERVING and time.perf_counter() < end
                    and not _has_first_token(outputs)):
                return outputs
            with self._held_lock:
                if self._pending:  # not handed to the loop by a launch (a step applied first)
                    self._pending.extend(outputs)
                else:
                    self._pending = outputs

    def _rank_failed(self, exc: BaseException) -> None:
        """Tensor parallel: another rank died while serving (called on the loop thread by the
        runner's watcher). Fail now -- every stream gets EngineDeadError at once, whatever the
        step thread is waiting for -- and let the loop release (the other ranks are stopped)."""
        if self._death is not None or self.lifecycle.state in (State.SHUTDOWN, State.FAILED):
            return
        log.error("engine failed: %s", exc)
        self._rank_error = exc
        self._fail_streams(exc)
        self._wake()

    def _fail_streams(self, exc: BaseException) -> None:
        """FAILED, and every stream in flight gets ``EngineDeadError`` (once: the sinks go),
        after the outputs it was due."""
        self._flush_pending()
        self._death = exc
        if self.lifecycle.may("fail"):
            self.lifecycle.trigger("fail")
        err = EngineDeadError("engine failed", exc)
        sinks, self._sinks = self._sinks, {}
        self._inbox.clear()
        for sink in sinks.values():
            sink(err)

    async def _on_device(self, fn: Callable, *args):
        """``fn(*args)`` on the step thread, where every step runs (device work after the load:
        steps, sleep/wake, weight updates, the release), one at a time."""
        return await self._stepper.run(partial(fn, *args) if args else fn)

    async def _release(self) -> None:
        self.grammars.close()
        self._close_transfer()
        try:
            await self._on_device(self.runner.shutdown)
        finally:
            self._stepper.close()
        self.core = None
        self.lifecycle.trigger("shutdown")
        self._stopped.set()

    async def _die(self, exc: BaseException) -> None:
        log.error("engine failed: %r", exc)
        self._fail_streams(exc)
        self._close_transfer()
        try:
            # after a step still running on the step thread (they take turns there)
            await self._on_device(self.runner.shutdown)
        finally:
            self._stepper.close()
            self.core = None
            self.lifecycle.trigger("shutdown")
            self._stopped.set()

    def _apply_inbox(self, core: EngineCore) -> None:
        paused = self.lifecycle.state is State.PAUSED
        while self._inbox:
            item = self._inbox.popleft()
            if paused and type(item) is _Add:
                self._pause.park(item)  # queued until resume (engine/serving/pause.py)
            elif type(item) is _Add:
                try:
                    core.add_request(item.request_id, item.ids, item.params, item.grammar,
                                     item.client)
                except Exception as exc:  # this request's own input: it ends, the engine serves on
                    log.warning("request %s refused at admission: %s", item.request_id, exc)
                    self._dispatch([RequestOutput(
                        request_id=item.request_id, finished=True, finish_reason="error",
                        reason=str(exc), num_prompt_tokens=len(item.ids))])
            else:
                out = core.abort(item.request_id, item.reason)
                if out is None and paused:
                    out = self._pause.unpark_abort(item.request_id, item.reason)
                if out is not None:
                    self._dispatch([out])

    def _abort_preparing(self, reason: str) -> None:
        """A drain's deadline: requests still tokenizing or waiting for their grammar end now
        with "abort" (their worker finds the request gone and drops its result)."""
        for rid in list(self._tokenizing):
            self._tokenizing.pop(rid)
            self._dispatch([RequestOutput(request_id=rid, finished=True, finish_reason="abort",
                                          reason=reason)])

    def _hold(self, outputs: list[RequestOutput]) -> None:
        """Keep ``outputs`` until ``_flush_pending`` (the loop has it run once the next step is
        launched and the step thread waits for the device) or the next ``_dispatch``."""
        self._flush_pending()
        self._pending = outputs

    def _flush_pending(self) -> None:
        # what a launch handed over first (older), then what is held; under the lock: on a
        # failure (_fail_streams) the step thread may be handing _pending over meanwhile
        with self._held_lock:
            handed = list(self._handed)
            self._handed.clear()
            pending, self._pending = self._pending, []
        for outputs in handed:
            self._deliver(outputs)
        if pending:
            self._deliver(pending)

    def _deliver_handed(self) -> None:
        """On the loop, posted by a launch (``AsyncEngine._loop``): deliver what it handed over
        (unless a flush did already)."""
        while True:
            with self._held_lock:
                if not self._handed:
                    return
                outputs = self._handed.popleft()
            self._deliver(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # held outputs are older: they go first (in a step burst they are the step thread's,
        # and what the loop dispatches then is of requests outside the core)
        if self._pending and not self._bursting:
            self._flush_pending()
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        sinks = self._sinks
        version = self._sleep.weight_version
        for out in outputs:
            if version:
                out.weight_version = version
            sink = sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del sinks[out.request_id]
                self.admission.finished(out.request_id)
            sink(out)


def _has_first_token(outputs) -> bool:
    """Whether one of ``outputs`` carries its request's first tokens (all it has so far)."""
    for out in outputs:
        if out.token_ids and out.num_output_tokens == len(out.token_ids):
            return True
    return False


def _from_watcher(token, fn, exc: BaseException) -> None:
    """Run ``fn(exc)`` on the event loop from a watcher thread (nothing if the loop is gone)."""
    try:
        from_thread.run_sync(fn, exc, token=token)
    except Exception:  # RunFinishedError and friends: the engine has stopped already
        pass

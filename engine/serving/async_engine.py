"""``AsyncEngine``: the anyio engine loop, the lifecycle owner and the in-process API.

One task (the loop) runs steps on a single worker thread, so the event loop stays responsive
while the model runs. API calls never touch the core directly: they queue adds and aborts that
the loop applies between steps. Every transition of the lifecycle happens on the event-loop
thread through :class:`states.Lifecycle`.

Guarantee: every request accepted by :meth:`generate`/:meth:`submit` receives exactly one
terminal output (finished, aborted with a reason) or, if the engine dies, ``EngineDeadError``.
"""

from __future__ import annotations

from collections import deque
from contextlib import asynccontextmanager
from functools import partial
import logging
import math
import threading
import time
from typing import AsyncIterator, Callable, Optional

import anyio
from anyio import from_thread, to_thread

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.stats import EngineStats, engine_stats, health_figures
from engine.errors import EngineDeadError, EngineShutdownError
from engine.interface import Health, TokenizerInfo, unavailable_error
from engine.runner.model_runner import ModelRunner
from engine.structured.grammars import GrammarCache, GrammarService
from states import Lifecycle, State

from .admission import Admission
from .cpu_threads import governed
from .intake import STEPPING, InboxItem, IntakeAPI
from .request_stream import Sink
from .sleep import SleepAPI, SleepController
from .step_thread import StepThread

log = logging.getLogger("enginecore.engine")





class AsyncEngine(IntakeAPI, SleepAPI):
    def __init__(self, config: EngineConfig, *, check_integrity: bool = False):
        self.config = config.validate()
        self.lifecycle = Lifecycle()
        self.runner = ModelRunner(config)
        self.core: Optional[EngineCore] = None
        self._check_integrity = check_integrity
        self._sinks: dict[str, Sink] = {}
        self._pending: list = []  # outputs held for the step thread's next device wait (_hold)
        self._bursting = False  # a step burst runs: _pending is the step thread's (_burst)
        #: outputs a launch took from _pending on the step thread, posted to the loop
        #: (_deliver_handed); with _pending, under _held_lock while the step thread may write
        #: them: a failure's flush (_fail_streams) must see what is on its way to the loop
        self._handed: deque[list] = deque()
        self._held_lock = threading.Lock()
        self._inbox: deque[InboxItem] = deque()
        self.admission = Admission(self.runner, max_waiting_requests=config.max_waiting_requests,
                                   max_queued_tokens=config.max_queued_tokens)
        self._tg: Optional[anyio.abc.TaskGroup] = None
        #: accepted requests whose long prompt is tokenized on a worker thread -> abort reason
        self._tokenizing: dict[str, Optional[str]] = {}
        self._wakeup = anyio.Event()
        self._stopped = anyio.Event()
        self._limiter = anyio.CapacityLimiter(1)
        self._stepper = StepThread(self._limiter)
        self._death: Optional[BaseException] = None
        self._rank_error: Optional[BaseException] = None  # tensor parallel: a rank died
        self._drain_deadline = math.inf
        self._drain_reason = "drain timeout"
        self._started = time.monotonic()
        self._loop_thread = threading.get_ident()
        self._listeners: list[Callable[[State, State], None]] = []
        self.lifecycle.on_change(self._notify)
        self._sleep = SleepController(self)
        #: output constraints compiled off the event loop, cached (engine/structured/)
        self.grammars = GrammarService(
            lambda: self.runner.tokenizer, lambda: self.runner.model_config.vocab_size,
            compile_timeout=config.grammar_compile_timeout,
            cache=GrammarCache(config.grammar_cache_entries, config.grammar_cache_bytes))
        self.lifecycle.describe_in_flight(self._in_flight)  # for the transition's log line

    # -- opening and closing ------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def open(cls, config: EngineConfig, **kw) -> AsyncIterator["AsyncEngine"]:
        """Load, start serving, yield; on exit drain(0) and release, whatever happened.

        A failure (e.g. ``CheckpointError`` from loading, or the caller's own exception) is
        raised as itself, not wrapped in the task group's ``ExceptionGroup``."""
        engine = cls(config, **kw)
        try:
            async with anyio.create_task_group() as tg:
                await engine.start(tg)
                try:
                    yield engine
                finally:
                    with anyio.CancelScope(shield=True):
                        await engine._close_quietly()
        except BaseExceptionGroup as group:
            if len(group.exceptions) != 1:
                raise
            exc = group.exceptions[0]
            context = exc.__context__
            del group
            try:
                raise exc
            finally:
                exc.__context__ = context  # not the group we unwrapped
                del exc, context

    async def start(self, tg) -> None:
        """Load the model on the step thread (stoppable by cancellation), then SERVING."""
        self._loop_thread = threading.get_ident()
        self._tg = tg
        if self.runner.tensor_parallel:
            self.runner.watch_ranks(partial(_from_watcher, anyio.lowlevel.current_token(),
                                            self._rank_failed))
        stop = threading.Event()
        done = threading.Event()

        def load() -> None:
            try:
                self.runner.load(stop.is_set)
            finally:
                done.set()

        try:
            await self._stepper.run(load, abandon_on_cancel=True)
        except BaseException:
            stop.set()
            with anyio.CancelScope(shield=True):
                while not done.is_set():
                    await anyio.sleep(0.01)
                await to_thread.run_sync(self.runner.shutdown)
                self.lifecycle.trigger("shutdown")
                self._stopped.set()
            raise
        self.lifecycle.trigger("load")
        self.core = EngineCore(self.runner, check_integrity=self._check_integrity)
        self.lifecycle.trigger("serve")
        tg.start_soon(self._loop)

    async def _close_quietly(self) -> None:
        if self.lifecycle.state in (State.SERVING, State.SLEEPING, State.DRAINING):
            await self.drain(0)
        await self._stopped.wait()

    async def drain(self, timeout: Optional[float] = None, reason: str = "drain timeout") -> None:
        """Stop accepting; let in-flight requests finish until ``timeout`` seconds, then abort
        the rest with ``reason``; release; SHUTDOWN. A second call shortens the deadline."""
        state = self.lifecycle.state
        if state is State.SERVING:
            self.lifecycle.trigger("drain")
        elif state is State.SLEEPING:  # what is left is released from SLEEPING (engine/serving/sleep.py)
            self._sleep.shutdown(timeout, reason)
        elif state is not State.DRAINING:
            self._raise_unavailable("drain")
        deadline = time.monotonic() + (math.inf if timeout is None else max(0.0, timeout))
        if deadline < self._drain_deadline:
            self._drain_deadline, self._drain_reason = deadline, reason
        self._wake()
        await self._stopped.wait()
        if self._death is not None:
            raise EngineDeadError("engine failed while draining", self._death)

    async def shutdown(self) -> None:
        """``drain(0)``: abort everything in flight (terminal outputs sent), release."""
        await self.drain(0, reason="shutdown")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # -- state ---------------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self.lifecycle.state

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    @property
    def model(self) -> str:
        """The model's name as the configuration gave it."""
        return self.config.model

    @property
    def max_model_len(self) -> int:
        """The context limit (0 until loaded)."""
        return self.runner.max_model_len if self.lifecycle.state is not State.INIT else 0

    @property
    def failure(self) -> Optional[BaseException]:
        """Why the engine failed (None unless it did)."""
        return self._death

    @property
    def exit_code(self) -> Optional[int]:
        """None while the engine runs; once stopped, 0 after a clean shutdown, 1 after a failure
        (the process exit codes of ``enginecore serve``)."""
        if not self._stopped.is_set():
            return None
        return 1 if self._death is not None else 0

    async def apply_chat_template(self, messages: list[dict],
                                  add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's chat template (on a worker thread: a large
        conversation must not stall the event loop)."""
        return await to_thread.run_sync(self.runner.tokenizer.apply_chat_template, messages,
                                        add_generation_prompt)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (on a worker thread; bounded like a prompt)."""
        if self.lifecycle.state in (State.INIT, State.SHUTDOWN, State.FAILED):
            self._raise_unavailable("tokenize")
        return await self.admission.tokenize_text(text, add_special_tokens)

    async def detokenize(self, ids: list[int], each: bool = False) -> list[str]:
        """``[the text of ids]``, or with ``each`` one string per token (its bytes as UTF-8)."""
        if self.lifecycle.state in (State.INIT, State.SHUTDOWN, State.FAILED):
            self._raise_unavailable("detokenize")
        return await self.admission.detokenize(ids, each)

    async def token_bytes(self) -> list[bytes]:
        """Every token's bytes, by id (the tokenizer's table, built once)."""
        if self.runner.tokenizer is None or self.lifecycle.state in (State.INIT, State.SHUTDOWN, State.FAILED):
            self._raise_unavailable("token_bytes")
        return self.runner.tokenizer.byte_table

    def tokenizer_info(self) -> TokenizerInfo:
        """The tokenizer's description (all unknown until the model is loaded)."""
        tok = self.runner.tokenizer
        if tok is None or self.runner.model_config is None:
            return TokenizerInfo()
        return TokenizerInfo(tok.chat_template, tok.bos_token, tok.eos_token,
                             self.runner.model_config.vocab_size, self.config.max_logprobs)

    def on_state_change(self, listener: Callable[[State, State], None]) -> None:
        self._listeners.append(listener)

    def _notify(self, old: State, new: State) -> None:
        for listener in list(self._listeners):
            listener(old, new)

    async def health(self) -> Health:
        return self.health_nowait()

    def health_nowait(self) -> Health:
        st = self.lifecycle.state
        core = self.core if st in STEPPING else None
        h = self._in_flight()
        return Health(state=st, live=self.lifecycle.live, ready=st is State.SERVING,
                      running=h["running"], waiting=h["waiting"],
                      kv_usage=core.kv_usage if core else 0.0, **health_figures(self.core))

    def _in_flight(self) -> dict[str, int]:
        core = self.core if self.lifecycle.state in STEPPING else None
        running = core.num_running if core else 0
        return {"running": running, "waiting": max(0, len(self._sinks) - running)}

    def statistics(self) -> EngineStats:
        return engine_stats(self.lifecycle.state, self.core, self.health_nowait(),
                            time.monotonic() - self._started)

    def _require_accepting(self) -> None:
        if self.lifecycle.state is not State.SERVING:
            self._raise_unavailable("generate")

    def _raise_unavailable(self, call: str):
        raise unavailable_error(self.lifecycle.state, call, self._death)

    def _closed_error(self) -> Exception:
        if self._death is not None:
            return EngineDeadError("engine is dead", self._death)
        return EngineShutdownError("engine shut down")

    # -- the loop -------------------------------------------------------------------------------
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
        if runner.device.type == "cpu" and not runner.tensor_parallel:
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
        try:
            # after a step still running on the step thread (they take turns there)
            await self._on_device(self.runner.shutdown)
        finally:
            self._stepper.close()
            self.core = None
            self.lifecycle.trigger("shutdown")
            self._stopped.set()


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

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
from anyio import to_thread

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.stats import EngineStats, engine_stats, health_figures
from engine.core.warmup import warm_up
from engine.errors import EngineDeadError, EngineShutdownError
from engine.interface import Health, TokenizerInfo, unavailable_error
from engine.runner.model_runner import ModelRunner
from engine.structured.grammars import GrammarCache, GrammarService
from states import Lifecycle, State

from .admission import Admission
from .intake import STEPPING, InboxItem, IntakeAPI
from .loop import EngineLoop, _from_watcher
from .pause import PauseAPI, PauseController
from .transfer import TransferAPI
from .request_stream import Sink
from .sleep import SleepAPI, SleepController
from .step_thread import StepThread

log = logging.getLogger("enginecore.engine")


class AsyncEngine(IntakeAPI, EngineLoop, SleepAPI, PauseAPI, TransferAPI):
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
        self.admission = Admission(
            self.runner, max_waiting_requests=config.max_waiting_requests,
            max_queued_tokens=config.max_queued_tokens,
            max_waiting_per_client=config.max_waiting_per_client,
            max_queued_tokens_per_client=config.max_queued_tokens_per_client)
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
        self._pause = PauseController(self)
        #: output constraints compiled off the event loop, cached (engine/structured/)
        self.grammars = GrammarService(
            lambda: self.runner.tokenizer, lambda: self.runner.model_config.vocab_size,
            compile_timeout=config.grammar_compile_timeout,
            compile_workers=config.grammar_compile_workers,
            cache=GrammarCache(config.grammar_cache_entries, config.grammar_cache_bytes),
            refused=self._grammar_refused)
        self.lifecycle.describe_in_flight(self._in_flight)  # for the transition's log line

    def _grammar_refused(self, key: str) -> Optional[str]:
        budget = getattr(self.runner, "grammar_budget", None)  # (structured/budget.py)
        return budget.refused(key) if budget is not None else None

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
        t0 = time.monotonic()
        warm = [0.0]

        def load() -> None:
            try:
                self.runner.load(stop.is_set)
                if self.config.warms_up() and self.runner.loaded and not stop.is_set():
                    warm[0] = warm_up(self.runner, stop.is_set)  # before SERVING: ready is warm
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
        log.info("ready in %.2fs (warm-up %s)", time.monotonic() - t0,
                 f"{warm[0]:.2f}s" if self.config.warms_up() else "off")
        tg.start_soon(self._loop)

    async def _close_quietly(self) -> None:
        if self.lifecycle.state in (State.SERVING, State.PAUSED, State.SLEEPING, State.DRAINING):
            await self.drain(0)
        await self._stopped.wait()

    async def drain(self, timeout: Optional[float] = None, reason: str = "drain timeout") -> None:
        """Stop accepting; let in-flight requests finish until ``timeout`` seconds, then abort
        the rest with ``reason``; release; SHUTDOWN. A second call shortens the deadline."""
        state = self.lifecycle.state
        if state in (State.SERVING, State.PAUSED):  # PAUSED: what it held is finished first
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

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                                  **options) -> str:
        """Render ``messages`` with the model's chat template (on a worker thread: a large
        conversation must not stall the event loop); ``options``: ``tools``, ``documents``,
        ``continue_final_message``, ``template_kwargs`` (engine.loader.tokenizer.render_chat_template)."""
        render = partial(self.runner.tokenizer.apply_chat_template, messages,
                                   add_generation_prompt, **options)
        return await to_thread.run_sync(render)

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids (on a worker thread; bounded like a prompt)."""
        if self.lifecycle.state in (State.INIT, State.SHUTDOWN, State.FAILED):
            self._raise_unavailable("tokenize")
        return await self.admission.tokenize_text(text, add_special_tokens)

    async def detokenize(self, ids: list[int], each: bool = False,
                         tokens: bool = False) -> list[str]:
        """``[the text of ids]``, or with ``each`` one string per token (its bytes as UTF-8),
        or with ``tokens`` each id's vocabulary entry (e.g. "Ġhello")."""
        if self.lifecycle.state in (State.INIT, State.SHUTDOWN, State.FAILED):
            self._raise_unavailable("detokenize")
        return await self.admission.detokenize(ids, each, tokens)

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
                      kv_usage=core.kv_usage if core else 0.0,
                      sleep_level=self._sleep.level if st is State.SLEEPING else 0,
                      deterministic=self.config.deterministic, **health_figures(self.core))

    def _in_flight(self) -> dict[str, int]:
        core = self.core if self.lifecycle.state in STEPPING else None
        running = core.num_running if core else 0
        return {"running": running, "waiting": max(0, len(self._sinks) - running)}

    def statistics(self) -> EngineStats:
        return engine_stats(self.lifecycle.state, self.core, self.health_nowait(),
                            time.monotonic() - self._started)

    def _require_accepting(self) -> None:
        state = self.lifecycle.state
        if state is not State.SERVING and (state is not State.PAUSED
                                           or self.config.reject_while_paused):
            self._raise_unavailable("generate")

    def _raise_unavailable(self, call: str):
        raise unavailable_error(self.lifecycle.state, call, self._death)

    def _closed_error(self) -> Exception:
        if self._death is not None:
            return EngineDeadError("engine is dead", self._death)
        return EngineShutdownError("engine shut down")

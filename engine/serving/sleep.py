"""Sleep mode of :class:`engine.AsyncEngine`: ``sleep``, ``wake_up``, ``update_weights``.

The phases, as the lifecycle sees them:

1. ``sleep(level, mode, timeout)`` on a SERVING engine moves it to SLEEPING at once: admission
   stops (new requests get the retryable :class:`~engine.errors.EngineSleepingError`; health
   says ``live=true, ready=false, state="sleeping"``). ``mode="abort"`` ends the requests in
   flight right away (``finish_reason="abort"``, reason ``"sleep"``); ``mode="wait"`` lets them
   finish -- still SLEEPING, the loop keeps stepping them -- and aborts what is left at
   ``timeout``. So "no longer accepting, work still finishing" is the SLEEPING state itself,
   as DRAINING is for a drain.
2. Once no request is left, the loop frees the device (``ModelRunner.sleep``, on the worker
   thread) and ``sleep()`` returns. Level 1 keeps the weights in host memory, level 2 drops
   them (a wake reloads them from their checkpoint).
3. While asleep the loop is parked here, serving calls one at a time: ``wake_up(tags)``
   (``"weights"``, ``"kv_cache"``; both by default -- the engine is SERVING again once both are
   back) and ``update_weights*``. A call that fails (a refused checkpoint, memory that is not
   there at wake) raises to its caller and leaves the engine asleep, nothing leaked
   (``ModelRunner.wake`` releases what it brought back).
4. ``drain``/``shutdown`` (a SIGTERM) while SLEEPING: the requests still finishing get the
   drain's deadline, then what is left is released: SLEEPING -> SHUTDOWN.

Every call that waits on the loop is answered: when the engine fails or shuts down first, it
raises ``EngineDeadError`` / ``EngineShutdownError``.

With tensor parallelism the runner takes every rank along (engine/tp/control.py): each rank
sleeps, wakes and writes its slice of the same update; nothing here differs.
"""

from __future__ import annotations

from collections import deque
from functools import partial
import math
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

import anyio

from engine.errors import BadRequestError, EngineDeadError, EngineShutdownError
from states import State

if TYPE_CHECKING:  # pragma: no cover  (torch-free at run time: the IPC client imports this module)
    from engine.core.engine_core import EngineCore
    from engine.memory.weights import NamedTensors

TAGS = ("weights", "kv_cache")
MODES = ("abort", "wait")


class _Call:
    """One caller waiting for the loop: ``kind`` is "sleep", "wake", "update" or "tensors"."""

    __slots__ = ("kind", "arg", "done", "error", "version")

    def __init__(self, kind: str, arg: Any = None) -> None:
        self.kind = kind
        self.arg = arg
        self.done = anyio.Event()
        self.error: Optional[BaseException] = None
        self.version: Optional[int] = None

    async def result(self) -> None:
        await self.done.wait()
        if self.error is not None:
            try:
                raise self.error
            finally:
                self.error = None  # no reference cycle through the traceback


def check_tags(tags: Optional[Sequence[str]]) -> tuple[str, ...]:
    if tags is None:
        return TAGS
    if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise BadRequestError("tags must be a list of strings")
    bad = [t for t in tags if t not in TAGS]
    if bad or not tags:
        raise BadRequestError(f"tags must be a non-empty subset of {list(TAGS)}; got {list(tags)}")
    return tuple(dict.fromkeys(tags))


class SleepAPI:
    """The sleep-mode methods of :class:`~engine.serving.async_engine.AsyncEngine` (mixed in)."""

    _sleep: "SleepController"
    lifecycle: Any

    async def sleep(self, level: int = 1, mode: str = "abort", timeout: Optional[float] = None,
                    tags: Optional[Sequence[str]] = None) -> None:
        """Stop admission, end (``mode="abort"``) or finish (``"wait"``, aborting at ``timeout``)
        the requests in flight, then free the device: level 1 keeps the weights in host memory,
        level 2 drops them; ``tags=["kv_cache"]`` frees only the KV cache (with model state and
        graphs), the weights stay on the device. Returns once the memory is freed; SLEEPING
        until :meth:`wake_up` brings back what was freed."""
        await self._sleep.sleep(level, mode, timeout, check_tags(tags))

    async def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both); SERVING once both are back."""
        await self._sleep.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.lifecycle.state is State.SLEEPING

    async def update_weights(self, path: str, version: Optional[int] = None) -> None:
        """Load the checkpoint at ``path`` (same architecture) into the weights, while SLEEPING
        (any level), PAUSED or LOADED; validated in full first: a mismatch raises, the old
        weights stay; the prefix cache is invalidated. ``version`` (default: the last + 1)
        is the ``weight_version`` every output carries from then on."""
        await self._sleep.update_weights("update", path, version)

    async def update_weights_from_tensors(self, named_tensors: "NamedTensors",
                                          version: Optional[int] = None) -> None:
        """As :meth:`update_weights`, from ``(name, tensor)`` pairs (or a dict): any subset of
        the weights, by the names :meth:`weight_info` lists, each of its shape and dtype (all
        checked before the first is copied; copied in place). In-process only."""
        await self._sleep.update_weights("tensors", (named_tensors, True), version)

    def weight_info(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Every updatable parameter's (name, shape, dtype): what a trainer builds its transfer
        plan from, in the names ``update_weights_*`` take."""
        if self.runner.model_config is None:
            self._raise_unavailable("weight_info")  # type: ignore[attr-defined]
        return self.runner.weight_info()  # type: ignore[attr-defined]

    @property
    def weight_version(self) -> int:
        """The version of the weights in use (0: as loaded); every output carries it."""
        return self._sleep.weight_version


class SleepController:
    """The engine's sleep state machine beside the lifecycle; the engine loop calls
    :meth:`tick` while SLEEPING, the API methods queue calls for it."""

    def __init__(self, engine: Any) -> None:  # the AsyncEngine it serves (no import: no circle)
        self._engine = engine
        self.level = 0
        self.asleep = False  # the device memory is freed
        self.deadline = math.inf
        self.reason = "sleep"
        self.host_bytes = 0  # what the last sleep kept in host memory
        self.tags: tuple[str, ...] = TAGS  # what the last sleep frees
        self.weight_version = 0
        self.timings: dict[str, float] = {}  # seconds of the last sleep / wake, by part
        self._shutdown = False
        self._sleep_call: Optional[_Call] = None
        self._calls: deque[_Call] = deque()
        self._kick = anyio.Event()
        engine.lifecycle.on_change(self._on_change)

    # -- the API (event-loop thread) --------------------------------------------------------------
    async def sleep(self, level: int, mode: str, timeout: Optional[float],
                    tags: tuple[str, ...] = TAGS) -> None:
        eng = self._engine
        if level not in (1, 2) or isinstance(level, bool):
            raise BadRequestError(f"sleep level must be 1 or 2, not {level!r}")
        if mode not in MODES:
            raise BadRequestError(f"sleep mode must be one of {list(MODES)}, not {mode!r}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise BadRequestError(f"sleep timeout must be a number >= 0 or None, not {timeout!r}")
        self._refuse_if_stopped(eng.lifecycle.state, "sleep")
        eng.lifecycle.trigger("sleep")  # InvalidTransitionError unless SERVING
        start = time.monotonic()
        self.level, self.reason, self._shutdown, self.tags = level, "sleep", False, tags
        self.deadline = start if mode == "abort" else start + (math.inf if timeout is None else timeout)
        self.timings = {}
        call = self._sleep_call = _Call("sleep")
        eng._wake()
        await call.result()

    async def wake_up(self, tags: Optional[Sequence[str]]) -> None:
        tags = check_tags(tags)
        await self._queue("wake_up", _Call("wake", tags), State.SLEEPING)

    async def update_weights(self, kind: str, arg: Any, version: Optional[int] = None) -> None:
        """``kind``: "update" (``arg`` a checkpoint path) or "tensors" (name/tensor pairs and
        whether a subset is allowed)."""
        eng = self._engine
        if version is not None and (type(version) is not int or not 0 <= version < 2**63):
            raise BadRequestError(f"version must be an integer >= 0, not {version!r}")
        state = eng.lifecycle.state
        if state in (State.LOADED, State.PAUSED):
            async with eng._pause.lock:  # a resume waits for the update to be done
                if state is State.PAUSED:  # nothing steps once the pause has settled
                    await eng._pause.settled.wait()
                    eng.lifecycle.require("update_weights", State.PAUSED)
                await eng._on_device(self._update_fn(kind), arg)
                self._updated(eng.core, version)  # requests frozen by the pause keep their blocks
            return
        call = _Call(kind, arg)
        call.version = version
        await self._queue("update_weights", call, State.SLEEPING, State.LOADED)

    def _update_fn(self, kind: str):
        runner = self._engine.runner
        if kind == "update":
            return runner.update_weights
        if kind == "distributed":  # (receiver, checked metadata, bucket bytes): engine/serving/transfer.py
            return lambda arg: arg[0].receive(arg[1], partial(runner.update_weights_from_tensors,
                                                              partial=True), arg[2])
        if kind == "ipc":  # (checked IpcHandles, opened flag): engine/serving/transfer.py
            return lambda arg: _from_ipc(runner, arg)
        return lambda arg: runner.update_weights_from_tensors(*arg)

    def _updated(self, core: Optional["EngineCore"], version: Optional[int]) -> None:
        """New weights: the version outputs carry, and no cached prefix reused."""
        self.weight_version = self.weight_version + 1 if version is None else version
        if core is not None:
            core.blocks.reset_prefix_cache(self.weight_version)

    def shutdown(self, timeout: Optional[float], reason: str) -> None:
        """A drain/shutdown while SLEEPING: requests still finishing get ``timeout``, then the
        loop ends and the engine releases what is left."""
        self._shutdown = True
        deadline = time.monotonic() + (math.inf if timeout is None else max(0.0, timeout))
        if deadline < self.deadline:
            self.deadline, self.reason = deadline, reason
        self._kick.set()
        self._engine._wake()

    async def _queue(self, what: str, call: _Call, *states: State) -> None:
        lc = self._engine.lifecycle
        self._refuse_if_stopped(lc.state, what)
        lc.require(what, *states)
        if self._shutdown:
            raise EngineShutdownError(f"engine is shutting down; {what}() is not possible")
        self._calls.append(call)
        self._kick.set()
        await call.result()

    def _refuse_if_stopped(self, state: State, what: str) -> None:
        if state in (State.FAILED, State.SHUTDOWN) or self._engine.failure is not None:
            self._engine._raise_unavailable(what)

    def _on_change(self, old: State, new: State) -> None:
        if new not in (State.FAILED, State.SHUTDOWN):
            return
        death = self._engine.failure
        calls = list(self._calls) + ([self._sleep_call] if self._sleep_call else [])
        self._calls.clear()
        self._sleep_call = None
        for call in calls:
            if not call.done.is_set():
                call.error = (EngineDeadError("engine failed", death) if new is State.FAILED
                              else EngineShutdownError(f"engine shut down before {call.kind} completed"))
                call.done.set()

    # -- the loop's side (the engine loop task) ---------------------------------------------------
    async def tick(self, core: "EngineCore") -> bool:
        """Called by the loop in SLEEPING before each step. Aborts at the deadline; once no
        request is left frees the device and serves calls until woken (returns False: the loop
        goes on SERVING) or shut down (returns True: the loop ends and releases)."""
        eng = self._engine
        if time.monotonic() >= self.deadline:
            eng._dispatch(core.abort_all(self.reason))
        if core.has_work() or eng._tokenizing:
            return False  # still finishing (mode="wait"): the loop steps on
        if self._shutdown:
            return True
        if not self.asleep:
            await self._fall_asleep()
        return await self._serve_calls(core)

    async def _fall_asleep(self) -> None:
        eng = self._engine
        t0 = time.perf_counter()
        self.host_bytes = await eng._on_device(eng.runner.sleep, self.level, self.tags)
        self.timings["sleep_s"] = time.perf_counter() - t0
        self.asleep = True
        call, self._sleep_call = self._sleep_call, None
        if call is not None:
            call.done.set()

    async def _serve_calls(self, core: "EngineCore") -> bool:
        eng, runner = self._engine, self._engine.runner
        while True:
            if self._shutdown:
                return True
            if not self._calls:
                self._kick = anyio.Event()
                await self._kick.wait()
                continue
            call = self._calls.popleft()
            t0 = time.perf_counter()
            try:
                if call.kind == "wake":
                    await eng._on_device(runner.wake, call.arg)
                    core.reset_kv()  # a new cache: nothing cached is valid
                else:
                    await eng._on_device(self._update_fn(call.kind), call.arg)
                    self._updated(None, call.version)
                    core.reset_kv(self.weight_version)
            except Exception as exc:  # this call failed; the engine stays asleep
                call.error = exc
            self.timings[f"{call.kind}_s"] = time.perf_counter() - t0
            awake = call.kind == "wake" and call.error is None and not runner.asleep
            if awake:
                self.asleep = False
                self.deadline = math.inf
                eng.lifecycle.trigger("wake")
            call.arg = None  # drop the caller's tensors
            call.done.set()
            if awake:
                return False


__all__ = ["SleepAPI", "SleepController", "TAGS", "MODES", "check_tags"]


def _from_ipc(runner: Any, arg: Any) -> None:
    """The trainer's storages opened on the device thread, written in place, then let go
    (``arg``: the checked handles and a flag the caller reads: opened already)."""
    from engine.weight_ipc import opened

    handles, flag = arg
    flag.append(True)
    with opened(handles, runner.device) as tensors:
        runner.update_weights_from_tensors(tensors, partial=True)

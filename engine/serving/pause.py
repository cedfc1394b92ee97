"""Pause and resume of :class:`engine.AsyncEngine` without freeing memory (``pause``,
``resume``, ``is_paused``) and ``abort_all``: what an RL loop needs around a weight update.

``pause(mode)`` on a SERVING engine moves it to PAUSED at once; no step runs while PAUSED
(once the pause has settled):

* ``"abort"``: the requests in flight end now with their partial output (``finish_reason=
  "abort"``, reason ``"pause"``); those still tokenizing or compiling end when that is done.
* ``"wait"``: the requests in flight run to their end (the loop keeps stepping them, and only
  them); at ``timeout`` what is left is aborted as with ``"abort"``.
* ``"keep"``: the requests in flight are frozen where they are -- their KV blocks kept, a step
  already launched applied first -- and continue on the same streams after ``resume()``.

``pause()`` returns once the pause has settled (nothing steps any more). Requests submitted
while PAUSED are accepted up to the admission limits and queued (held by the loop, not given to
the scheduler: ``_parked``) until ``resume()``; with ``EngineConfig.reject_while_paused`` they
are refused with the retryable :class:`~engine.errors.EnginePausedError` instead. An abort of a
queued request ends it at once. Drain, shutdown and sleep work from PAUSED: the queued requests
go back to the loop's inbox and are handled as any accepted request (finished, or aborted at the
deadline).

``abort_all()`` ends every request in flight (running, waiting, queued while paused, still
tokenizing) at the next step boundary, each with its partial output as its terminal output.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import anyio

from engine.errors import BadRequestError
from engine.params import RequestOutput
from states import State

PAUSE_MODES = ("abort", "wait", "keep")


class PauseAPI:
    """The pause-mode methods of :class:`~engine.serving.async_engine.AsyncEngine` (mixed in)."""

    _pause: "PauseController"
    lifecycle: Any

    async def pause(self, mode: str = "abort", timeout: Optional[float] = None) -> None:
        """SERVING -> PAUSED; returns once nothing steps any more (see the module docstring).
        On an engine already PAUSED, waits for that pause to settle."""
        await self._pause.pause(mode, timeout)

    async def resume(self) -> None:
        """PAUSED -> SERVING (after a weight update under way): frozen requests continue,
        queued ones are scheduled. A no-op on a SERVING engine; any other state raises."""
        async with self._pause.lock:
            self._pause.resume()

    def is_paused(self) -> bool:
        return self.lifecycle.state is State.PAUSED

    async def abort_all(self, reason: str = "abort_all") -> int:
        """End every request in flight at the next step boundary (``finish_reason="abort"``,
        ``reason``), with the tokens, text and logprobs it has so far; how many there were."""
        if not isinstance(reason, str) or len(reason) > 256:
            raise BadRequestError("reason must be a string of at most 256 characters")
        rids = list(self._sinks)  # type: ignore[attr-defined]
        for rid in rids:
            self._abort_nowait(rid, reason)  # type: ignore[attr-defined]
        self._wake()  # type: ignore[attr-defined]
        return len(rids)


class PauseController:
    """The loop's side of a pause: what to do with the requests in flight (``settle``), the
    requests held while PAUSED, and the callers waiting for the pause to settle."""

    def __init__(self, engine: Any) -> None:  # the AsyncEngine it serves (no import: no circle)
        self._engine = engine
        self.mode = "abort"
        self.deadline = math.inf
        self.settled = anyio.Event()
        self.lock = anyio.Lock()  # held by a weight update while PAUSED (engine/serving/sleep.py)
        self._abort_now = False
        #: accepted requests that arrived while PAUSED, in order, by id (the loop's _Add items)
        self.parked: dict[str, Any] = {}
        engine.lifecycle.on_change(self._on_change)

    # -- the API (event-loop thread) -----------------------------------------------------------
    async def pause(self, mode: str, timeout: Optional[float]) -> None:
        eng = self._engine
        if mode not in PAUSE_MODES:
            raise BadRequestError(f"pause mode must be one of {list(PAUSE_MODES)}, not {mode!r}")
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float)) or not timeout >= 0):
            raise BadRequestError(f"pause timeout must be a number >= 0 or None, not {timeout!r}")
        if eng.lifecycle.state is not State.PAUSED:
            if eng.failure is not None or eng.lifecycle.state in (State.FAILED, State.SHUTDOWN):
                eng._raise_unavailable("pause")
            eng.lifecycle.trigger("pause")  # InvalidTransitionError unless SERVING
            self.mode = mode
            self.settled = anyio.Event()
            self._abort_now = mode == "abort"
            self.deadline = (time.monotonic() + timeout if mode == "wait" and timeout is not None
                             else math.inf)
            if mode == "abort":  # accepted before the pause, not in the core yet
                for rid, reason in eng._tokenizing.items():
                    if reason is None:
                        eng._tokenizing[rid] = "pause"
            eng._wake()
        # set once settled, or when PAUSED is left meanwhile (resume, drain, sleep, a failure)
        await self.settled.wait()
        if eng.failure is not None:
            eng._raise_unavailable("pause")

    def resume(self) -> None:
        lc = self._engine.lifecycle
        if lc.state is State.SERVING:
            return
        if lc.state in (State.FAILED, State.SHUTDOWN):
            self._engine._raise_unavailable("resume")
        lc.trigger("resume")  # InvalidTransitionError unless PAUSED

    def _on_change(self, old: State, new: State) -> None:
        if old is not State.PAUSED:
            return
        eng = self._engine
        # leaving PAUSED (resume, drain, sleep, failure): the held requests go back to the loop,
        # before anything that arrives later (a failure's flush ends them with the rest)
        held = list(self.parked.values())
        self.parked.clear()
        eng._inbox.extendleft(reversed(held))
        self.settled.set()
        eng._wake()

    # -- the loop's side (the engine loop task) ------------------------------------------------
    def park(self, item: Any) -> None:
        self.parked[item.request_id] = item

    def unpark_abort(self, request_id: str, reason: str) -> Optional[RequestOutput]:
        """The terminal output of a held request aborted while PAUSED (None if not held)."""
        item = self.parked.pop(request_id, None)
        if item is None:
            return None
        return RequestOutput(request_id=request_id, finished=True, finish_reason="abort",
                             reason=reason, num_prompt_tokens=len(item.ids))

    async def tick(self, core: Any) -> bool:
        """Called by the loop while PAUSED, after the inbox is applied: settles the pause.
        True: a step may run (``"wait"``: requests from before the pause still finishing)."""
        eng = self._engine
        if self._abort_now or time.monotonic() >= self.deadline:
            self._abort_now = False
            self.deadline = math.inf
            eng._dispatch(core.abort_all("pause"))
        if self.mode == "wait" and core.has_work():
            return True
        if core.in_flight:  # "keep" (or what an abort left launched): apply it, launch nothing
            eng._dispatch(await eng._on_device(core.settle))
        eng._flush_pending()  # held outputs reach their streams now, not after the resume
        if not self.settled.is_set():
            self.settled.set()
        return False


__all__ = ["PauseAPI", "PauseController", "PAUSE_MODES"]

"""``Lifecycle``: a synchronous ``transitions.Machine`` over the table, with one owner.

NOTE: we use the sync ``Machine`` on purpose. ``AsyncMachine`` cancels the caller's task when two
triggers race (see shared field notes); here a single task (the engine loop) owns the machine and
does the slow async work itself, outside the callbacks.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Mapping, Optional

from transitions import Machine

from ._table import LIVE_STATES, TRANSITIONS, State, allowed_triggers

log = logging.getLogger("enginecore.states")


class InvalidTransitionError(RuntimeError):
    """A trigger or call that the current lifecycle state does not allow."""

    def __init__(self, state: State, trigger: str, allowed: Iterable[str]):
        self.state = state
        self.trigger = trigger
        self.allowed = list(allowed)
        super().__init__(
            f"{trigger!r} is not allowed in state {state.name}; allowed: "
            f"{', '.join(self.allowed) or 'nothing'}"
        )


class _Model:
    """The object `transitions` decorates; kept private so triggers are only reached via Lifecycle."""

    state: State


class Lifecycle:
    """The engine's lifecycle state, moved only by :meth:`trigger`.

    Every transition is one INFO line with the time spent in the previous state and, when an
    in-flight callback is set (:meth:`describe_in_flight`), what was in flight at that moment:
    ``engine: serving -> draining after 3,412.004 s; 17 running, 4 waiting``. The figures are
    also on the record (``previous``, ``state``, ``trigger``, ``after_s`` and the callback's
    keys) for structured logs. Listeners registered with :meth:`on_change` are called
    synchronously after each transition.
    """

    def __init__(self, name: str = "engine") -> None:
        self._model = _Model()
        self._machine = Machine(
            model=self._model,
            states=State,
            transitions=TRANSITIONS,
            initial=State.INIT,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            model_attribute="state",
        )
        self._name = name
        self._since = time.perf_counter()
        self._listeners: list[Callable[[State, State], None]] = []
        self._in_flight: Optional[Callable[[], Mapping[str, int]]] = None

    @property
    def state(self) -> State:
        return self._model.state

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    def allowed(self) -> list[str]:
        return allowed_triggers(self.state)

    def may(self, trigger: str) -> bool:
        return trigger in self.allowed()

    def trigger(self, trigger: str) -> State:
        """Fire ``trigger``; raise :class:`InvalidTransitionError` if the table forbids it."""
        before = self.state
        if not self.may(trigger):
            raise InvalidTransitionError(before, trigger, self.allowed())
        in_flight = self._read_in_flight()  # what the state being left had in flight
        self._model.trigger(trigger)  # may() checked the table: transitions cannot refuse it
        now = time.perf_counter()
        after = now - self._since
        flight = "; " + ", ".join(f"{v} {k}" for k, v in in_flight.items()) if in_flight else ""
        log.info("%s: %s -> %s after %s s%s", self._name, before.value, self.state.value,
                 f"{after:,.3f}", flight,
                 extra={"lifecycle": self._name, "previous": before.value, "state": self.state.value,
                        "trigger": trigger, "after_s": round(after, 6), **in_flight})
        self._since = now
        for listener in list(self._listeners):
            listener(before, self.state)
        return self.state

    def require(self, call: str, *states: State) -> None:
        """Raise :class:`InvalidTransitionError` unless the current state is one of ``states``."""
        if self.state not in states:
            raise InvalidTransitionError(self.state, call, [s.name for s in states])

    def on_change(self, listener: Callable[[State, State], None]) -> None:
        self._listeners.append(listener)

    def describe_in_flight(self, fn: Callable[[], Mapping[str, int]]) -> None:
        """``fn()`` -> e.g. ``{"running": 17, "waiting": 4}``, read just before each transition
        for its log line. It must not raise; if it does, the line goes without it."""
        self._in_flight = fn

    def _read_in_flight(self) -> dict:
        if self._in_flight is None:
            return {}
        try:
            return {str(k): int(v) for k, v in self._in_flight().items()}
        except Exception:  # a log line must never break a transition
            log.debug("in-flight callback failed", exc_info=True)
            return {}


def mermaid() -> str:
    """The state diagram, generated from the machine's own table (README embeds this text)."""
    from transitions.extensions import GraphMachine

    class _G:
        pass

    g = GraphMachine(
        model=_G(), states=State, transitions=TRANSITIONS, initial=State.INIT,
        auto_transitions=False, graph_engine="mermaid", title="",
    )
    text = g.get_graph().draw(None)
    # Keep the structure only: no empty front matter, no styling classes (GitHub renders it as is).
    keep = [ln for ln in text.splitlines()
            if ln.strip() and ln.strip() != "---" and not ln.strip().startswith(("classDef", "Class "))]
    return "\n".join(keep) + "\n"

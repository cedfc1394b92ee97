"""The lifecycle as data: the states and the one table of legal transitions."""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    INIT = "init"
    LOADED = "loaded"
    SERVING = "serving"
    PAUSED = "paused"
    SLEEPING = "sleeping"
    DRAINING = "draining"
    SHUTDOWN = "shutdown"
    FAILED = "failed"


#: States in which the engine is alive (a failure can still happen there).
LIVE_STATES = (State.INIT, State.LOADED, State.SERVING, State.PAUSED, State.SLEEPING,
               State.DRAINING)

#: The whole lifecycle. NOTE: no "*" sources and no auto transitions, so there are no self-loops
#: (shutdown -> shutdown would hide a double release).
TRANSITIONS: list[dict] = [
    {"trigger": "load", "source": State.INIT, "dest": State.LOADED},
    {"trigger": "serve", "source": State.LOADED, "dest": State.SERVING},
    {"trigger": "drain", "source": State.SERVING, "dest": State.DRAINING},
    # Pause: no step runs; requests in flight are aborted, finished first, or kept frozen with
    # their KV blocks; new ones queue until resume. Drain and sleep work from PAUSED too.
    {"trigger": "pause", "source": State.SERVING, "dest": State.PAUSED},
    {"trigger": "resume", "source": State.PAUSED, "dest": State.SERVING},
    {"trigger": "drain", "source": State.PAUSED, "dest": State.DRAINING},
    # Sleep mode: admission stops at once; the device memory is freed once in-flight requests
    # ended (aborted, or finished with mode="wait"); wake brings it back.
    {"trigger": "sleep", "source": [State.SERVING, State.PAUSED], "dest": State.SLEEPING},
    {"trigger": "wake", "source": State.SLEEPING, "dest": State.SERVING},
    # A shutdown while asleep releases what is left (level 1: the offloaded weights).
    {"trigger": "shutdown", "source": State.SLEEPING, "dest": State.SHUTDOWN},
    {"trigger": "shutdown", "source": State.DRAINING, "dest": State.SHUTDOWN},
    # A start that is cancelled before serving releases straight away.
    {"trigger": "shutdown", "source": State.LOADED, "dest": State.SHUTDOWN},
    {"trigger": "shutdown", "source": State.INIT, "dest": State.SHUTDOWN},
    {"trigger": "fail", "source": list(LIVE_STATES), "dest": State.FAILED},
    # The release after a failure.
    {"trigger": "shutdown", "source": State.FAILED, "dest": State.SHUTDOWN},
]

TRIGGERS: tuple[str, ...] = tuple(dict.fromkeys(t["trigger"] for t in TRANSITIONS))


def allowed_triggers(state: State) -> list[str]:
    """Triggers that are legal from ``state``, in table order."""
    out: list[str] = []
    for t in TRANSITIONS:
        sources = t["source"] if isinstance(t["source"], list) else [t["source"]]
        if state in sources and t["trigger"] not in out:
            out.append(t["trigger"])
    return out

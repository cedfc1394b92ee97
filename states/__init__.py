"""The engine lifecycle as data: an Enum of states, a table of transitions, one machine."""

from ._machine import InvalidTransitionError, Lifecycle, mermaid
from ._table import LIVE_STATES, TRANSITIONS, TRIGGERS, State, allowed_triggers

__all__ = [
    "State", "TRANSITIONS", "TRIGGERS", "LIVE_STATES", "allowed_triggers",
    "Lifecycle", "InvalidTransitionError", "mermaid",
]

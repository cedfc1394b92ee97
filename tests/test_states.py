"""The lifecycle table: every legal transition works, every illegal one raises, README diagram."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from states import (TRANSITIONS, TRIGGERS, InvalidTransitionError, Lifecycle, State,
                    allowed_triggers, mermaid)

# Paths from INIT that reach each state, used to put a fresh machine into any state.
_PATH = {
    State.INIT: [],
    State.LOADED: ["load"],
    State.SERVING: ["load", "serve"],
    State.PAUSED: ["load", "serve", "pause"],
    State.SLEEPING: ["load", "serve", "sleep"],
    State.DRAINING: ["load", "serve", "drain"],
    State.SHUTDOWN: ["load", "serve", "drain", "shutdown"],
    State.FAILED: ["load", "fail"],
}


def _machine_in(state: State) -> Lifecycle:
    lc = Lifecycle()
    for t in _PATH[state]:
        lc.trigger(t)
    assert lc.state is state
    return lc


def _expected_dest(state: State, trigger: str):
    for t in TRANSITIONS:
        src = t["source"] if isinstance(t["source"], list) else [t["source"]]
        if t["trigger"] == trigger and state in src:
            return t["dest"]
    return None


@pytest.mark.parametrize("state,trigger", list(itertools.product(State, TRIGGERS)))
def test_whole_table(state: State, trigger: str) -> None:
    lc = _machine_in(state)
    dest = _expected_dest(state, trigger)
    if dest is None:
        with pytest.raises(InvalidTransitionError) as ei:
            lc.trigger(trigger)
        msg = str(ei.value)
        assert state.name in msg and trigger in msg
        for allowed in allowed_triggers(state):
            assert allowed in msg
        assert lc.state is state  # nothing moved
    else:
        assert lc.trigger(trigger) is dest
        assert lc.state is dest


def test_shape_of_the_table() -> None:
    for t in TRANSITIONS:
        assert t["source"] != "*"
        src = t["source"] if isinstance(t["source"], list) else [t["source"]]
        assert t["dest"] not in src, f"self-loop in {t}"
    assert allowed_triggers(State.SHUTDOWN) == []
    assert set(allowed_triggers(State.FAILED)) == {"shutdown"}
    for s in (State.INIT, State.LOADED, State.SERVING, State.PAUSED, State.SLEEPING,
              State.DRAINING):
        assert "fail" in allowed_triggers(s)
    assert allowed_triggers(State.SLEEPING) == ["wake", "shutdown", "fail"]
    assert allowed_triggers(State.PAUSED) == ["resume", "drain", "sleep", "fail"]


def test_transitions_are_logged_and_listened(caplog) -> None:
    seen = []
    lc = Lifecycle("t")
    lc.on_change(lambda a, b: seen.append((a, b)))
    with caplog.at_level("INFO", logger="enginecore.states"):
        lc.trigger("load")
    assert seen == [(State.INIT, State.LOADED)]
    assert re.search(r"t: init -> loaded after \d+\.\d{3} s$", caplog.text, re.M)
    rec = caplog.records[-1]
    assert (rec.previous, rec.state, rec.trigger) == ("init", "loaded", "load")


def test_transition_line_says_what_was_in_flight(caplog) -> None:
    lc = Lifecycle("engine")
    lc.describe_in_flight(lambda: {"running": 17, "waiting": 4})
    with caplog.at_level("INFO", logger="enginecore.states"):
        lc.trigger("load")
        lc.trigger("serve")
    assert re.search(r"engine: loaded -> serving after [\d,]+\.\d{3} s; 17 running, 4 waiting",
                     caplog.text)
    assert caplog.records[-1].running == 17 and caplog.records[-1].waiting == 4

    def broken():
        raise RuntimeError("no core")

    lc.describe_in_flight(broken)  # a failing description never blocks a transition
    with caplog.at_level("INFO", logger="enginecore.states"):
        lc.trigger("drain")
    assert lc.state is State.DRAINING and caplog.text.rstrip().endswith("s")


def test_require_names_state_and_allowed() -> None:
    lc = Lifecycle()
    with pytest.raises(InvalidTransitionError, match="INIT.*SERVING"):
        lc.require("generate", State.SERVING)


def test_readme_diagram_is_generated_from_the_machine() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", readme, re.S)
    assert block, "README has no mermaid block"
    assert block.group(1).strip() == mermaid().strip()

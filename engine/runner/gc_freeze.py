"""The cyclic garbage collector kept off a serving engine's startup heap (``gc.freeze``).

A full (generation-2) collection walks every tracked object in the process and stops every
thread while it does: with the model, tokenizer and torch's own objects loaded that is hundreds
of thousands of objects and ~100+ ms (measured: 142 ms with ~300k objects on the 2-core box,
and a simulated device left idle 136 ms by it, ``bench.device_sim``). What serving allocates
is almost all freed by reference counting, so those walks find next to nothing. After a load
the runner moves everything alive into the permanent generation, which collections skip (as
vLLM's engine core and SGLang's server do after startup); at shutdown it is moved back, before
the release's own collection, so nothing that became cyclic garbage meanwhile outlives the
engine.

While held, the youngest generation's threshold is raised too (``hold(young)``; the
interpreter's own thresholds come back with the last release). At CPython's 700 a serving
step's own objects in flight -- a batch's outputs, token lists, the loop's messages -- cross it
every step, so a young collection ran on nearly every decode step, and one in ten pushed a
middle one: 248 young and 22 middle collections, plus 2 full ones (25-35 ms each), in a 1.6 s
run of 257 steps (``bench.structured --sim h200``, 0 %, on the 2-core box: ~6 % of the wall,
every one of them holding the GIL, the device running dry behind a long one). Those objects
are freed by reference counting a step later; at 2,000 the same run held 6-7 young
collections (1-2 ms in all), at 10,000 1-2. The count is of live young container objects
(allocations less deallocations), so cyclic garbage is still collected, only later: a cycle
that holds a large buffer lives longer in proportion (a review's probe of cycles each holding
100 KB: ~180 alive at most at 700, ~2,500 at 10,000), hence the engine's default of 2,000 and
not more.

NOTE: process-wide by necessity (Python has one permanent generation per process): the count
of runners holding a freeze lives here, so that two engines in one process compose -- the
heap is thawed when the last of them shuts down, not the first.
"""

from __future__ import annotations

import gc
import threading
from typing import Optional

_lock = threading.Lock()
_holders = 0
_saved: Optional[tuple] = None  # (the thresholds before one was raised here, those set here)


def hold(young: int = 0) -> None:
    """Freeze what is alive now (cheap: the collector's lists are spliced, nothing is walked);
    with ``young``, raise the youngest generation's threshold to it while held (never lower
    it; leave it alone where automatic collection is off -- a threshold of 0 -- or where the
    process set thresholds of its own since one was raised here)."""
    global _holders, _saved
    with _lock:
        _holders += 1
        gc.freeze()
        now = gc.get_threshold()
        if _saved is not None and now != _saved[1]:
            _saved = None  # the process's own thresholds now: not ours to raise or give back
        elif young > now[0] > 0:
            raised = (young, *now[1:])
            _saved = (now if _saved is None else _saved[0], raised)
            gc.set_threshold(*raised)


def release() -> None:
    """One holder fewer; the last one thaws the heap (``gc.unfreeze``) and gives the
    interpreter its thresholds back -- unless the process set others meanwhile (they are no
    longer the ones set here): those are left as they are."""
    global _holders, _saved
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()
            if _saved is not None and gc.get_threshold() == _saved[1]:
                gc.set_threshold(*_saved[0])
            _saved = None


def holders() -> int:
    return _holders

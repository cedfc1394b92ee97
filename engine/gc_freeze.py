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

NOTE: process-wide by necessity (Python has one permanent generation per process): the count
of runners holding a freeze lives here, so that two engines in one process compose -- the
heap is thawed when the last of them shuts down, not the first.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0


def hold() -> None:
    """Freeze what is alive now (cheap: the collector's lists are spliced, nothing is walked)."""
    global _holders
    with _lock:
        _holders += 1
        gc.freeze()


def release() -> None:
    """One holder fewer; the last one thaws the heap (``gc.unfreeze``)."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()


def holders() -> int:
    return _holders

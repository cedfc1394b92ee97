"""Where a benchmark run's wall time went, step by step: ``bench.throughput --timeline``.

Every ``EngineCore.step`` call is timed (its start and end on the thread that runs it) with what
it scheduled, and every garbage collection in the timed window is recorded. The summary splits
the run's wall into the time the stepping thread spent inside steps (host work plus waiting for
the device) and the gaps between steps (the bench's own recording in the bare loop; the hand-over
to the event loop and back in-process), by kind of step. Comparing the bare and in-process
summaries of one run says where the in-process mode's extra time is: in longer steps (the event
loop holding the GIL while the step thread wants it), in longer gaps (the hand-over), or in
collections (the in-process / bare ratio).

Patched at class level for the duration of the ``with`` block, so it also sees the steps that
``AsyncEngine`` runs on its step thread; the patch is the bench's, never the engine's.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Any, Iterator

from .common import percentile

BATCH_BUCKETS = (1, 16, 64, 128, 256, 1 << 30)


class Timeline:
    def __init__(self) -> None:
        # t0, t1, entries, rows, prompt tokens, seconds waiting for the device's tokens
        self.steps: list[tuple[float, float, int, int, int, float]] = []
        self._wait = 0.0
        self.gc: list[tuple[float, int, float]] = []  # start, generation, seconds
        self._sched = (0, 0, 0)
        self._gc_t0 = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc.append((self._gc_t0, info["generation"], time.perf_counter() - self._gc_t0))

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        """The steps and collections between ``t0`` and ``t1`` (the timed run's window)."""
        steps = [s for s in self.steps if t0 <= s[0] <= t1]
        wall = t1 - t0
        dur = [b - a for a, b, *_ in steps]
        waited = sum(s[5] for s in steps)
        gaps = [steps[k + 1][0] - steps[k][1] for k in range(len(steps) - 1)]
        out: dict[str, Any] = {
            "steps": len(steps), "wall_s": wall, "in_steps_s": sum(dur), "gaps_s": sum(gaps),
            "gap_p50_us": _us(percentile(gaps, 50)), "gap_p99_us": _us(percentile(gaps, 99)),
            "gap_max_ms": max(gaps) * 1e3 if gaps else None,
            # the part of in_steps_s spent waiting for a step's tokens (Launched.wait): what
            # the host had to spare; the rest of in_steps_s is host work (and GIL waits)
            "device_wait_s": waited,
        }
        kinds: dict[str, list[float]] = {}
        kind_wait: dict[str, float] = {}
        for (a, b, entries, rows, prompt, wait) in steps:
            if not entries:
                key = "no launch"  # applied the step in flight only (EngineCore.step)
            elif prompt:
                key = "prompt"
            else:
                key = "decode<=" + str(next(x for x in BATCH_BUCKETS if rows <= x))
            kinds.setdefault(key, []).append(b - a)
            kind_wait[key] = kind_wait.get(key, 0.0) + wait
        out["by_kind"] = {k: {"n": len(v), "sum_s": sum(v), "p50_ms": percentile(v, 50) * 1e3,
                              "p99_ms": percentile(v, 99) * 1e3, "wait_s": kind_wait[k]}
                          for k, v in sorted(kinds.items())}
        collections: dict[str, list[float]] = {}
        for start, gen, secs in self.gc:
            if t0 <= start <= t1:
                collections.setdefault(f"gen{gen}", []).append(secs)
        out["gc"] = {g: {"n": len(v), "sum_ms": sum(v) * 1e3, "max_ms": max(v) * 1e3}
                     for g, v in sorted(collections.items())}
        longest = sorted(steps, key=lambda s: s[0] - s[1])[:5]
        out["longest_steps"] = [{"ms": (b - a) * 1e3, "entries": e, "rows": r, "prompt_tokens": p,
                                 "wait_ms": w * 1e3} for a, b, e, r, p, w in longest]
        return out


def _us(x):
    return None if x is None else x * 1e6


@contextmanager
def recording() -> Iterator[Timeline]:
    from engine.core.engine_core import EngineCore
    from engine.runner.launched import Launched
    from engine.core.scheduler import Scheduler

    tl = Timeline()
    step, schedule, wait = EngineCore.step, Scheduler.schedule, Launched.wait

    def timed_schedule(self, *a, **kw):
        batch = schedule(self, *a, **kw)
        prompt = rows = 0
        for req, n in batch:
            if n > 1 or req.num_computed_tokens == 0:
                prompt += n
            rows += 1
        tl._sched = (len(batch), rows, prompt)
        return batch

    def timed_wait(self):
        t = time.perf_counter()
        try:
            return wait(self)
        finally:
            tl._wait += time.perf_counter() - t

    def timed_step(self, *a, **kw):
        tl._sched, tl._wait = (0, 0, 0), 0.0
        t = time.perf_counter()
        try:
            return step(self, *a, **kw)
        finally:
            tl.steps.append((t, time.perf_counter(), *tl._sched, tl._wait))

    EngineCore.step, Scheduler.schedule, Launched.wait = timed_step, timed_schedule, timed_wait
    gc.callbacks.append(tl._on_gc)
    try:
        yield tl
    finally:
        EngineCore.step, Scheduler.schedule, Launched.wait = step, schedule, wait
        gc.callbacks.remove(tl._on_gc)


def print_summary(mode: str, s: dict[str, Any]) -> None:
    print(f"[{mode}] timeline: {s['steps']} steps, wall {s['wall_s']:.3f} s = in steps "
          f"{s['in_steps_s']:.3f} + gaps {s['gaps_s']:.3f} (gap p50 {s['gap_p50_us'] or 0:.0f} us, "
          f"p99 {s['gap_p99_us'] or 0:.0f} us, max {s['gap_max_ms'] or 0:.1f} ms); "
          f"waiting for the device in steps {s['device_wait_s']:.3f} s")
    for k, v in s["by_kind"].items():
        print(f"    {k:>14}: {v['n']:5d} steps, {v['sum_s']:.3f} s, p50 {v['p50_ms']:.2f} ms, "
              f"p99 {v['p99_ms']:.2f} ms, waiting {v['wait_s']:.3f} s")
    for g, v in s["gc"].items():
        print(f"    gc {g}: {v['n']} collections, {v['sum_ms']:.1f} ms, max {v['max_ms']:.1f} ms")


#: what ``phases()`` times by default: the step's parts on the step thread (``bench.structured
#: --phases``), overlapped and late-sampled steps alike
STEP_PARTS = (
    "engine.core.scheduler:Scheduler.schedule", "engine.core.engine_core:EngineCore._defer",
    "engine.runner.model_runner:ModelRunner.launch", "engine.runner.model_runner:ModelRunner.forward",
    "engine.runner.model_runner:ModelRunner.sample_step", "engine.structured.bitmask:TokenBitmask.mask",
    "engine.core.engine_core:EngineCore._complete", "engine.runner.launched:Launched.wait",
    "engine.core.late_step:LateStep._grammar_job", "engine.core.late_step:LateStep._advance_matchers",
    "engine.serving.loop:EngineLoop._deliver_handed",
)


@contextmanager
def phases(targets=STEP_PARTS) -> Iterator[dict[str, list]]:
    """Each of ``targets`` (``module:Class.method``, or ``module:function``: that module's
    global, e.g. ``engine.runner.model_runner:sample`` for the runner's calls of it) wrapped at class (or
    module) level for the ``with`` block: name -> [calls, wall s, CPU s of the calling thread]
    (inclusive: a timed function that calls another counts it too). The CPU time against the
    wall says whether a part is slow for its own work or for waiting (the GIL, the device,
    another thread)."""
    import importlib

    totals: dict[str, list] = {}
    restore = []
    for target in targets:
        module, _, attr = target.partition(":")
        cls_name, _, name = attr.rpartition(".")
        # ``module:function``: a module's global, as its callers in that module look it up
        mod = importlib.import_module(module)
        owner = getattr(mod, cls_name) if cls_name else mod
        raw = owner.__dict__[name]
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        acc = totals.setdefault(attr, [0, 0.0, 0.0])

        def timed(*a, _fn=fn, _acc=acc, **kw):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return _fn(*a, **kw)
            finally:
                _acc[0] += 1
                _acc[1] += time.perf_counter() - w
                _acc[2] += time.thread_time() - c

        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
        restore.append((owner, name, raw))
    try:
        yield totals
    finally:
        for owner, name, raw in reversed(restore):
            setattr(owner, name, raw)


def phase_deltas(before: dict[str, list], after: dict[str, list], per: int) -> dict[str, dict]:
    """:func:`phases` totals between two copies, per ``per`` steps (ms)."""
    out = {}
    for k, (n, w, c) in after.items():
        n0, w0, c0 = before.get(k, (0, 0.0, 0.0))
        if n > n0:
            out[k] = {"calls": (n - n0) / per, "wall_ms": 1e3 * (w - w0) / per,
                      "cpu_ms": 1e3 * (c - c0) / per}
    return out

"""Where a constrained step's read-back goes on the device host: ``bench.structured``
at the fractions given, with the step thread's parts of a late-sampled step timed in wall and in
the thread's own CPU time (``time.thread_time``): a part whose wall exceeds its CPU time waited
-- for the device (the tokens' event) or for the GIL. Variants by flag: ``--fill-threads N``
(xgrammar's fill threads), ``--torch-threads N``, ``--deliver-after-step`` (a diagnostic, not
the engine's behaviour: the loop is let in to deliver outputs only when a step returns, not
once it is launched -- whether the late step's masking and sampling wait for the GIL while the
loop delivers). The grammar worker's submit (``job_submit``) and wait (``job_wait``), the
masking (``mask``: the rows' copy and xgrammar's kernel) and the sampling (``sample``) are
timed within ``sample_step`` and ``forward``.

    python3 -m tools.structured_split [--fill-threads 1] [--torch-threads 1] -- <bench.structured args>
"""
import argparse
import atexit
import collections
import os
import runpy
import sys
import time

sys.path.insert(0, os.getcwd())

ap = argparse.ArgumentParser()
ap.add_argument("--fill-threads", type=int, default=None)
ap.add_argument("--torch-threads", type=int, default=None)
ap.add_argument("--deliver-after-step", action="store_true")
ap.add_argument("rest", nargs=argparse.REMAINDER)
a = ap.parse_args()

import torch  # noqa: E402

import engine.core.engine_core as core_mod  # noqa: E402
import engine.runner.launched as launched_mod  # noqa: E402
import engine.runner.model_runner as rmod  # noqa: E402
import engine.structured.bitmask as bm  # noqa: E402
import engine.structured.budget as budget_mod  # noqa: E402

if a.fill_threads is not None:
    bm._fill_threads = lambda: a.fill_threads
if a.torch_threads is not None:
    torch.set_num_threads(a.torch_threads)

W = collections.defaultdict(float)
C = collections.defaultdict(float)
N = collections.Counter()


def timed(name, fn):
    def w(*args, **kw):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kw)
        finally:
            W[name] += time.perf_counter() - t
            C[name] += time.thread_time() - c
            N[name] += 1
    return w


budget_mod.GrammarBudget.advance_all = timed("accept", budget_mod.GrammarBudget.advance_all)
rmod.ModelRunner.fill_masks = timed("fill_masks", rmod.ModelRunner.fill_masks)
rmod.ModelRunner.forward = timed("forward", rmod.ModelRunner.forward)
rmod.ModelRunner.sample_step = timed("sample_step", rmod.ModelRunner.sample_step)
core_mod.EngineCore._complete = timed("apply", core_mod.EngineCore._complete)
bm.TokenBitmask.accept_then_fill = timed("job_submit", bm.TokenBitmask.accept_then_fill)
bm.GrammarJob.result = timed("job_wait", bm.GrammarJob.result)
bm.TokenBitmask.mask = timed("mask", bm.TokenBitmask.mask)
rmod.sample = timed("sample", rmod.sample)
_step = core_mod.EngineCore.step
if a.deliver_after_step:
    def _step_then_deliver(self, on_launched=None):
        try:
            return _step(self)
        finally:
            if on_launched is not None:
                on_launched()
    core_mod.EngineCore.step = timed("step", _step_then_deliver)
else:
    core_mod.EngineCore.step = timed("step", _step)
_ev_sync = torch.cuda.Event.synchronize if torch.cuda.is_available() else None
L = launched_mod.Launched
_wait = L.wait


def wait(self):
    if self.result is None and self.event is not None:
        t, c = time.perf_counter(), time.thread_time()
        self.event.synchronize()
        W["event_sync"] += time.perf_counter() - t
        C["event_sync"] += time.thread_time() - c
        N["event_sync"] += 1
    return timed("unpack", _wait)(self)


L.wait = wait


def report():
    print("part            calls   wall ms/call   cpu ms/call   (wall - cpu) ms/call")
    for k in sorted(W, key=lambda k: -W[k]):
        n = max(N[k], 1)
        print(f"{k:14s} {N[k]:6d} {1e3 * W[k] / n:14.3f} {1e3 * C[k] / n:13.3f} "
              f"{1e3 * (W[k] - C[k]) / n:14.3f}")


atexit.register(report)
rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
sys.argv = ["bench.structured"] + rest
runpy.run_module("bench.structured", run_name="__main__")

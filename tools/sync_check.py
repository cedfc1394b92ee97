"""Which host calls wait for the device during a benchmark (a late-sampled step's
``sample_step`` waited 0.75 ms a call on the H200 with no device work to wait for).

    python3 -m tools.sync_check [--top 25] -- <bench module> <its args>
    python3 -m tools.sync_check -- bench.structured --device cuda --fractions 0,1 --no-plain

Runs the benchmark with ``torch.cuda.set_sync_debug_mode("warn")``: torch warns at every call
that synchronizes with the device (a blocking copy, ``.item()``, ``.tolist()`` of a device
tensor, an event or stream wait). Each warning is counted by the engine frames that led to it
(innermost first, on whichever thread), and the top sites are printed with their counts: a site
inside a step (``runner.py``, ``core.py``, ``bitmask.py``, ``sampler.py``) is a wait on the
step's critical path unless it is the read-back of a step's tokens (``launched.py`` ``wait``).
"""
import argparse
import collections
import os
import runpy
import sys
import traceback
import warnings

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--top", type=int, default=25)
ap.add_argument("rest", nargs=argparse.REMAINDER)
a = ap.parse_args()
rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
if not rest:
    ap.error("give the benchmark module and its arguments after --")

SITES: collections.Counter = collections.Counter()
ROOT = os.getcwd() + os.sep


def _show(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message).lower():
        return
    frames = [f for f in traceback.extract_stack()[:-1]
              if f.filename.startswith(ROOT) and "sync_check" not in f.filename]
    key = tuple(f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
    SITES[key or ("(outside the repository)",)] += 1


warnings.showwarning = _show
warnings.simplefilter("always")
CUDA = torch.cuda.is_available()
if CUDA:
    torch.cuda.set_sync_debug_mode("warn")
sys.argv = [rest[0]] + rest[1:]
try:
    runpy.run_module(rest[0], run_name="__main__")
except SystemExit:
    pass
finally:
    if CUDA:
        torch.cuda.set_sync_debug_mode("default")
    print(f"\nsynchronizing calls: {sum(SITES.values())} at {len(SITES)} sites; the top {a.top}:")
    for key, n in SITES.most_common(a.top):
        print(f"{n:8d}  " + "  <-  ".join(key))

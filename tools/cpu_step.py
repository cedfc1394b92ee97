"""One CPU decode step of the default GGUF, bare: milliseconds and op calls by type.

    python -m tools.cpu_step [--threads 1 2] [--batches 1 8] [--context 128] [--steps 60]
                             [--dtype auto] [--no-profile]

Each point loads a ``ModelRunner`` (``--dtype auto``: the packed format ``auto`` picks here)
in a fresh process, so that torch's thread count and OpenMP team are the point's own, and
calls ``ModelRunner.execute`` on ``decode_batch`` (bench.roofline: each request holds
``context - 1`` tokens in consecutive KV blocks and decodes one; greedy). Reported: min / p25 /
median of ``--steps`` timed steps after 5 untimed ones, then (unless ``--no-profile``) the
top-level aten op calls of 5 more steps under ``torch.profiler``, per step: their count by
name and the profiler's time in them (inflated by the profiler; the counts are not).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time


def point(threads: int, batch: int, context: int, steps: int, dtype: str, profile: bool) -> dict:
    import torch

    torch.set_num_threads(threads)
    from engine import EngineConfig
    from engine.kv.kv_cache import blocks_needed
    from engine.runner.model_runner import ModelRunner

    from bench.roofline import decode_batch

    blocks = batch * blocks_needed(context, 16)
    runner = ModelRunner(EngineConfig(model="default", device="cpu", dtype=dtype, num_kv_blocks=blocks + 8,
                                      block_size=16, max_num_seqs=batch, max_model_len=context + 64,
                                      enable_prefix_caching=False))
    runner.load()
    try:
        work = decode_batch(runner, batch, context)
        for _ in range(5):
            runner.execute(work)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            runner.execute(work)
            times.append(time.perf_counter() - t)
        times.sort()
        out = {"threads": threads, "batch": batch, "context": context, "format": runner.weight_format,
               "min_ms": times[0] * 1e3, "p25_ms": times[len(times) // 4] * 1e3,
               "median_ms": statistics.median(times) * 1e3,
               "tok_s_median": batch / statistics.median(times)}
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            n = 5
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(n):
                    runner.execute(work)
            count: collections.Counter = collections.Counter()
            spent: collections.Counter = collections.Counter()
            for e in prof.events():
                parent = e.cpu_parent
                if e.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
                    count[e.name] += 1
                    spent[e.name] += e.cpu_time_total
            out["ops_per_step"] = sum(count.values()) / n
            out["ops"] = {k: {"calls": c / n, "profiled_ms": spent[k] / n / 1e3} for k, c in count.most_common()}
        return out
    finally:
        runner.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.cpu_step", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--top", type=int, default=12, help="op names printed per point")
    ap.add_argument("--point", help=argparse.SUPPRESS)  # THREADS,BATCH: run one point, print JSON
    a = ap.parse_args(argv)
    if a.point:
        threads, batch = (int(v) for v in a.point.split(","))
        print(json.dumps(point(threads, batch, a.context, a.steps, a.dtype, not a.no_profile)))
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for threads in a.threads:
        for batch in a.batches:
            cmd = [sys.executable, "-m", "tools.cpu_step", "--point", f"{threads},{batch}",
                   "--context", str(a.context), "--steps", str(a.steps), "--dtype", a.dtype]
            if a.no_profile:
                cmd.append("--no-profile")
            env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": str(threads)}
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{r['format']} threads {threads} batch {batch} context {a.context}: min {r['min_ms']:.2f} / "
                  f"p25 {r['p25_ms']:.2f} / median {r['median_ms']:.2f} ms a step, "
                  f"{r['tok_s_median']:.1f} tok/s (median)"
                  + (f"; {r['ops_per_step']:.0f} top-level aten ops a step" if "ops_per_step" in r else ""),
                  flush=True)
            for name, v in list(r.get("ops", {}).items())[: a.top]:
                print(f"    {name:42s} {v['calls']:7.1f}  {v['profiled_ms']:7.3f} ms (profiled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

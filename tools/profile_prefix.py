"""Where the step thread's host time goes in ``bench.prefix``'s caching-on run: the
workload once untimed (graphs, kernels), then once under the torch profiler, started and
stopped on the step thread so its ops are recorded. Printed: the CPU ops and CUDA runtime
calls with the most self time -- a ``cudaMemcpyAsync`` or ``cudaLaunchKernel`` whose time per
call is far above a few microseconds waits for the device (a pageable copy behind the
stream, a full launch queue) -- and the device's busy fraction.

    python3 -m tools.profile_prefix [--conversations 64] [--turns 4] [--top 30]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import anyio
from torch.profiler import ProfilerActivity, profile

from bench import common
from bench.prefix import CPU_DEFAULTS, CUDA_DEFAULTS, plan, run_workload

from tools.profile_structured import busy_fraction, table  # noqa: E402


async def main(args) -> dict:
    from engine import AsyncEngine, SamplingParams

    cfg = common.engine_config(args, enable_prefix_caching=True, max_num_seqs=256,
                               max_model_len=args.max_model_len)
    async with AsyncEngine.open(cfg) as eng:
        vocab = eng.runner.model_config.vocab_size
        async for _ in eng.generate([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=8)):
            pass
        await run_workload(eng, *plan(args, vocab, args.seed + 1), args, None)  # untimed
        eng.core.blocks.reset_prefix_cache()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        prof = profile(activities=acts)
        await eng._on_device(prof.start)
        common.sync(args.device)
        t0 = time.perf_counter()
        await run_workload(eng, *plan(args, vocab, args.seed), args, None)
        common.sync(args.device)
        wall = time.perf_counter() - t0
        await eng._on_device(prof.stop)
        steps = eng.statistics().steps
    busy_us, busy = busy_fraction(prof, wall * 1e6)
    cpu = table(prof, "self_cpu_ms", args.top)
    print(f"caching on: {wall * 1e3:.0f} ms profiled, device busy {busy:.3f} "
          f"({busy_us / 1e3:.1f} ms); {steps} engine steps in all")
    print(f"{'cpu ms':>10} {'calls':>7} {'us/call':>8}  op / CUDA call")
    for r in cpu:
        print(f"{r['self_cpu_ms']:10.2f} {r['calls']:7d} {1e3 * r['self_cpu_ms'] / max(1, r['calls']):8.1f}"
              f"  {r['name']}")
    return {"wall_s": wall, "busy": busy, "cpu": cpu}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    d = CUDA_DEFAULTS if a.device == "cuda" else CPU_DEFAULTS
    a.model = a.model or d["model"]
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    for k in ("conversations", "turns", "min_user", "max_user", "max_tokens"):
        if getattr(a, k, None) is None:
            setattr(a, k, d[k])
    a.max_model_len = -(-(a.system_len + a.turns * (a.max_user + a.max_tokens) + 1) // 256) * 256
    a.engine_config = {}
    res = anyio.run(main, a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

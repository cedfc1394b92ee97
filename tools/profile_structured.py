"""Where a constrained (late-sampled) step's time goes on CUDA, against an unconstrained one:
``bench.structured``'s workload at 0 % and 100 % constrained, each under the torch
profiler for its whole run, then per mode:

- device time by kernel (the top rows) and the device's busy fraction (the union of kernel
  intervals over the run's wall);
- the host's CUDA calls that wait (event / stream synchronizations, blocking copies) and the
  CPU ops with the most self time.

    python3 -m tools.profile_structured [--requests 256] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())

import anyio
import torch
from torch.profiler import ProfilerActivity, profile

from bench import common
from bench.structured import run_mode, schema


def busy_fraction(prof, wall_us: float) -> tuple[float, float]:
    """(union of device kernel / memcpy intervals in µs, that over ``wall_us``)."""
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total, total / wall_us if wall_us else 0.0


def table(prof, key: str, n: int) -> list[dict]:
    rows = []
    for a in prof.key_averages():
        dev = getattr(a, "self_device_time_total", None)
        if dev is None:
            dev = getattr(a, "self_cuda_time_total", 0)
        rows.append({"name": a.key[:90], "calls": a.count, "self_cpu_ms": a.self_cpu_time_total / 1e3,
                     "self_dev_ms": dev / 1e3})
    rows.sort(key=lambda r: -r[key])
    return rows[:n]


async def main(args) -> dict:
    from engine import AsyncEngine, SamplingParams, StructuredOutputs

    ns = argparse.Namespace(model=args.model, device=args.device, dtype=args.dtype, seed=0,
                            engine_config={}, requests=args.requests, max_tokens=args.max_tokens)
    cfg = common.engine_config(ns, max_num_seqs=args.requests)
    out = {}
    async with AsyncEngine.open(cfg) as eng:
        async for _ in eng.generate("warm up", SamplingParams(max_tokens=4)):
            pass
        c = StructuredOutputs(json_schema=schema(20))
        await eng.grammars.compiled(c)
        await run_mode(eng, ns, 0.5, c)  # graphs, Triton kernels, xgrammar's threads
        for frac in args.fractions:
            common.sync(args.device)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
            prof = profile(activities=acts)
            # started and stopped on the step thread: its ops are recorded (the profiler's CPU
            # side sees the thread that started it)
            await eng._on_device(prof.start)
            t0 = time.perf_counter()
            m = await run_mode(eng, ns, frac, c)
            common.sync(args.device)
            wall = time.perf_counter() - t0
            await eng._on_device(prof.stop)
            busy_us, busy = busy_fraction(prof, wall * 1e6)
            label = m["constrained"]
            print(f"\n=== {label}: {m['tok_s']:.0f} tok/s, {m['ms_per_step']:.2f} ms a step "
                  f"(profiled), device busy {busy:.3f} ({busy_us / 1e3:.1f} ms of {wall * 1e3:.1f})")
            print({k: v for k, v in m.items() if k.startswith("late_")})
            dev = table(prof, "self_dev_ms", args.top)
            cpu = table(prof, "self_cpu_ms", args.top)
            print(f"{'device ms':>10} {'calls':>7}  kernel / op")
            for r in dev:
                print(f"{r['self_dev_ms']:10.2f} {r['calls']:7d}  {r['name']}")
            print(f"{'cpu ms':>10} {'calls':>7}  op")
            for r in cpu:
                print(f"{r['self_cpu_ms']:10.2f} {r['calls']:7d}  {r['name']}")
            out[label] = {"mode": m, "busy": busy, "wall_s": wall, "device": dev, "cpu": cpu}
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = anyio.run(main, a)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

"""Where a decode step's time goes on CUDA, per batch size: wall and CPU time of a step, its
phases (schedule / execute / update, each closed by a device sync), the forward's graph replay
alone, and the kernels launched per decode step (counted by the torch profiler, graphs off).

    python3 -m tools.profile_decode [--model random:qwen3-0.6b] [--batches 1 64 256]
        [--ctx 256] [--kernels] [--table] [--deterministic] [--prompt-table]

``--kernels`` profiles 3 steps and counts their kernels: run it with ``--no-cuda-graphs``
so that every kernel is seen (a graph replay hides them); ``--table``
prints the profiler's top CUDA kernels by total time, ``--cpu-table`` the top ops by self CPU
time (an eager step's host cost).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.params import SamplingParams
from engine.memory.owner import Resource as R
from engine.runner.model_runner import ModelRunner


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--cpu-table", action="store_true",
                    help="with --kernels: also the top ops by self CPU time (where an eager step's host time goes)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-cuda-graphs", action="store_true",
                    help="EngineConfig(cuda_graphs=False): eager decode steps, every kernel seen")
    ap.add_argument("--deterministic", action="store_true", help="EngineConfig(deterministic=True)")
    ap.add_argument("--prompt-table", action="store_true",
                    help="the prompts' steps of every batch after the first under the torch profiler: "
                         "top CUDA kernels and the device's busy time against the wall")
    a = ap.parse_args()
    r = ModelRunner(EngineConfig(model=a.model, device=a.device, kv_cache_bytes=16 * 2**30 if a.device == "cuda" else 2**28,
                                 max_num_seqs=max(a.batches), enable_prefix_caching=False,
                                 cuda_graphs=not a.no_cuda_graphs, deterministic=a.deterministic))
    r.load()
    results = []
    for n in a.batches:
        c = EngineCore(r)
        for i in range(n):
            c.add_request(f"{n}-{i}", [(i * 7 + j) % 50000 + 10 for j in range(a.ctx)],
                          SamplingParams(max_tokens=a.steps * 3 + 40, ignore_eos=True,
                                         temperature=a.temperature))
        sync()
        prof_p = (profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                  if a.prompt_table and results else None)
        t_pre = time.perf_counter()
        with prof_p or contextlib.nullcontext():
            while c.scheduler.waiting or any(q.num_computed_tokens < q.num_prompt_tokens
                                             for q in c.scheduler.running):
                c.step()
            sync()
            # the prompts' steps (the first batch's: cold; the profiler's own exit not counted)
            prompt_ms = (time.perf_counter() - t_pre) * 1e3
        if prof_p is not None:
            busy = sum(e.self_device_time_total for e in prof_p.key_averages()) / 1e3
            print(prof_p.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
            print(json.dumps({"batch": n, "prompt_wall_ms_profiled": round(prompt_ms, 1),
                              "prompt_device_busy_ms": round(busy, 1)}), flush=True)
        for _ in range(3):
            c.step()
        sync()
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(a.steps):
            c.step()
        sync()
        wall = (time.perf_counter() - t0) / a.steps * 1e3
        cpu = (time.process_time() - cpu0) / a.steps * 1e3
        ph = {"schedule": 0.0, "execute": 0.0, "update": 0.0}
        for _ in range(a.steps):
            t = time.perf_counter()
            batch = c.scheduler.schedule()
            sync(); t1 = time.perf_counter()
            res = r.execute(batch)
            sync(); t2 = time.perf_counter()
            c._update(batch, res)
            t3 = time.perf_counter()
            ph["schedule"] += t1 - t
            ph["execute"] += t2 - t1
            ph["update"] += t3 - t2
        ph = {k: v / a.steps * 1e3 for k, v in ph.items()}
        g = r._owner.get(R.CUDA_GRAPHS)
        replay = None
        if g is not None and g.captured:
            b = g.bucket(n)
            st = r._owner[R.MODEL_STATE]
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.inference_mode():
                g.run(b, None, None, st)
                e0.record()
                for _ in range(a.steps):
                    g.run(b, None, None, st)
                e1.record()
            sync()
            replay = e0.elapsed_time(e1) / a.steps
        kernels = None
        if a.kernels:
            with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])) as prof:
                for _ in range(3):
                    c.step()
                sync()
            kern = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
            kernels = len(kern) / 3
            if a.table:
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
            if a.cpu_table:
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
        row = dict(batch=n, ctx=a.ctx, prompt_steps_ms=round(prompt_ms, 1), step_ms=round(wall, 3), cpu_ms=round(cpu, 3),
                   replay_ms=None if replay is None else round(replay, 3),
                   kernels_per_step=kernels, **{k + "_ms": round(v, 3) for k, v in ph.items()})
        print(json.dumps(row), flush=True)
        results.append(row)
        c.abort_all("done")
    r.shutdown()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()

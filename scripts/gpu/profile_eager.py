"""Where an eager step's host time goes (issue 15: a later turn waits for eager prompt steps).

    python3 scripts/gpu/profile_eager.py [--model random:qwen3-0.6b] [--tokens 128 512 2048]

For each prompt size, steps of fresh requests with that many prompt tokens (one request a
step, after warm-up steps of the same size so that nothing compiles in the timed ones): the
host time of the step's launch (``runner.launch``, no sync) against the device time after it
(the sync), then cProfile over those launches, summed by where the time is spent: Triton's
Python launcher (``triton/``), torch's Python (``torch/``), the engine's own Python (``engine/``),
and C calls (aten ops, cuBLAS dispatch: ``{built-in}``). Prints a table and the 20 functions
with the most own time.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections import defaultdict

import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _where(filename: str) -> str:
    for key in ("triton/", "torch/", "engine/"):
        if key in filename:
            return key
    return "{built-in}" if filename == "~" else "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    r = ModelRunner(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                 enable_prefix_caching=False, max_num_seqs=8,
                                 max_num_batched_tokens=max(args.tokens), kv_cache_bytes=2**30))
    r.load()
    core = EngineCore(r)
    vocab = r.model_config.vocab_size
    launched: list[float] = []
    launch = r.launch

    def timed_launch(batch, defer):
        t = time.perf_counter()
        out = launch(batch, defer)
        launched.append(time.perf_counter() - t)
        return out

    object.__setattr__(r, "launch", timed_launch)  # (ModelRunner's __setattr__ guards resources)
    rows = []
    prof = cProfile.Profile()
    n = 0

    def one_step(tokens: int, profiled: bool) -> tuple[float, float]:
        nonlocal n
        n += 1
        core.add_request(f"e{n}", [(n * 31 + j) % (vocab - 1) for j in range(tokens)],
                         SamplingParams(max_tokens=1, ignore_eos=True))
        sync(args.device)
        launched.clear()
        t = time.perf_counter()
        if profiled:
            prof.enable()
        while core.has_work():
            core.step()
        if profiled:
            prof.disable()
        sync(args.device)
        return (launched[0] if launched else float("nan")), time.perf_counter() - t

    for tokens in args.tokens:
        for _ in range(3):  # warm-up: kernels compiled, cuBLAS's choice made for this size
            one_step(tokens, False)
        host, wall = zip(*(one_step(tokens, False) for _ in range(args.steps)))
        rows.append({"prompt_tokens": tokens, "launch_ms": statistics.median(host) * 1e3,
                     "step_ms": statistics.median(wall) * 1e3})
    for tokens in args.tokens:
        for _ in range(args.steps):
            one_step(tokens, True)
    st = pstats.Stats(prof)
    by_where: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for (filename, _line, _name), (_cc, nc, tt, _ct, _callers) in st.stats.items():
        by_where[_where(filename)] += tt
        calls[_where(filename)] += nc
    steps = args.steps * len(args.tokens)
    print(f"{args.model} {args.dtype} on {args.device}: eager prompt steps, one request each")
    print(f"{'prompt tokens':>14} {'launch ms (host)':>17} {'step ms (to tokens)':>20}")
    for row in rows:
        print(f"{row['prompt_tokens']:>14} {row['launch_ms']:>17.2f} {row['step_ms']:>20.2f}")
    print(f"cProfile over {steps} profiled steps (all sizes), own time per step:")
    for k, v in sorted(by_where.items(), key=lambda kv: -kv[1]):
        print(f"  {k:>12}: {v / steps * 1e3:8.2f} ms, {calls[k] / steps:8.0f} calls")
    st.sort_stats("tottime").print_stats(args.top)
    print(json.dumps({"rows": rows, "own_ms_per_step": {k: v / steps * 1e3 for k, v in by_where.items()},
                      "calls_per_step": {k: calls[k] / steps for k in calls}}))
    r.shutdown()


if __name__ == "__main__":
    main()

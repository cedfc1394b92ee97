"""The host's CPU cost of one non-blocking host-to-device copy, by size and source memory, while
the device is busy (a diagnostic for issue 23: a late step copies its constrained rows' grammar
masks, 256 rows x 4,740 words = 4.9 MB for Qwen3, and session 21 left ~0.27 ms of step-thread
CPU there on a slow host unexplained).

    python3 scripts/gpu/h2d_cost.py [--rows 1,64,256] [--words 4740] [--reps 200]

For each row count: the step thread's CPU time (``time.thread_time``) and wall time of
``dev[:n].copy_(host[:n], non_blocking=True)`` from pinned memory (as ``TokenBitmask``'s host
rows), from pageable memory, and of the pinned copy into a strided view (the full-width device
rows of before session 18); then ``TokenBitmask.grammar_rows`` itself at Qwen3's widths (and
whether its host rows are pinned). A matmul loop keeps the device busy so that no copy finds an idle
stream. Prints a table; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def busy(dev: torch.device) -> None:
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    for _ in range(20):
        a = a @ a
        a = a / a.norm()


def measure(dst: torch.Tensor, src: torch.Tensor, reps: int) -> tuple[float, float]:
    cpu = wall = 0.0
    for i in range(reps):
        if i % 20 == 0:
            busy(dst.device)
        c, w = time.thread_time(), time.perf_counter()
        dst.copy_(src, non_blocking=True)
        wall += time.perf_counter() - w
        cpu += time.thread_time() - c
    torch.cuda.synchronize()
    return 1e6 * cpu / reps, 1e6 * wall / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--words", type=int, default=4740)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = [int(x) for x in args.rows.split(",")]
    n_max = max(rows)
    pinned = torch.full((n_max, args.words), -1, dtype=torch.int32, pin_memory=True)
    pageable = torch.full((n_max, args.words), -1, dtype=torch.int32)
    flat = torch.empty(n_max * args.words, dtype=torch.int32, device=dev)
    wide = torch.empty(n_max, args.words + 8, dtype=torch.int32, device=dev)
    out = []
    for n in rows:
        packed = flat[: n * args.words].view(n, args.words)
        for name, dst, src in (("pinned", packed, pinned[:n]),
                               ("pageable", packed, pageable[:n]),
                               ("pinned, strided", wide[:n, : args.words], pinned[:n])):
            measure(dst, src, 5)  # warm
            cpu, wall = measure(dst, src, args.reps)
            out.append({"rows": n, "source": name, "mb": n * args.words * 4 / 1e6,
                        "cpu_us": cpu, "wall_us": wall})
            print(f"{n:5d} rows {n * args.words * 4 / 1e6:6.2f} MB  {name:16s} "
                  f"cpu {cpu:8.1f} us  wall {wall:8.1f} us", flush=True)
    # the engine's own path: TokenBitmask's host rows (pinned?) and grammar_rows' CPU cost
    from engine.structured.bitmask import Filling, TokenBitmask

    bits = TokenBitmask(n_max, 151936, dev, grammar_vocab=151665)  # Qwen3's widths
    print(f"TokenBitmask host rows pinned: {bits.host.is_pinned()}", flush=True)
    for n in rows:
        filling = Filling(None, list(range(n)))
        cpu = wall = 0.0
        for i in range(args.reps):
            if i % 20 == 0:
                busy(dev)
            c, w = time.thread_time(), time.perf_counter()
            bits.grammar_rows(filling)
            wall += time.perf_counter() - w
            cpu += time.thread_time() - c
        torch.cuda.synchronize()
        cpu, wall = 1e6 * cpu / args.reps, 1e6 * wall / args.reps
        out.append({"rows": n, "source": "TokenBitmask.grammar_rows", "cpu_us": cpu,
                    "wall_us": wall, "pinned": bits.host.is_pinned()})
        print(f"{n:5d} rows  TokenBitmask.grammar_rows  cpu {cpu:8.1f} us  wall {wall:8.1f} us",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

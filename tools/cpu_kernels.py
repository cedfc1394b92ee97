"""CPU linear kernels on the default model's shapes: fp32 / bf16 GEMM, torch's weight-only int8
and int4 kernels, fbgemm's fp16-weight GEMM, and (with the C++ extension) the engine's 4-bit
kernel against a float32 or bf16 GEMM on its weight dequantized for the call (what prompt
steps of 128+ rows ran before 2026-12-08, engine/ops/cpu/packed_linear.py _int4); best-of-N
microseconds per call (random weights).

    python -m tools.cpu_kernels [--threads 2] [--rows 1 8 64] [--iters 30]

What ``engine/model/cpu_weights.py`` bases its ``auto`` choice on: run it on a new CPU to check.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch

# SmolLM2-135M: q/o (576x576), k/v (192x576), gate/up (1536x576), down (576x1536), head (49152x576)
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def best_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def kernels(n: int, k: int, m: int) -> dict[str, Callable[[], object]]:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g) * 0.02
    x = torch.randn(m, k, generator=g)
    wb, xb = w.bfloat16(), x.bfloat16()
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(n, generator=g)
    q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g), 1)
    sz = torch.rand(k // 32, n, 2, generator=g)
    p16 = torch.ops.quantized.linear_prepack_fp16(w, None)
    F = torch.nn.functional
    ours: dict[str, Callable[[], object]] = {}
    from engine.ops.cpu import cpu_ext
    if cpu_ext.int4_usable(n, k):  # the engine's 4-bit kernel and the dense paths of many rows
        from engine.ops.cpu.packed_linear import pack_int4_blocks
        b4, d16, m16, _ = pack_int4_blocks(w)
        ext = cpu_ext.module()
        ours = {"int4_mm": lambda: cpu_ext.int4_mm(x, b4, d16, m16),
                "int4_dequant_f32_mm": lambda: torch.mm(x, ext.int4_dequant_t(b4, d16, m16, True)),
                "int4_dequant_bf16_mm": lambda: torch.mm(xb, ext.int4_dequant_t(b4, d16, m16))}
    return ours | {
        "fp32": lambda: F.linear(x, w),
        "bf16": lambda: F.linear(xb, wb),
        "int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8),
        "int8pack_bf16": lambda: torch.ops.aten._weight_int8pack_mm(xb, q8, s8.bfloat16()),
        "int4pack": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4, 32, sz),
        "int4pack_bf16": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, q4, 32, sz.bfloat16()),
        "fbgemm_fp16": lambda: torch.ops.quantized.linear_dynamic_fp16(x, p16),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.cpu_kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--shapes", default="all", help="'all' or 'layer' (no LM head)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bench" / "results" / "cpu_kernels.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cap = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, CPU capability {cap}, {a.threads} thread(s); best of {a.iters}, us/call")
    shapes = SHAPES if a.shapes == "all" else SHAPES[:-1]
    rows = []
    for n, k in shapes:
        for m in a.rows:
            r = {"n": n, "k": k, "rows": m}
            for name, fn in kernels(n, k, m).items():
                try:
                    r[name] = round(best_us(fn, a.iters), 1)
                except Exception as exc:  # a kernel this build lacks
                    r[name] = f"error: {type(exc).__name__}"
            rows.append(r)
            print("  ".join(f"{key}={val}" for key, val in r.items()), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"benchmark": "cpu_kernels", "command": " ".join(sys.argv),
                                 "torch": torch.__version__, "cpu_capability": cap,
                                 "machine": platform.processor() or platform.machine(),
                                 "threads": a.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Deterministic mode's CUDA kernels (engine/ops/triton/invariant.py) against the default path's,
on the qwen3-0.6b layer shapes (bf16): the GEMM (one launch; the o/down projections' slices in one
launch against one GEMM per slice plus the adds) beside cuBLAS, and the paged attention by keys
per step and warps beside the default split decode kernel; with slices, each launch (one program
over the slices, a slice a program) forced. Times are device ms a call (CUDA graphs of repeated
calls, replayed). Prints a table and writes JSON.

    python3 -m tools.bench_invariant_kernels [--out kernels.json]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from engine.model import invariant as model_inv
from engine.ops.triton import decode_attention as ta, prefill_attention
from engine.ops.triton import invariant as inv
from tools.cuda_timing import timed

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=None)
ap.add_argument("--rows", default="1,16,64,128,256,2048")
ap.add_argument("--points", default="1x1024,64x1024,256x1024,16x4096")
ap.add_argument("--keys", default="16,32,64")
ap.add_argument("--warps", default="4,8")
a = ap.parse_args()
dev, dt = "cuda", torch.bfloat16
HID, H, KVH, D, INTER, bs = 1024, 16, 8, 128, 3072, 16
torch.manual_seed(0)


def unfused_parts(x, w, parts):  # one GEMM per slice, a copy and a cast each, the adds
    k = x.shape[-1] // parts
    ps = torch.stack([inv.linear(x[:, i * k:(i + 1) * k].contiguous(), w[:, i * k:(i + 1) * k]).float()
                      for i in range(parts)])
    return model_inv.add_in_order(ps, x.dtype)


rows_out = []
shapes = {"qkv": ((H + 2 * KVH) * D, HID, model_inv.K_SPLIT), "o (8 slices)": (HID, H * D, KVH),
          "gate_up": (2 * INTER, HID, model_inv.K_SPLIT), "down (8 slices)": (HID, INTER, KVH),
          "lm head": (151936, HID, 1)}
for m in [int(v) for v in a.rows.split(",")]:
    for name, (n, k, parts) in shapes.items():
        if name == "lm head" and m > 256:
            continue
        x = torch.randn(m, k, device=dev, dtype=dt)
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        rounded = "slices" in name
        r = {"op": name, "rows": m, "cublas_ms": timed(lambda: F.linear(x, w)),
             "invariant_ms": timed(lambda: inv.linear(x, w, parts=parts, rounded=rounded))}
        if parts > 1:  # each launch forced: one program over the slices, a slice a program
            one = inv.linear(x, w, parts=parts, rounded=rounded, split=False)
            assert torch.equal(inv.linear(x, w, parts=parts, rounded=rounded, split=True), one), name
            r["one_program_ms"] = timed(lambda: inv.linear(x, w, parts=parts, rounded=rounded, split=False))
            r["split_ms"] = timed(lambda: inv.linear(x, w, parts=parts, rounded=rounded, split=True))
        if rounded:
            r["unfused_ms"] = timed(lambda: unfused_parts(x, w, parts))
            assert torch.equal(unfused_parts(x, w, parts), inv.linear(x, w, parts=parts)), name
        rows_out.append(r)
        print(f"gemm {name:16s} rows {m:5d}: cuBLAS {r['cublas_ms']:.4f}  invariant "
              f"{r['invariant_ms']:.4f}" + "".join(f"  {k[:-3]} {r[k]:.4f}" for k in
                                                    ("one_program_ms", "split_ms", "unfused_ms") if k in r),
              flush=True)

att = []
for b, ctx in [tuple(int(v) for v in p.split("x")) for p in a.points.split(",")]:
    width = -(-ctx // bs)
    nblocks = b * width + 1
    cache = torch.randn(2, nblocks, bs, KVH, D, device=dev, dtype=dt)
    bt = torch.randperm(nblocks, device=dev)[: b * width].view(b, width).contiguous()
    q = torch.randn(b, H, D, device=dev, dtype=dt)
    lens = torch.full((b,), ctx, device=dev)
    out = torch.empty_like(q)
    rows = torch.arange(b, device=dev)
    kv_bytes = b * ctx * KVH * D * 2 * 2
    base = timed(lambda: ta.decode_attention(q, cache, rows, bt, lens, D ** -0.5, out))
    r = {"batch": b, "ctx": ctx, "default_ms": base}
    line = f"attention {b}x{ctx}: default {base:.4f} ms ({kv_bytes / base / 1e9:.2f} TB/s)"
    dec = (rows, bt, lens)
    for keys in [int(v) for v in a.keys.split(",")]:
        for warps in [int(v) for v in a.warps.split(",")]:
            t = timed(lambda: inv.attention(q, cache, D ** -0.5, dec, keys=keys, warps=warps))
            r[f"k{keys}w{warps}_ms"] = t
            line += f" | k{keys} w{warps} {t:.4f}"
    # a decode step's launch: each row's key segments in programs of their own, then the merge
    one = inv.attention(q, cache, D ** -0.5, dec)
    assert torch.equal(inv.attention(q, cache, D ** -0.5, dec, split=True), one)
    r["split_ms"] = timed(lambda: inv.attention(q, cache, D ** -0.5, dec, split=True))
    line += f" | split {r['split_ms']:.4f}"
    att.append(r)
    print(line, flush=True)

# a prompt step: 2 sequences of 1,024 fresh queries (causal), as paged prompt chunks (tiles of
# query_tile rows) against each query as a decode row of its own
n_q, seqs = 1024, 2
width = n_q // bs
cache = torch.randn(2, seqs * width + 1, bs, KVH, D, device=dev, dtype=dt)
q = torch.randn(seqs * n_q, H, D, device=dev, dtype=dt)
bt = torch.arange(seqs * width, device=dev).view(seqs, width).repeat_interleave(n_q, 0)
lens = torch.arange(1, n_q + 1, device=dev).repeat(seqs)
chunks = prefill_attention.build([(s * n_q, n_q, n_q, list(range(s * width, (s + 1) * width)))
                                  for s in range(seqs)], bs, q.device)
each = (torch.arange(seqs * n_q, device=dev), bt, lens)
prefill = {"queries": seqs * n_q, "tiled_ms": timed(lambda: inv.attention(q, cache, D ** -0.5, chunks=chunks), 10),
           "per_row_ms": timed(lambda: inv.attention(q, cache, D ** -0.5, each), 10)}
print(f"prefill attention 2x1024: tiles of {inv.query_tile(H // KVH)} {prefill['tiled_ms']:.3f} ms, a tile per row "
      f"{prefill['per_row_ms']:.3f} ms", flush=True)

if a.out:
    with open(a.out, "w") as f:
        json.dump({"gemm": rows_out, "attention": att, "prefill": prefill, "device": torch.cuda.get_device_name()}, f,
                  indent=1)

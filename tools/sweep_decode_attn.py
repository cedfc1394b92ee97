"""The paged decode kernel's launch parameters swept on the qwen3-0.6b layer shape (16 q heads,
8 KV heads, D=128, bf16, block 16): K/V bytes read over the kernel's time (split reduce
included) for each (tile, warps, stages, split) and each (batch, context) point, then the best
configuration by the geometric mean over the points. Prints a table and writes JSON.

    python3 -m tools.sweep_decode_attn [--out sweep.json]
"""
import argparse
import itertools
import json
import math

import torch

from engine.ops.triton import decode_attention as ta

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=None)
ap.add_argument("--points", default="256x1024,64x4096,16x1024,1x256,1x4096")
a = ap.parse_args()
H, KVH, D, bs = 16, 8, 128, 16
points = [tuple(int(x) for x in p.split("x")) for p in a.points.split(",")]
torch.manual_seed(0)
setups = []
for b, ctx in points:
    width = -(-ctx // bs)
    nblocks = b * width + 1
    cache = torch.randn(2, nblocks, bs, KVH, D, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(nblocks, device="cuda")[: b * width].view(b, width).contiguous()
    q = torch.randn(b, H, D, device="cuda", dtype=torch.bfloat16)
    setups.append(dict(b=b, ctx=ctx, cache=cache, bt=bt, q=q, rows=torch.arange(b, device="cuda"),
                       cl=torch.full((b,), ctx, device="cuda"), out=torch.empty_like(q),
                       kv_bytes=b * ctx * KVH * D * 2 * 2))


def timed(s, n=30):
    fn = lambda: ta.decode_attention(s["q"], s["cache"], s["rows"], s["bt"], s["cl"], D ** -0.5, s["out"])
    fn(); torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n / 1e3


rows = []
ref = None
for tile, warps, stages, split in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4), (512, 1024)):
    if split % tile:
        continue
    ta.TILE_TOKENS, ta.NUM_WARPS, ta.NUM_STAGES, ta.SPLIT_TOKENS = tile, warps, stages, split
    try:
        tbs = [s["kv_bytes"] / timed(s) / 1e12 for s in setups]
    except Exception as exc:  # a config Triton cannot compile (shared memory): skipped
        print(f"tile {tile} warps {warps} stages {stages} split {split}: {type(exc).__name__}", flush=True)
        continue
    gm = math.exp(sum(math.log(x) for x in tbs) / len(tbs))
    rows.append(dict(tile=tile, warps=warps, stages=stages, split=split, tb_s=tbs, geomean=gm))
    print(f"tile {tile:3d} warps {warps} stages {stages} split {split:4d}: "
          + " ".join(f"{p[0]}x{p[1]} {x:.2f}" for p, x in zip(points, tbs)) + f"  gm {gm:.2f} TB/s", flush=True)
best = max(rows, key=lambda r: r["geomean"])
cur = next((r for r in rows if (r["tile"], r["warps"], r["stages"], r["split"]) == (64, 4, 2, 512)), None)
print("current (64, 4, 2, 512):", cur and [round(x, 2) for x in cur["tb_s"]], cur and round(cur["geomean"], 2))
print("best:", best)
for i, p in enumerate(points):
    r = max(rows, key=lambda r: r["tb_s"][i])
    print(f"best at {p[0]}x{p[1]}: {r['tb_s'][i]:.2f} TB/s with tile {r['tile']} warps {r['warps']} "
          f"stages {r['stages']} split {r['split']}")
if a.out:
    json.dump(dict(points=points, rows=rows, best=best), open(a.out, "w"), indent=1)

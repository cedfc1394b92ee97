"""Deterministic mode's GEMM (engine/ops/triton/invariant.py ``_gemm_kernel``) under other tile
shapes: does a row get the same bits as under the engine's one configuration, and how long does
each take (device ms a call, CUDA graph replay) at decode and prompt row counts, on the
qwen3-0.6b layer shapes (bf16). If a shape gives the same bits at every row count, the engine
may pick tiles by row count without changing a token.

    python3 -m tools.invariant_gemm_tiles [--rows 1,64,256,2048] [--out tiles.json]
"""
import argparse
import json

import torch
import torch.nn.functional as F

from engine.model import invariant as model_inv
from engine.ops.triton import invariant as inv, invariant_gemm as ig
from tools.cuda_timing import timed

ap = argparse.ArgumentParser()
ap.add_argument("--rows", default="1,64,256,2048")
ap.add_argument("--out", default=None)
ap.add_argument("--flat", action="store_true",
                help="the one-loop kernel (_gemm_flat_kernel) under tile shapes and group sizes instead")
ap.add_argument("--attention", action="store_true",
                help="the decode attention's block of (query, head) rows and warps instead: bits and times")
a = ap.parse_args()
dev, dt = "cuda", torch.bfloat16
HID, H, KVH, D, INTER = 1024, 16, 8, 128, 3072
torch.manual_seed(0)
# (BM, BN, BK, warps, stages); the first is the engine's
CONFIGS = [(inv.BLOCK_M, inv.BLOCK_N, inv.BLOCK_K, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
           (64, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
           (64, 64, 128, 4, 3), (64, 128, 128, 8, 3), (128, 128, 128, 8, 3)]
SHAPES = {"qkv": ((H + 2 * KVH) * D, HID, model_inv.K_SPLIT, False),
          "o": (HID, H * D, KVH, True), "gate_up": (2 * INTER, HID, model_inv.K_SPLIT, False),
          "down": (HID, INTER, KVH, True), "head": (151936, HID, 1, False)}


def run(x, w, parts, rounded, cfg, split):
    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    flags = dict(IEEE=False, PARTS=parts, ROUND=rounded, BM=bm, BN=bn, BK=bk,
                 num_warps=warps, num_stages=stages)
    tiles = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    if split:
        part = torch.empty(parts, m, n, dtype=torch.float32, device=x.device)
        ig._gemm_kernel[(*tiles, parts)](x, w, part, m, n, k // parts, x.stride(0), w.stride(0),
                                          part.stride(-2), part.stride(0), SUM=False, SPLIT=True,
                                          **flags)
        ig._sum_kernel[(triton.cdiv(m * n, ig.SUM_BLOCK),)](part, y, m * n, part.stride(0),
                                                            PARTS=parts, BLOCK=ig.SUM_BLOCK)
    else:
        ig._gemm_kernel[tiles](x, w, y, m, n, k // parts, x.stride(0), w.stride(0), y.stride(0),
                                0, SUM=True, SPLIT=False, **flags)
    return y


triton = inv.triton
out = []
FLAT = [(64, 64, 64, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3),
        (64, 128, 64, 4, 4)]


def run_flat(x, w, parts, rounded, cfg):
    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    ig._gemm_flat_kernel[grid](x, w, y, m, n, k // parts, x.stride(0), w.stride(0), y.stride(0), 0,
                                IEEE=False, PARTS=parts, ROUND=rounded, GROUP_M=8,
                                BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return y


def problems(rows: str):
    """(name, rows, x, w, parts, rounded, the engine's output) of each layer shape at each row
    count of ``rows`` (the LM head up to 256 rows)."""
    for m in [int(v) for v in rows.split(",") if v]:
        for name, (n, k, parts, rounded) in SHAPES.items():
            if name == "head" and m > 256:
                continue
            x = torch.randn(m, k, device=dev, dtype=dt)
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
            yield name, m, x, w, parts, rounded, inv.linear(x, w, parts=parts, rounded=rounded)


if a.flat:
    for name, m, x, w, parts, rounded, ref in problems(a.rows):
        line = (f"{name:8s} rows {m:5d}: cuBLAS {timed(lambda: F.linear(x, w)):.4f} engine "
                f"{timed(lambda: inv.linear(x, w, parts=parts, rounded=rounded)):.4f}")
        for cfg in FLAT:
            try:
                same = bool(torch.equal(run_flat(x, w, parts, rounded, cfg), ref))
                ms = timed(lambda: run_flat(x, w, parts, rounded, cfg))
            except Exception as e:  # (a shape the compiler refuses: out of shared memory)
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            out.append(dict(op=name, rows=m, config=cfg, same_bits=same, ms=ms))
            line += (f" | {'x'.join(map(str, cfg[:3]))}w{cfg[3]}s{cfg[4]} {ms:.4f}"
                     f"{'' if same else ' DIFF'}")
        print(line, flush=True)
    a.rows = ""
if a.attention:
    bs = 16
    for b, ctx in ((64, 600), (64, 1024), (256, 1024), (8, 4096)):
        width = -(-ctx // bs)
        nblocks = b * width + 1
        cache = torch.randn(2, nblocks, bs, KVH, D, device=dev, dtype=dt)
        bt = torch.randperm(nblocks, device=dev)[: b * width].view(b, width).contiguous()
        q = torch.randn(b, H, D, device=dev, dtype=dt)
        lens = torch.randint(ctx // 2, ctx + 1, (b,), device=dev)
        dec = (torch.arange(b, device=dev), bt, lens)
        ref = inv.attention(q, cache, D ** -0.5, dec)
        line = f"attention {b}x{ctx}:"
        for rows in (16, 32, 64):
            for warps in (2, 4, 8):
                for split in (False, True):
                    try:
                        got = inv.attention(q, cache, D ** -0.5, dec, block_rows=rows, warps=warps, split=split)
                        same = bool(torch.equal(got, ref))
                        ms = timed(lambda: inv.attention(q, cache, D ** -0.5, dec, block_rows=rows,
                                                         warps=warps, split=split))
                    except Exception as e:
                        print(f"  rows {rows} warps {warps}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                        continue
                    out.append(dict(op="attention", batch=b, ctx=ctx, block_rows=rows, warps=warps,
                                    split=split, same_bits=same, ms=ms))
                    line += f" | r{rows}w{warps}{'S' if split else ''} {ms:.4f}{'' if same else ' DIFF'}"
        print(line, flush=True)
    a.rows = ""
for name, m, x, w, parts, rounded, ref in problems(a.rows):
    line = f"{name:8s} rows {m:5d}: cuBLAS {timed(lambda: F.linear(x, w)):.4f}"
    for cfg in CONFIGS:
        for split in ([False, True] if parts > 1 else [False]):
            try:
                y = run(x, w, parts, rounded, cfg, split)
                same = bool(torch.equal(y, ref))
                ms = timed(lambda: run(x, w, parts, rounded, cfg, split))
            except Exception as e:  # (a shape the compiler refuses: out of shared memory)
                same, ms = None, None
                print(f"  {cfg} split={split}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            out.append(dict(op=name, rows=m, config=cfg, split=split, same_bits=same, ms=ms))
            if ms is not None:
                line += f" | {'x'.join(map(str, cfg[:3]))}w{cfg[3]}s{cfg[4]}{'S' if split else ''} {ms:.4f}{'' if same else ' DIFF'}"
    print(line, flush=True)
if a.out:
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": out}, f, indent=1)

"""The paged prefill attention kernel (engine/ops/triton/prefill_attention.py) by launch choice, on the device
(a graphed ~2,000-token prompt step of random:qwen3-0.6b took 9-11 ms on the H200, about
3x what its FLOPs need; attention is the part that grows with the cached context).

    python3 scripts/gpu/bench_prefill_attn.py [--out results.json] [--reps 50]
    TRITON_INTERPRET=1 python3 scripts/gpu/bench_prefill_attn.py --dry-run   # the script's
        logic on CPU (Triton's interpreter, small shapes, fp32, wall-clock times)

Shapes (bf16, block size 16, the KV blocks scattered through a cache of 20k blocks):
``cached``: bench.prefix's later turns, 22 chunks of 93 queries after ~1,200 cached tokens;
``fresh``: one 2,048-token prompt; ``halves``: two fresh 1,024-token prompts. Models:
qwen3-0.6b (16 heads, 8 KV heads, dim 128) and llama-3.2-1b (32 / 8, dim 64). Every choice of
``KernelChoice`` in the sweep (heads packed a program 1 / 2, stacked or interleaved, key tile
32 / 64 / 128, warps 4 / 8, stages 2 / 3) is checked against the default kernel's output (bf16:
max |diff| reported) and
timed with CUDA events (median of ``--reps``, after warm-up). TFLOP/s counts the causal work
(4 x queries x keys seen x dim x heads). For scale, torch's SDPA (flash) over a dense copy of the
same keys, non-causal (a little more work than ours), where it runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.ops.triton import prefill_attention as tp  # noqa: E402

MODELS = {"qwen3-0.6b": (16, 8, 128), "llama-3.2-1b": (32, 8, 64)}
SHAPES = {"cached": [(93, 1300 + 7 * (i % 5)) for i in range(22)],
          "fresh": [(2048, 2048)], "halves": [(1024, 1024), (1024, 1024)]}


DEV, DTYPE = "cuda", torch.bfloat16


def make(heads: int, kv_heads: int, dim: int, shape, nb: int = 20000, bs: int = 16):
    g = torch.Generator(device=DEV).manual_seed(0)
    cache = torch.randn(2, nb, bs, kv_heads, dim, device=DEV, dtype=DTYPE, generator=g)
    perm = torch.randperm(nb - 1, device=DEV, generator=g) + 1
    chunks, row, used = [], 0, 0
    for n, ctx in shape:
        nblk = -(-ctx // bs)
        chunks.append((row, n, ctx, perm[used:used + nblk].tolist()))
        used += nblk
        row += n
    q = torch.randn(row, heads, dim, device=DEV, dtype=DTYPE, generator=g)
    return q, cache, chunks


def flops(shape, heads: int, dim: int) -> float:
    seen = sum(n * (ctx - n) + n * (n + 1) / 2 for n, ctx in shape)
    return 4.0 * seen * dim * heads


def timed(fn, reps: int) -> float:
    if DEV != "cuda":  # the dry run: wall-clock, once
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def sdpa_ms(q, cache, chunks, reps: int):
    """Flash SDPA over dense copies of each chunk's keys (batched by equal shapes)."""
    gqa = q.shape[1] // cache.shape[3]
    bs = cache.shape[2]
    ins = []
    for qs, n, ctx, blocks in chunks:
        tok = torch.arange(ctx, device=DEV)
        phys = torch.tensor(blocks, device=DEV)[tok // bs]
        k = cache[0][phys, tok % bs].repeat_interleave(gqa, 1).transpose(0, 1)[None]
        v = cache[1][phys, tok % bs].repeat_interleave(gqa, 1).transpose(0, 1)[None]
        ins.append((q[qs:qs + n].transpose(0, 1)[None], k.contiguous(), v.contiguous()))
    if len({(a.shape, b.shape) for a, b, _ in ins}) == 1:
        qq = torch.cat([a for a, _, _ in ins])
        kk = torch.cat([b for _, b, _ in ins])
        vv = torch.cat([c for _, _, c in ins])
        return timed(lambda: F.scaled_dot_product_attention(qq, kk, vv), reps)
    return timed(lambda: [F.scaled_dot_product_attention(a, b, c) for a, b, c in ins], reps)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    ap.add_argument("--packed", type=ints, default=(1, 2))
    ap.add_argument("--block-n", type=ints, default=(32, 64, 128))
    ap.add_argument("--warps", type=ints, default=(4, 8))
    ap.add_argument("--stages", type=ints, default=(2,))
    ap.add_argument("--interleave", type=ints, default=(0, 1),
                    help="1: packed heads' rows interleaved in one 64-row block (a part of the "
                         "tile's queries a program; only with packed > 1)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, Triton's interpreter, small shapes: the script's own logic")
    args = ap.parse_args()
    global DEV, DTYPE, MODELS, SHAPES
    if args.dry_run:
        DEV, DTYPE = "cpu", torch.float32
        tp_choice_check = os.environ.get("TRITON_INTERPRET") == "1"
        if not tp_choice_check:
            ap.error("--dry-run needs TRITON_INTERPRET=1 in the environment")
        MODELS = {"tiny": (4, 2, 32)}
        SHAPES = {"cached": [(9, 40), (5, 70)], "fresh": [(33, 33)]}
    packs, tiles, warps, stages = args.packed, args.block_n, args.warps, args.stages
    choices = [tp.KernelChoice(p, n, w, s, il) for p, n, w, s, il
               in itertools.product(packs, tiles, warps, stages, args.interleave)
               if not (il and p == 1)]  # (interleaving one head is the plain layout)
    rows = []
    for model, (heads, kv_heads, dim) in MODELS.items():
        for shape_name, shape in SHAPES.items():
            q, cache, chunks = make(heads, kv_heads, dim, shape, nb=400 if args.dry_run else 20000)
            batch = tp.build(chunks, cache.shape[2], torch.device(DEV))
            ref = torch.zeros_like(q)
            tp.prefill_attention(q, cache, batch, dim ** -0.5, ref, tp.KernelChoice())
            work = flops(shape, heads, dim)
            try:
                dense = sdpa_ms(q, cache, chunks, args.reps)
            except Exception as exc:  # noqa: BLE001 - a reference figure only
                dense = None
                print(f"sdpa {model} {shape_name}: {exc!r}")
            for c in choices:
                out = torch.zeros_like(q)
                try:
                    fn = lambda: tp.prefill_attention(q, cache, batch, dim ** -0.5, out, c)  # noqa: E731
                    ms = timed(fn, args.reps)
                    diff = (out.float() - ref.float()).abs().max().item()
                except Exception as exc:  # noqa: BLE001 - a choice that does not compile here
                    print(f"{model} {shape_name} {c}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                rows.append(dict(model=model, shape=shape_name, packed=c.packed, block_n=c.block_n,
                                 warps=c.warps, stages=c.stages,
                                 interleave=c.interleave, ms=ms,
                                 tflops=work / ms / 1e9, max_diff=diff, sdpa_ms=dense))
            best = min((r for r in rows if r["model"] == model and r["shape"] == shape_name),
                       key=lambda r: r["ms"])
            # a program a head (packed 1, 64 keys, 4 warps, 2 stages), and the default launch
            plain = next((r for r in rows if r["model"] == model and r["shape"] == shape_name
                          and (r["packed"], r["block_n"], r["warps"], r["stages"],
                               r["interleave"]) == (1, 64, 4, 2, 0)), best)
            default = next((r for r in rows if r["model"] == model and r["shape"] == shape_name
                            and (r["packed"], r["block_n"], r["warps"], r["stages"],
                                 r["interleave"]) == (2, 64, 4, 2, 1)), best)
            print(f"{model:13s} {shape_name:7s} plain {plain['ms']:.3f} ms ({plain['tflops']:.0f} "
                  f"TFLOP/s)  default {default['ms']:.3f} ms ({default['tflops']:.0f})  "
                  f"best {best['ms']:.3f} ms ({best['tflops']:.0f}) packed={best['packed']} "
                  f"block_n={best['block_n']} warps={best['warps']} stages={best['stages']} "
                  f"interleave={best['interleave']} "
                  f"diff {best['max_diff']:.3g}  sdpa {dense if dense is None else round(dense, 3)} ms",
                  flush=True)
            if args.out:  # after every shape, so that a run cut off at its limit still leaves rows
                dump(args.out, rows)
    print(f"{'model':13s} {'shape':7s} {'choice':28s} {'ms':>7s} {'TFLOP/s':>8s} {'diff':>8s}")
    for r in sorted(rows, key=lambda r: (r["model"], r["shape"], r["ms"])):
        ch = f"p{r['packed']} n{r['block_n']} w{r['warps']} s{r['stages']} il{r['interleave']}"
        print(f"{r['model']:13s} {r['shape']:7s} {ch:28s} {r['ms']:7.3f} {r['tflops']:8.0f} "
              f"{r['max_diff']:8.2g}")
    if args.out:
        dump(args.out, rows)
    return 0


def dump(path: str, rows: list) -> None:
    with open(path, "w") as f:
        json.dump({"rows": rows, "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu"},
                  f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())

"""Sleep mode: latency of sleep and wake by level and by part, bytes given back, cycles.

    python -m bench.sleep --device cpu                    # random:tiny-llama fp32, seconds
    python -m bench.sleep --device cuda                   # random:qwen3-0.6b, random:llama-3.2-1b bf16

Per model, in-process (``AsyncEngine``), after a warm-up that captured the decode graphs:

1. **Levels 1 and 2**: ``sleep(level)`` and ``wake_up()``, each timed in total and by part
   (``ModelRunner.sleep_timings``: release of graphs/buffers/KV cache, weight offload, emptying
   the caches; wake: weights copied back or reloaded, KV cache and buffers rebuilt), then the
   first request after the wake (its time to first token includes the lazy graph recapture)
   against the same request before the sleep. Memory before load, serving, asleep, awake:
   cuda ``memory_allocated`` / ``memory_reserved`` (asleep they must equal the figures before
   load: 0 B held by the engine), page-locked host bytes (``torch.cuda.host_memory_stats``) and
   process RSS; greedy outputs compared with those before the sleep.
2. **Cycles**: ``--cycles`` (50 on cuda, 10 on cpu) sleep/wake cycles alternating levels 1 and 2, the memory after
   each sleep and each wake; growth = last - first.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio
import torch

from . import common
from .common import now
from .resources import memory_snapshot, mib

CUDA_MODELS = ("random:qwen3-0.6b", "random:llama-3.2-1b")


def _pinned_bytes(device) -> int:
    """Page-locked host bytes held by torch's host allocator (0 without CUDA)."""
    if torch.device(device).type != "cuda":
        return 0
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
        if key in stats:
            return int(stats[key])
    return -1


def _mem(device) -> dict[str, Any]:
    snap = memory_snapshot(device)
    snap["pinned"] = _pinned_bytes(device)
    return snap


async def _greedy(eng, prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy outputs of ``prompts`` run together; the first request's time to first token."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outs: list[list[int]] = [[] for _ in prompts]
    ttft: list[float] = []
    t0 = now()

    async def one(i: int) -> None:
        async for o in eng.generate(prompts[i], params):
            if i == 0 and not ttft:
                ttft.append(now() - t0)
            outs[i] += o.token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return outs, ttft[0]


async def bench_model(args, model: str) -> dict[str, Any]:
    from engine import AsyncEngine, EngineConfig

    device = torch.device(args.device)
    cfg = EngineConfig(model=model, device=args.device, dtype=args.dtype, seed=args.seed,
                       kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=max(8, args.batch),
                       **args.engine_config)
    prompts = [[(31 * i + 7 * j) % 250 + 1 for j in range(args.prompt_len)] for i in range(args.batch)]
    res: dict[str, Any] = {"model": model, "memory_before": _mem(device)}
    async with AsyncEngine.open(cfg) as eng:
        # Compared runs all start from an empty prefix cache (a wake empties it): a prompt served
        # from the cache takes another attention path, and random weights' near-flat logits
        # flip a token on any such difference.
        cold = eng.core.blocks.reset_prefix_cache
        await _greedy(eng, prompts, args.max_tokens)  # warm-up: graphs captured
        cold()
        ref, _ = await _greedy(eng, prompts, args.max_tokens)
        cold()
        again, _ = await _greedy(eng, prompts, args.max_tokens)
        # without a sleep: are two runs of the same requests identical here at all? (random
        # weights give near-flat logits; any change of kernel or batch shape may flip a token)
        res["deterministic_without_sleep"] = again == ref
        _, res["ttft_warm_s"] = await _greedy(eng, prompts[:1], 4)
        res["memory_serving"] = _mem(device)
        res["levels"] = {}
        for level in (1, 2):
            row: dict[str, Any] = {}
            t = now()
            await eng.sleep(level=level)
            row["sleep_s"] = now() - t
            row["sleep_parts"] = dict(eng.runner.sleep_timings)
            row["memory_asleep"] = _mem(device)
            row["host_bytes_kept"] = eng._sleep.host_bytes
            t = now()
            await eng.wake_up()
            row["wake_s"] = now() - t
            row["wake_parts"] = dict(eng.runner.sleep_timings)
            _, row["ttft_first_after_wake_s"] = await _greedy(eng, prompts[:1], 4)
            row["memory_awake"] = _mem(device)
            cold()
            got, _ = await _greedy(eng, prompts, args.max_tokens)
            row["outputs_identical"] = got == ref
            res["levels"][level] = row
        cycles = []
        t = now()
        for c in range(args.cycles):
            await eng.sleep(level=1 + c % 2)
            asleep = _mem(device)
            await eng.wake_up()
            cycles.append({"asleep": asleep, "awake": _mem(device)})
        res["cycles_s"] = now() - t
        cold()
        got, _ = await _greedy(eng, prompts, args.max_tokens)
        res["outputs_identical_after_cycles"] = got == ref
    res["memory_after_shutdown"] = _mem(device)
    res["cycles"] = _growth(cycles, device)
    return res


def _key(device) -> str:
    return "allocated" if torch.device(device).type == "cuda" else "rss_anon"


def _growth(cycles: list[dict], device) -> dict[str, Any]:
    if not cycles:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(cycles)}
    keys = ["rss", "pinned"] + (["allocated", "reserved"] if torch.device(device).type == "cuda" else ["rss_anon"])
    for phase in ("asleep", "awake"):
        for k in keys:
            xs = [c[phase].get(k, 0) for c in cycles]
            out[f"{phase}_{k}_first"] = xs[0]
            out[f"{phase}_{k}_last"] = xs[-1]
            out[f"{phase}_{k}_growth"] = xs[-1] - xs[0]
    return out


def report(res: dict[str, Any], device) -> None:
    cuda = torch.device(device).type == "cuda"
    base = res["memory_before"]
    print(f"\n== {res['model']} ==")
    if cuda:
        print(f"serving: allocated {mib(res['memory_serving']['allocated'])} MiB, "
              f"reserved {mib(res['memory_serving']['reserved'])} MiB")
    for level, row in res["levels"].items():
        asleep = row["memory_asleep"]
        parts = ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in row["sleep_parts"].items())
        wparts = ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in row["wake_parts"].items())
        print(f"level {level}: sleep {row['sleep_s'] * 1e3:.1f} ms ({parts}); wake "
              f"{row['wake_s'] * 1e3:.1f} ms ({wparts}); first request after wake TTFT "
              f"{row['ttft_first_after_wake_s'] * 1e3:.1f} ms (warm {res['ttft_warm_s'] * 1e3:.1f})")
        if cuda:
            print(f"  asleep: allocated {asleep['allocated'] - base['allocated']:+d} B, reserved "
                  f"{asleep['reserved'] - base['reserved']:+d} B vs before load; pinned host "
                  f"{mib(asleep['pinned'])} MiB; kept {mib(row['host_bytes_kept'])} MiB")
        print(f"  rss asleep {mib(asleep['rss'])} MiB; outputs identical after wake: "
              f"{row['outputs_identical']}")
    print(f"two runs without a sleep identical: {res['deterministic_without_sleep']}")
    cyc = res["cycles"]
    k = _key(device)
    if cyc["n"]:
        print(f"{cyc['n']} cycles in {res['cycles_s']:.2f} s: asleep {k} growth "
              f"{cyc[f'asleep_{k}_growth']:+d} B, awake {k} growth {cyc[f'awake_{k}_growth']:+d} B, "
              f"rss growth {cyc['awake_rss_growth'] / 2**20:+.1f} MiB; outputs identical after "
              f"the cycles: {res['outputs_identical_after_cycles']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sleep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap, default_cpu_model="random:tiny-llama")
    ap.add_argument("--models", default=None, help="comma-separated model specs (cuda default: "
                                                   + ",".join(CUDA_MODELS) + ")")
    ap.add_argument("--cycles", type=int, default=None, help="default: 50 on cuda, 10 on cpu")
    ap.add_argument("--batch", type=int, default=8, help="greedy requests compared")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-bytes", type=int, default=None,
                    help="default: 8 GiB on cuda, 64 MiB on cpu")
    args = common.finish_common_args(ap.parse_args(argv), "sleep")
    if args.cycles is None:
        args.cycles = 50 if args.device == "cuda" else 10
    if args.kv_cache_bytes is None:
        args.kv_cache_bytes = 8 * 2**30 if args.device == "cuda" else 64 * 2**20
    models, results = common.models_and_results(args, CUDA_MODELS)
    ok = True
    for model in models:
        res = anyio.run(bench_model, args, model)
        results["models"].append(res)
        report(res, args.device)
        ok &= all(r["outputs_identical"] for r in res["levels"].values())
        if args.device == "cuda":
            base = res["memory_before"]
            ok &= all(r["memory_asleep"]["allocated"] == base["allocated"]
                      and r["memory_asleep"]["reserved"] == base["reserved"]
                      for r in res["levels"].values())
    common.write_json(args.out, results)
    print(f"\nwrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Lifecycle timings and memory: cold start to SERVING, drain under load, open/close cycles.

    python -m bench.lifecycle --device cpu                        # random:tiny-llama fp32
    python -m bench.lifecycle --device cuda                       # random:qwen3-0.6b bf16

1. **Cold start**: the first ``AsyncEngine.open(config)`` in this process, from the call until
   the engine is SERVING (the body of the ``async with`` starts): weights, KV cache, model state.
   On cuda this includes creating the CUDA context (measured separately too).
2. **Drain under load**: ``--load-requests`` streams submitted, the engine decoding all of them;
   then ``drain(0)`` (abort in-flight, release) and, in a second engine, ``drain()`` (let every
   in-flight request finish, then release). Time from the call until SHUTDOWN, and every
   request's terminal output counted.
3. **Memory**: before load, while SERVING, under load, after shutdown. cuda:
   ``memory_allocated`` / ``memory_reserved`` (after ``gc.collect(); torch.cuda.empty_cache()``);
   cpu: process RSS, RSS after ``malloc_trim(0)`` and anonymous RSS (``RssAnon``: heap pages
   only, no library code pages) — the cpu figure compared across cycles.
4. **Open/close cycles**: ``--cycles`` (20) in-process open → SERVING → close, each timed, with
   the memory after each close.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any, Optional

import anyio
import msgspec
import torch

from . import common
from .common import now
from .resources import memory_snapshot, mib, primary_memory


def _params(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


async def cold_start(cfg, device) -> dict[str, Any]:
    from engine import AsyncEngine

    res: dict[str, Any] = {}
    if device.type == "cuda":
        t = now()
        torch.cuda.init()
        torch.empty(1, device=device)
        common.sync(device)
        res["cuda_context_s"] = now() - t
    # the baseline comes after the imports and a first torch op, so it counts only what an
    # engine holds, not what importing the package costs once
    import engine.serving.async_engine, engine.core.engine_core, engine.runner.model_runner, states  # noqa: F401,E401

    torch.ones(8, device=device).sum().item()
    res["memory_before"] = memory_snapshot(device)
    t0 = now()
    async with AsyncEngine.open(cfg) as eng:
        res["to_serving_s"] = now() - t0
        res["state"] = eng.state.value
        res["memory_serving"] = memory_snapshot(device)
        t1 = now()
    res["close_s"] = now() - t1
    res["memory_after"] = memory_snapshot(device)
    return res


async def drain_under_load(cfg, device, n: int, max_tokens: int, prompt_len: int, graceful: bool,
                           min_tokens_before: int) -> dict[str, Any]:
    """Open, put ``n`` streams in flight, wait until each produced ``min_tokens_before`` tokens,
    then drain (0 or unbounded) and time it until SHUTDOWN."""
    from engine import AsyncEngine
    from states import State

    vocab = None
    finish: dict[str, int] = {}
    tokens = [0] * n
    started = anyio.Event()
    res: dict[str, Any] = {"graceful": graceful, "requests": n, "max_tokens": max_tokens}
    mem_before = memory_snapshot(device)
    async with AsyncEngine.open(cfg) as eng:
        vocab = eng.runner.model_config.vocab_size
        g = torch.Generator().manual_seed(7)
        ready = [0]

        async def consume(i: int) -> None:
            prompt = torch.randint(0, min(vocab, 10000), (prompt_len,), generator=g).tolist()
            counted = False
            try:
                async for out in eng.generate(prompt, _params(max_tokens)):
                    tokens[i] += len(out.token_ids)
                    if not counted and tokens[i] >= min_tokens_before:
                        counted = True
                        ready[0] += 1
                        if ready[0] == n:
                            started.set()
                    if out.finished:
                        finish[out.finish_reason] = finish.get(out.finish_reason, 0) + 1
            except Exception as exc:  # noqa: BLE001 - counted as a lost request
                finish[type(exc).__name__] = finish.get(type(exc).__name__, 0) + 1
            if not counted:  # finished before the drain was called
                ready[0] += 1
                if ready[0] == n:
                    started.set()

        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(consume, i)
            with anyio.fail_after(600):
                await started.wait()
            res["memory_under_load"] = memory_snapshot(device, collect=False)
            st = eng.statistics()
            res["running_at_drain"] = st.running
            res["waiting_at_drain"] = st.waiting
            res["tokens_before_drain"] = sum(tokens)
            t0 = now()
            await eng.drain(None if graceful else 0)
            res["drain_s"] = now() - t0
            res["state_after"] = eng.state.value
            assert eng.state is State.SHUTDOWN
        res["tokens_after_drain"] = sum(tokens) - res["tokens_before_drain"]
    res["finish_reasons"] = finish
    res["terminal_outputs"] = sum(finish.values())
    res["memory_before"] = mem_before
    res["memory_after"] = memory_snapshot(device)
    return res


async def cycles(cfg, device, n: int, no_progress: bool) -> list[dict[str, Any]]:
    from engine import AsyncEngine

    out = []
    with common.progress(n, "open/close", "cycle", no_progress) as bar:
        for i in range(n):
            t0 = now()
            async with AsyncEngine.open(cfg) as eng:
                t1 = now()
                # one tiny request, so each cycle really serves
                async for _ in eng.generate([1, 2, 3], _params(2)):
                    pass
                t2 = now()
            t3 = now()
            mem = memory_snapshot(device)
            out.append({"cycle": i + 1, "open_s": t1 - t0, "close_s": t3 - t2, "total_s": t3 - t0,
                        "memory_after": mem, "memory_after_primary": primary_memory(mem)})
            bar.update(1)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lifecycle", description=__doc__.split("\n")[0])
    common.add_common_args(ap, default_cpu_model="random:tiny-llama")
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--load-requests", type=int, default=None, help="streams in flight for the drain (default 64 cpu, 256 cuda)")
    ap.add_argument("--load-max-tokens", type=int, default=None, help="output tokens per stream (default 64 cpu, 256 cuda)")
    ap.add_argument("--load-prompt", type=int, default=None, help="prompt tokens per stream (default 32 cpu, 512 cuda)")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size (default: the engine's)")
    args = common.finish_common_args(ap.parse_args(argv), "lifecycle")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    n_load = args.load_requests or (256 if cuda else 64)
    max_tokens = args.load_max_tokens or (256 if cuda else 64)
    prompt_len = args.load_prompt or (512 if cuda else 32)
    cfg = common.engine_config(args, kv_cache_bytes=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None)

    print(f"lifecycle: {args.model} {args.dtype} on {device}", flush=True)
    result: dict[str, Any] = {
        "benchmark": "lifecycle",
        "command": " ".join(["python -m bench.lifecycle"] + (argv if argv is not None else sys.argv[1:])),
        "environment": common.environment(device), "model": args.model, "dtype": args.dtype,
        "kv_cache_gib": args.kv_cache_gib, "engine_config": msgspec.to_builtins(cfg),
    }

    async def run() -> None:
        result["cold"] = await cold_start(cfg, device)
        common.write_json(args.out, result)
        print(f"  cold start to SERVING {result['cold']['to_serving_s']:.3f} s", flush=True)
        result["drain_abort"] = await drain_under_load(cfg, device, n_load, max_tokens, prompt_len,
                                                       graceful=False, min_tokens_before=2)
        common.write_json(args.out, result)
        result["drain_graceful"] = await drain_under_load(cfg, device, n_load, max_tokens, prompt_len,
                                                          graceful=True, min_tokens_before=2)
        common.write_json(args.out, result)
        result["cycles"] = await cycles(cfg, device, args.cycles, args.no_progress)

    anyio.run(run)
    common.write_json(args.out, result)

    key = "allocated" if cuda else "rss_anon"
    unit = "allocated" if cuda else "anon RSS (trimmed)"
    cold = result["cold"]
    print()
    rows = [
        {"what": "cold start → SERVING (first open)", "s": cold["to_serving_s"]},
        {"what": "close (idle, first engine)", "s": cold["close_s"]},
    ]
    if cuda:
        rows.insert(0, {"what": "CUDA context init", "s": cold["cuda_context_s"]})
    for name, label in (("drain_abort", "drain(0) under load: abort + release"),
                        ("drain_graceful", "drain() under load: finish in-flight + release")):
        d = result[name]
        rows.append({"what": label, "s": d["drain_s"],
                     "detail": f"{d['running_at_drain']} running + {d['waiting_at_drain']} waiting; "
                               f"{d['terminal_outputs']}/{d['requests']} terminal {d['finish_reasons']}; "
                               f"{d['tokens_after_drain']} tokens after the call"})
    cyc = result["cycles"]
    opens = [c["open_s"] for c in cyc]
    closes = [c["close_s"] for c in cyc]
    rows.append({"what": f"open → SERVING, {len(cyc)} cycles (min/med/max)",
                 "detail": f"{min(opens):.3f} / {statistics.median(opens):.3f} / {max(opens):.3f} s"})
    rows.append({"what": f"close, {len(cyc)} cycles (min/med/max)",
                 "detail": f"{min(closes):.3f} / {statistics.median(closes):.3f} / {max(closes):.3f} s"})
    common.print_table(f"lifecycle timings, {args.model} {args.dtype} on {device}",
                       [("what", "what", ""), ("s", "seconds", ".3f"), ("detail", "detail", "")], rows)

    print()
    mrows = [
        {"when": "before load", "m": cold["memory_before"]},
        {"when": "SERVING (idle)", "m": cold["memory_serving"]},
        {"when": "after shutdown (first engine)", "m": cold["memory_after"]},
        {"when": f"under load ({n_load} streams)", "m": result["drain_abort"]["memory_under_load"]},
        {"when": "after drain(0)", "m": result["drain_abort"]["memory_after"]},
        {"when": "after drain()", "m": result["drain_graceful"]["memory_after"]},
        {"when": "after cycle 1", "m": cyc[0]["memory_after"]},
        {"when": f"after cycle {len(cyc)}", "m": cyc[-1]["memory_after"]},
    ]
    if cuda:
        cols = [("when", "when", ""), ("primary", "allocated MiB", ""), ("reserved", "reserved MiB", ""),
                ("driver", "driver used MiB", "")]
    else:
        cols = [("when", "when", ""), ("rss", "RSS MiB", ""), ("trim", "RSS after malloc_trim MiB", ""),
                ("primary", "anon RSS after trim MiB", "")]
    table = []
    for r in mrows:
        m = r["m"]
        table.append({"when": r["when"], "primary": mib(primary_memory(m)), "rss": mib(m.get("rss")),
                      "trim": mib(m.get("rss_trimmed")), "reserved": mib(m.get("reserved")),
                      "driver": mib(m.get("driver_used"))})
    common.print_table(f"memory ({'cuda memory_allocated/reserved, after gc + empty_cache' if cuda else 'process RSS'})",
                       cols, table)
    base = primary_memory(cold["memory_before"])
    after = [c["memory_after_primary"] for c in cyc]
    print(f"cycles: {unit} after each close, MiB: " + " ".join(f"{a / 2**20:.0f}" for a in after))
    print(f"cycles: drift first→last close {(after[-1] - after[0]) / 2**20:+.1f} MiB; "
          f"last close vs before load {(after[-1] - base) / 2**20:+.1f} MiB")
    result["summary"] = {
        "to_serving_s": cold["to_serving_s"], "drain_abort_s": result["drain_abort"]["drain_s"],
        "drain_graceful_s": result["drain_graceful"]["drain_s"],
        "cycle_open_s_median": statistics.median(opens), "cycle_close_s_median": statistics.median(closes),
        "memory_metric": key, "memory_before": base, "memory_after_last_cycle": after[-1],
        "cycle_drift_bytes": after[-1] - after[0],
    }
    common.write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Offline throughput on the nano-vllm workload, through every layer of the engine.

    python -m bench.throughput --device cpu                       # scaled down, 70-150 s on 2 busy cores
    python -m bench.throughput --device cuda                      # nano-vllm: 256 req, [100, 1024]
    python -m bench.throughput --device cpu --modes bare,inproc --repeat 4 --logprobs-compare 20
    python -m bench.throughput --device cpu --modes bare --repeat 3 --deterministic-compare

Workload (nano-vllm's bench.py): N requests (default 256), prompt lengths and output lengths
uniform in [min, max] (cuda default [100, 1024] for both, as nano-vllm; cpu default prompts
[32, 256], outputs [32, 128] on ``random:tiny-llama``), random token-id prompts, ignore_eos,
temperature 0.6, ``random.seed(0)``. Every request is submitted at t=0.

Modes, all on the same workload, one after another; each run of a mode in a fresh process of its
own (``--no-isolate``: all in this process), so no mode inherits another's allocator state (glibc
arenas, the CUDA caching allocator) — measured on CPU, an in-process run after a bare one in the
same process took up to 10x the page faults:

* ``bare``   — ``ModelRunner`` + ``EngineCore.step()`` in a plain loop: the engine's own batches
               without the async loop (the ceiling for the layers above).
* ``inproc`` — ``AsyncEngine`` in this process; every request streamed concurrently.
* ``ipc``    — ``ipc.EngineClient.spawn(config)``: the engine in a child process, streams over
               the IPC channel (skipped with a message while ``ipc.EngineClient`` does not exist).
* ``hf-generate`` (cuda default) — transformers ``generate`` on the same synthetic weights,
               left-padded static batches of ``--hf-batch`` requests; each batch runs to its
               longest output (``min_new_tokens`` = ``max_new_tokens``: no EOS stop), only the
               requested tokens are counted.
* ``hf-cb``  (cuda default) — transformers' continuous batching manager
               (``init_continuous_batching`` / ``add_request(max_new_tokens=...)``) when the
               installed transformers has one.

Reported per mode: output tok/s, total (prompt + output) tok/s, the process's CPU seconds in the
timed region (``cpu_s``; bare and inproc: all of the engine's threads), TTFT p50/p99 and inter-token
latency p50/p99 (time between consecutive streamed tokens of one request; a piece carrying k
tokens counts as k gaps of 1/k), plus the ratios inproc/bare and ipc/inproc. Model load and a
short warm-up are outside the timed region. JSON goes to ``bench/results/throughput.json``
(rewritten after every mode, so a run cut short keeps what finished).

``roof %`` — the run against the workload's memory roofline: the bytes the workload must move at
least, over the device's bandwidth (measured once per run, after the modes, in this process:
``bench.roofline.device_bandwidth``, a large copy, read + write bytes / time), divided by the
mode's wall time. The bytes (``bench.roofline.workload_bytes``): every weight once per engine
step (the model's parameters in the run's dtype, tied embedding once), plus K/V traffic per
computed token: each prompt's K/V read once and written once (P + P tokens; a chunked prefill
re-reading its earlier chunks is not counted), and for each of a request's O - 1 decode tokens,
at position p, the K/V of p + 1 tokens read and one token's written. The steps are the mode's
own (engine statistics; the IPC mode's from the engine's health); the HF peers, which do not
report steps, use the bare mode's. JSON per mode: ``workload_bytes``, ``bandwidth_GBps``,
``floor_s`` (bytes / bandwidth), ``roofline_pct`` (floor / wall time x 100), ``roofline_steps``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from typing import Any, Optional

import msgspec

from . import common, resources, throughput_modes
from .throughput_modes import RUNNERS, engine_cfg
from .throughput_rounds import merge_rounds, ratios, run_isolated

CPU_DEFAULTS = dict(num_requests=256, min_input=32, max_input=256, min_output=32, max_output=128)
CUDA_DEFAULTS = dict(num_requests=256, min_input=100, max_input=1024, min_output=100, max_output=1024)
ENGINE_MODES = ("bare", "inproc", "ipc")
HF_MODES = ("hf-generate", "hf-cb")

COLUMNS = [
    ("mode", "mode", ""), ("requests", "req", ""), ("output_tokens", "out tok", ""),
    ("wall_s", "wall s", ".2f"), ("output_tok_s", "out tok/s", ",.1f"), ("total_tok_s", "total tok/s", ",.1f"),
    ("ttft_p50_ms", "TTFT p50 ms", ",.1f"), ("ttft_p99_ms", "TTFT p99 ms", ",.1f"),
    ("itl_p50_ms", "ITL p50 ms", ".2f"), ("itl_p99_ms", "ITL p99 ms", ".2f"), ("steps", "steps", ""),
    ("preemptions", "preempt", ""), ("roofline_pct", "roof %", ".1f"), ("load_s", "load s", ".2f"),
]


def add_roofline(result: dict[str, Any], work, cfg, args) -> None:
    """Measure the device's bandwidth and put the workload roofline (module docstring) into
    ``result``: the shared figures under ``roofline``, the per-mode ones into each row."""
    import torch

    from . import roofline

    bw = roofline.device_bandwidth(torch.device(args.device), args.copy_mib)
    wbytes = roofline.float_weight_bytes(cfg, common.torch_dtype(args.dtype))
    kv_tok = cfg.kv_bytes_per_token * (torch.finfo(common.torch_dtype(args.dtype)).bits // 8)
    read, written = roofline.workload_kv_tokens(work)
    result["roofline"] = {"bandwidth": bw, "weight_bytes": wbytes, "kv_bytes_per_token": kv_tok,
                          "kv_tokens_read": read, "kv_tokens_written": written}
    bare_steps = next((r.get("steps") for r in result["modes"] if r["mode"] == "bare"), None)
    for row in result["modes"]:
        steps = row.get("steps") or bare_steps
        if not row.get("wall_s") or not steps:
            continue
        need = roofline.workload_bytes(work, steps, wbytes, kv_tok)
        floor = need["total"] / bw["bytes_per_s"]
        row.update(workload_bytes=need["total"], bandwidth_GBps=bw["bytes_per_s"] / 1e9,
                   floor_s=floor, roofline_pct=100 * floor / row["wall_s"], roofline_steps=steps)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.split("\n")[0])
    common.add_common_args(ap, default_cpu_model="random:tiny-llama")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--min-input", type=int, default=None)
    ap.add_argument("--max-input", type=int, default=None)
    ap.add_argument("--min-output", type=int, default=None)
    ap.add_argument("--max-output", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.6, help="nano-vllm uses 0.6 (0 = greedy)")
    ap.add_argument("--modes", default=None,
                    help="comma list of bare,inproc,ipc,hf-generate,hf-cb "
                         "(default: bare,inproc,ipc on cpu; all on cuda)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="timed runs per engine mode, best kept (default 3 on cpu, 1 on cuda)")
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                    help="round-robin the engine modes --repeat times, fresh engine each "
                         "(default on for cpu, off for cuda)")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests (8 tokens) per mode")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: max input + max output")
    ap.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size (default: the engine's)")
    ap.add_argument("--hf-batch", type=int, default=64, help="hf-generate static batch size")
    ap.add_argument("--uvloop", action="store_true", help="run the async modes on uvloop")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                    help="sys.setswitchinterval(S) in this process before any mode runs (the GIL's "
                         "hand-over interval; Python's default is 0.005)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                    help="run each mode (each round) in a fresh process (default: on)")
    ap.add_argument("--logprobs", type=int, default=None, metavar="K",
                    help="every request asks for logprobs with the top K (engine max_logprobs: 20)")
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="bandwidth copy size for roof %% (default 2048 cuda, 512 cpu)")
    ap.add_argument("--logprobs-compare", type=int, default=None, metavar="K",
                    help="run every engine mode without and with --logprobs K, alternating, "
                         "--repeat rounds; print the per-round ratios and their median")
    ap.add_argument("--deterministic", action="store_true",
                    help="every engine mode in deterministic mode (EngineConfig.deterministic)")
    ap.add_argument("--deterministic-compare", action="store_true",
                    help="run every engine mode without and with --deterministic, alternating, "
                         "--repeat rounds; print the per-round ratios and their median")
    ap.add_argument("--timeline", action="store_true",
                    help="time every step and garbage collection of the bare and in-process runs "
                         "(bench/step_timeline.py): where the in-process mode's extra time goes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = common.finish_common_args(ap.parse_args(argv), "throughput")
    if args.switch_interval is not None:  # a process entry point: its own interpreter's knob
        sys.setswitchinterval(args.switch_interval)
    throughput_modes.LOGPROBS = args.logprobs
    if args.deterministic:
        args.engine_config = {**(args.engine_config or {}), "deterministic": True}
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.repeat is None:
        args.repeat = 1 if args.device == "cuda" else 3
    if args.interleave is None:
        args.interleave = args.device == "cpu"
    if args.max_model_len is None:
        args.max_model_len = args.max_input + args.max_output + 1
    modes = (args.modes.split(",") if args.modes else
             list(ENGINE_MODES + (HF_MODES if args.device == "cuda" else ())))
    for m in modes:
        if m not in ENGINE_MODES + HF_MODES:
            ap.error(f"unknown mode {m!r}")

    from engine.loader.checkpoint import resolve_source

    cfg, _, _ = resolve_source(args.model)
    work = common.nano_vllm_workload(args.num_requests, args.min_input, args.max_input,
                                     args.min_output, args.max_output, cfg.vocab_size, args.seed)
    result: dict[str, Any] = {
        "benchmark": "throughput",
        "command": " ".join(["python -m bench.throughput"] + (argv if argv is not None else sys.argv[1:])),
        "environment": common.environment(args.device),
        "workload": {"model": args.model, "dtype": args.dtype, "num_requests": args.num_requests,
                     "input_len": [args.min_input, args.max_input],
                     "output_len": [args.min_output, args.max_output], "temperature": args.temperature,
                     "ignore_eos": True, "seed": args.seed,
                     "prompt_tokens": sum(len(p) for p, _ in work),
                     "output_tokens": sum(o for _, o in work)},
        "engine_config": msgspec.to_builtins(engine_cfg(args)),
        "modes": [],
    }
    w = result["workload"]
    print("" if args.child else f"throughput: {args.model} {args.dtype} on {args.device}; {args.num_requests} requests, "
          f"input {args.min_input}-{args.max_input}, output {args.min_output}-{args.max_output} "
          f"({w['prompt_tokens']} prompt + {w['output_tokens']} output tokens), T={args.temperature}",
          end="" if args.child else "\n", flush=True)

    hf = None
    runners = RUNNERS
    if args.deterministic_compare and not args.child:
        from .throughput_deterministic import run_compare as run_deterministic

        return run_deterministic(args, argv if argv is not None else sys.argv[1:], work, runners,
                                 [m for m in modes if m in runners], result)
    if args.logprobs_compare is not None and not args.child:
        from .throughput_logprobs import run_compare

        return run_compare(args, argv if argv is not None else sys.argv[1:], work, runners,
                           [m for m in modes if m in runners], result)
    engine_modes = [m for m in modes if m in runners]
    # --interleave: round r runs every engine mode once (fresh engine each), so slow drifts in
    # machine load hit all modes alike; otherwise each mode runs its --repeat runs in one engine.
    rounds = args.repeat if args.interleave else 1
    per_call = argparse.Namespace(**{**vars(args), "repeat": 1}) if args.interleave else args
    collected: dict[str, list[dict]] = {m: [] for m in engine_modes}
    schedule = [(m, r) for r in range(rounds) for m in engine_modes] + [(m, 0) for m in modes if m not in runners]
    for m, r in schedule:
        t = time.perf_counter()
        try:
            if rounds > 1:
                print(f"[round {r + 1}/{rounds}] {m}", file=sys.stderr, flush=True)
            if args.isolate and not args.child:
                row = run_isolated(argv if argv is not None else sys.argv[1:], m,
                                    per_call.repeat if m in runners else 1)
            elif m in runners:
                row = runners[m](per_call, work)
            else:
                from .throughput_hf import build_hf_model, run_hf_cb, run_hf_generate

                if hf is None:
                    hf = build_hf_model(args)
                row = (run_hf_generate if m == "hf-generate" else run_hf_cb)(args, work, hf)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other modes
            traceback.print_exc()
            row = {"mode": m, "error": repr(exc)}
        row["mode_seconds"] = time.perf_counter() - t
        if "memory_after" not in row:  # (an isolated run measured its own)
            row["memory_after"] = resources.memory_snapshot(args.device)
        if row.get("skipped"):
            print(f"[{m}] skipped: {row['skipped']}", file=sys.stderr, flush=True)
        if m in collected:
            collected[m].append(row)
            row = merge_rounds(collected[m])
        result["modes"] = [x for x in result["modes"] if x["mode"] != m] + [row]
        ratios(result)
        common.write_json(args.out, result)
    del hf
    gc.collect()
    if args.child:
        return 0
    add_roofline(result, work, cfg, args)
    common.write_json(args.out, result)

    rows = [r for r in result["modes"] if "output_tok_s" in r]
    print()
    if rows:
        common.print_table(f"nano-vllm workload, {args.model} {args.dtype} on {args.device} "
                           f"(all {args.num_requests} requests submitted at t=0)", COLUMNS, rows)
        roof = result["roofline"]
        print(f"roof %: workload bytes / {roof['bandwidth']['bytes_per_s'] / 1e9:,.1f} GB/s (copy, "
              f"read+write) / wall s; bytes = {roof['weight_bytes'] / 2**20:,.1f} MiB of weights x "
              f"steps + K/V of {roof['kv_tokens_read']:,} tokens read, {roof['kv_tokens_written']:,} "
              f"written x {roof['kv_bytes_per_token']:,} B")
        for r in rows:
            if r.get("floor_s") is not None:
                print(f"  {r['mode']}: {r['workload_bytes'] / 1e9:,.2f} GB in {r['roofline_steps']} steps, "
                      f"floor {r['floor_s']:.3f} s, wall {r['wall_s']:.2f} s")
    for r in rows:
        if r.get("repeat", 1) > 1:
            print(f"{r['mode']}: out tok/s of each run: "
                  + ", ".join(f"{x:,.1f}" for x in r["runs_output_tok_s"])
                  + f" (best shown; median {r['median_output_tok_s']:,.1f})")
    for r in result["modes"]:
        if "output_tok_s" not in r:
            print(f"{r['mode']}: {r.get('skipped') or r.get('error')}")
    rat = result.get("ratios", {})
    if rat:
        print("ratios (output tok/s, best runs): " + ", ".join(f"{k} = {v:.3f}" for k, v in rat.items()))
        for key, label in (("ratios_of_medians", "medians"), ("ratios_paired_median", "median of per-round ratios")):
            if result.get(key):
                print(f"ratios ({label}): " + ", ".join(f"{k} = {v:.3f}" for k, v in result[key].items()))
        print("CPU targets: inproc/bare >= 0.90; ipc/inproc >= 0.97 at 256 concurrent streams")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode steps against the memory-bandwidth roofline.

    python -m bench.roofline --device cpu                         # random:smollm2-135m fp32
    python -m bench.roofline --device cuda                        # random:qwen3-0.6b bf16

A decode step of batch B at context L must move at least: every weight once (the tied
embedding counted once, as the LM head reads it), the batch's live KV (B x L tokens) and the KV
write of the new token (B tokens). That over the device's measured bandwidth is the fastest the
step could possibly be; ``% BW roofline = that time / measured step time``.

Bandwidth is measured here, not taken from a data sheet: a large device-to-device copy,
(bytes read + bytes written) / time (CUDA events on cuda; best of several on cpu). A compute
floor is reported next to it: the step's matmul FLOPs (projections, LM head, attention over L
keys) over a measured square-matmul rate in the same dtype; ``% roofline`` uses the larger of
the two floors (``bound`` says which), ``% BW roofline`` the bandwidth floor alone.

Steps are driven through the runner directly with prepared decode batches (each request
already holds L-1 tokens in its KV blocks and decodes one), so each figure is one real engine
step: host-side batch preparation, the forward over the paged cache, the LM head and sampling
(greedy), ending in the device-to-host copy of the sampled tokens. Activations are not counted
as required traffic. Two figures per point:

- ``step ms`` (synchronous): ``ModelRunner.execute``, one step at a time -- the host prepares
  the step, launches it and waits for its tokens before it prepares the next: host time and
  device time add up.
- ``pipelined ms``: the engine's overlapped schedule (``overlap_scheduling``, the default on
  CUDA): step N+1 is prepared and launched (``ModelRunner.launch(defer=True)``) before step N's
  tokens are read back (``collect``), so the host's work runs while the device computes; the
  figure is the median time between two successive steps' tokens reaching the host, i.e. the
  step period a serving engine sees. ``% BW roofline`` is given for both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from typing import Any, Callable, Optional, Sequence

import msgspec
import torch

from . import common
from .common import DeviceTimer

CPU_GRID = dict(batches=[1, 4, 16], contexts=[128, 512])
CUDA_GRID = dict(batches=[1, 16, 64, 128, 256], contexts=[256, 1024, 4096])


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds of each of ``iters`` timed calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    common.sync(device)
    times = []
    for _ in range(iters):
        with DeviceTimer(device) as t:
            fn()
        times.append(t.seconds)
    return times


def pipelined_times(runner, batch, warmup: int, iters: int) -> list[float]:
    """Seconds between successive steps' tokens reaching the host when each step is launched
    before the one before is collected (the engine's overlapped schedule); ``iters`` periods
    after ``warmup`` untimed steps."""
    import time

    prev = runner.launch(batch, defer=True)
    for _ in range(warmup):
        cur = runner.launch(batch, defer=True)
        runner.collect(prev)
        prev = cur
    runner.collect(prev)
    prev = runner.launch(batch, defer=True)
    marks = []
    for _ in range(iters + 1):
        cur = runner.launch(batch, defer=True)
        runner.collect(prev)
        marks.append(time.perf_counter())
        prev = cur
    runner.collect(prev)
    return [b - a for a, b in zip(marks, marks[1:])]


def measure_bandwidth(device: torch.device, nbytes: int, iters: int) -> dict[str, Any]:
    """(read + write) bytes per second of a ``dst.copy_(src)`` of ``nbytes``; best and median."""
    n = nbytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = time_calls(partial(dst.copy_, src), device, 3, iters)
    moved = 2 * n * 4
    del src, dst
    return {"copy_bytes": n * 4, "iters": iters, "best_s": min(times), "median_s": statistics.median(times),
            "bytes_per_s": moved / min(times), "bytes_per_s_median": moved / statistics.median(times)}


def device_bandwidth(device: torch.device, copy_mib: Optional[int] = None) -> dict[str, Any]:
    """``measure_bandwidth`` with this benchmark's defaults: a 2048 MiB copy, best of 20, on cuda;
    512 MiB, best of 5, on cpu (``copy_mib`` overrides the size)."""
    cuda = device.type == "cuda"
    nbytes = (copy_mib or (2048 if cuda else 512)) * 2**20
    return measure_bandwidth(device, nbytes, 20 if cuda else 5)


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int, iters: int) -> dict[str, Any]:
    """FLOP/s of an ``n x n @ n x n`` matmul in ``dtype`` (best of ``iters``)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = time_calls(partial(torch.matmul, a, b), device, 2, iters)
    del a, b
    return {"n": n, "dtype": str(dtype), "best_s": min(times), "flop_per_s": 2 * n**3 / min(times)}


def step_flops(cfg, linear_params: int, batch: int, context: int) -> int:
    """Matmul FLOPs of one decode step: the layers' projections, the LM head, attention
    (QK^T and AV over ``context`` keys)."""
    per_tok = (2 * linear_params + 2 * cfg.vocab_size * cfg.hidden_size
               + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context)
    return batch * per_tok


def linear_param_count(model: torch.nn.Module) -> int:
    dense = sum(p.numel() for name, p in model.named_parameters()
                if ".layers." in name and name.endswith("proj.weight"))
    packed = sum(m.in_features * m.out_features for name, m in model.named_modules()
                 if ".layers." in name and hasattr(m, "packed_nbytes"))  # PackedLinear
    return dense + packed


def weight_bytes(model: torch.nn.Module) -> int:
    """Unique parameter and non-rotary buffer bytes, plus packed (kernel-owned) CPU weights."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + [b for n, b in model.named_buffers() if "rotary" not in n]
    for p in tensors:
        key = id(p) if p.is_meta else p.data_ptr()  # meta tensors all have data_ptr 0
        if key in seen:
            continue
        seen.add(key)
        total += p.numel() * p.element_size()
    return total + sum(getattr(m, "packed_nbytes", 0) for m in model.modules())


def float_weight_bytes(cfg, dtype: torch.dtype) -> int:
    """``weight_bytes`` of ``cfg``'s model with every weight in ``dtype``, built on the meta
    device (no memory, nothing loaded). A packed CPU format (engine/model/cpu_weights.py) is not
    modelled: measure a loaded model with ``weight_bytes`` for that."""
    from engine.model.llama import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg)
    return weight_bytes(model.to(dtype))


def workload_kv_tokens(work: Sequence[tuple[Sequence[int], int]]) -> tuple[int, int]:
    """(tokens' K/V read, tokens' K/V written) by attention that a whole workload needs at least.

    A request of P prompt tokens and O output tokens computes P prompt tokens and O - 1 decode
    tokens (the last sampled token is never fed back). Its prompt reads its own K/V once and
    writes it once (P and P: the lower bound of one fused prefill, whatever the chunking; a
    later chunk re-reading the earlier ones is not counted); the decode token at position p
    reads the K/V of p + 1 tokens (its context and itself) and writes one token's."""
    read = written = 0
    for prompt, out in work:
        p, d = len(prompt), max(out - 1, 0)
        read += p + (p + d) * (p + d + 1) // 2 - p * (p + 1) // 2  # p + sum of (q + 1), q in [p, p+d)
        written += p + d
    return read, written


def workload_bytes(work: Sequence[tuple[Sequence[int], int]], steps: int, wbytes: int,
                   kv_tok: int) -> dict[str, int]:
    """Bytes a run of ``work`` in ``steps`` engine steps must move at least: every weight once
    per step, plus ``workload_kv_tokens`` x ``kv_tok`` (one token's K/V in bytes)."""
    read, written = workload_kv_tokens(work)
    parts = {"weights": steps * wbytes, "kv_read": read * kv_tok, "kv_write": written * kv_tok}
    return {**parts, "total": sum(parts.values())}


def decode_batch(runner, batch: int, context: int, first_block: int = 0):
    """``batch`` requests whose first ``context - 1`` tokens are in the cache; each decodes one."""
    from engine.kv.kv_cache import blocks_needed
    from engine.params import SamplingParams
    from engine.request import Request, Status

    bs = runner.block_size
    nb = blocks_needed(context, bs)
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(batch * 100003 + context)
    out = []
    for i in range(batch):
        ids = torch.randint(0, min(vocab, 10000), (context,), generator=g).tolist()
        req = Request(f"d{i}", ids, SamplingParams(max_tokens=16))
        req.num_computed_tokens = context - 1
        req.block_ids = list(range(first_block + i * nb, first_block + (i + 1) * nb))
        req.status = Status.RUNNING
        out.append((req, 1))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.roofline", description=__doc__.split("\n")[0])
    common.add_common_args(ap, default_cpu_model="random:smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--iters", type=int, default=None, help="timed steps per point (default 10 cuda, 3 cpu)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kv-budget-gib", type=float, default=None,
                    help="skip points whose live KV exceeds this (default 48 on cuda, 2 on cpu)")
    ap.add_argument("--copy-mib", type=int, default=None, help="bandwidth copy size (default 2048 cuda, 512 cpu)")
    args = common.finish_common_args(ap.parse_args(argv), "roofline")
    device = torch.device(args.device)
    grid = CUDA_GRID if device.type == "cuda" else CPU_GRID
    batches = args.batches or grid["batches"]
    contexts = args.contexts or grid["contexts"]
    iters = args.iters or (10 if device.type == "cuda" else 3)
    budget = int((args.kv_budget_gib or (48 if device.type == "cuda" else 2)) * 2**30)

    from engine.kv.kv_cache import blocks_needed
    from engine.loader.checkpoint import resolve_source
    from engine.runner.model_runner import ModelRunner

    cfg, _, _ = resolve_source(args.model)
    dtype = common.torch_dtype(args.dtype)
    esize = torch.finfo(dtype).bits // 8
    kv_tok = cfg.kv_bytes_per_token * esize
    block_size = 16
    points = [(b, c) for b in batches for c in contexts
              if b * blocks_needed(c, block_size) * block_size * kv_tok <= budget]
    skipped = [(b, c) for b in batches for c in contexts if (b, c) not in points]
    if not points:
        raise SystemExit("no (batch, context) point fits --kv-budget-gib")
    num_blocks = max(b * blocks_needed(c, block_size) for b, c in points)

    print(f"roofline: {args.model} {args.dtype} on {device}; measuring bandwidth ...", flush=True)
    bw = device_bandwidth(device, args.copy_mib)
    print(f"  device copy bandwidth (read + write, {bw['copy_bytes'] / 2**20:.0f} MiB copy): "
          f"{bw['bytes_per_s'] / 1e9:,.1f} GB/s best, "
          f"{bw['bytes_per_s_median'] / 1e9:,.1f} GB/s median", flush=True)
    mm = measure_matmul(device, dtype, 8192 if device.type == "cuda" else 1024,
                        10 if device.type == "cuda" else 3)
    print(f"  matmul ({mm['n']}^3, {args.dtype}): {mm['flop_per_s'] / 1e12:,.2f} TFLOP/s", flush=True)

    config = common.engine_config(args, num_kv_blocks=num_blocks, block_size=block_size,
                                  max_num_seqs=max(max(batches), 1),
                                  max_model_len=max(contexts) + block_size)
    runner = ModelRunner(config)
    rows: list[dict[str, Any]] = []
    try:
        runner.load()
        wbytes = weight_bytes(runner.resource("weights"))
        lin = linear_param_count(runner.resource("weights"))
        print(f"  weights {wbytes / 2**20:,.1f} MiB, KV {kv_tok} B/token, {num_blocks} blocks "
              f"({num_blocks * block_size * kv_tok / 2**30:.2f} GiB)", flush=True)
        with common.progress(len(points), "roofline", "pt", args.no_progress) as bar:
            for b, c in points:
                batch = decode_batch(runner, b, c)
                times = time_calls(partial(runner.execute, batch), device, args.warmup, iters)
                step = statistics.median(times)
                piped = statistics.median(pipelined_times(runner, batch, args.warmup, iters))
                need = wbytes + b * c * kv_tok + b * kv_tok  # KV read: c tokens incl. the new one
                mem_floor = need / bw["bytes_per_s"]
                flops = step_flops(cfg, lin, b, c)
                compute_floor = flops / mm["flop_per_s"]
                floor = max(mem_floor, compute_floor)
                rows.append({
                    "flops": flops, "mem_floor_ms": mem_floor * 1e3, "compute_floor_ms": compute_floor * 1e3,
                    "bound": "memory" if mem_floor >= compute_floor else "compute",
                    "pct_bw_roofline": 100 * mem_floor / step,
                    "batch": b, "context": c, "weight_bytes": wbytes, "kv_read_bytes": b * c * kv_tok,
                    "kv_write_bytes": b * kv_tok, "bytes": need, "step_ms": step * 1e3,
                    "step_ms_min": min(times) * 1e3, "floor_ms": floor * 1e3,
                    "achieved_GB_s": need / step / 1e9, "pct_roofline": 100 * floor / step,
                    "tok_s": b / step,
                    "pipelined_ms": piped * 1e3, "pct_bw_roofline_pipelined": 100 * mem_floor / piped,
                    "pct_roofline_pipelined": 100 * floor / piped, "tok_s_pipelined": b / piped,
                })
                bar.update(1)
                del batch
    finally:
        runner.shutdown()

    print()
    common.print_table(
        f"decode step vs roofline: {args.model} {args.dtype} on {device}, bandwidth "
        f"{bw['bytes_per_s'] / 1e9:,.1f} GB/s (copy, read+write), matmul "
        f"{mm['flop_per_s'] / 1e12:,.2f} TFLOP/s; median of {iters} steps",
        [("batch", "batch", ""), ("context", "ctx", ""), ("bytes", "MiB moved", ""),
         ("mem_floor_ms", "bytes/BW ms", ".3f"), ("compute_floor_ms", "FLOPs/peak ms", ".3f"),
         ("step_ms", "step ms", ".3f"), ("achieved_GB_s", "GB/s", ",.1f"),
         ("pct_bw_roofline", "% BW roofline", ".1f"), ("pct_roofline", "% roofline", ".1f"),
         ("pipelined_ms", "pipelined ms", ".3f"), ("pct_bw_roofline_pipelined", "% BW (pipelined)", ".1f"),
         ("bound", "bound", ""), ("tok_s_pipelined", "tok/s (pipelined)", ",.0f")],
        [dict(r, bytes=f"{r['bytes'] / 2**20:,.1f}") for r in rows])
    if skipped:
        print(f"skipped (live KV over {budget / 2**30:.0f} GiB): {skipped}")
    result = {
        "benchmark": "roofline",
        "command": " ".join(["python -m bench.roofline"] + (argv if argv is not None else sys.argv[1:])),
        "environment": common.environment(device), "model": args.model, "dtype": args.dtype,
        "bandwidth": bw, "matmul": mm, "linear_params": lin, "kv_bytes_per_token": kv_tok, "block_size": block_size,
        "engine_config": msgspec.to_builtins(config),
        "iters": iters, "warmup": args.warmup, "points": rows, "skipped": skipped,
        "definition": "bytes = weights (unique) + batch*context*kv_bytes_per_token + batch*kv_bytes_per_token; "
                      "pct_bw_roofline = (bytes / copy bandwidth) / median step time; "
                      "pipelined_ms = median period between successive steps' tokens reaching the host "
                      "with each step launched before the one before is collected (overlapped schedule); "
                      "flops = batch * (2*linear_params + 2*vocab*hidden + 4*layers*heads*head_dim*context); "
                      "pct_roofline = max(bytes/bandwidth, flops/matmul peak) / median step time",
    }
    common.write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

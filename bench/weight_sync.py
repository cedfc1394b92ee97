"""Weight sync for RL loops: new weights into a live engine without a restart.

    python -m bench.weight_sync --device cuda      # random:qwen3-0.6b, random:llama-3.2-1b bf16
    python -m bench.weight_sync --device cpu       # random:tiny-llama fp32 (--models to change)

Per model, in process (``AsyncEngine``), after a warm-up: a full set of new weights (every
parameter, seeded random tensors already on the engine's device, as a trainer on the same GPU
holds them) written ``--rounds`` times by each path:

* ``tensors``: ``pause("keep")`` -> ``update_weights_from_tensors`` -> ``resume()``, with a
  stream in flight across the update (it is frozen, then continues);
* ``distributed``: the same through a gloo group with a ``Sender`` thread of this process
  (``engine.weight_transfer``; on a GPU the bytes go device -> host -> device, which is what
  gloo can do; NCCL needs a second GPU for the trainer);
* ``sleep`` (the older path, for comparison): ``sleep(1)`` -> ``update_weights_from_tensors`` ->
  ``wake_up()``;
* ``ipc`` / ``ipc-bucket`` (cuda only): a trainer child process on the same GPU
  (``bench/ipc_trainer.py``) holds the same weights and exports CUDA IPC handles each round --
  of its own tensors (``export_cuda_ipc``, no copy) or of one flat buffer per dtype
  (``IpcSender``) -- and the engine runs ``pause("keep")`` -> ``update_weights_from_ipc`` ->
  ``resume()``; the trainer's export time is reported apart (``export``), and after the rounds
  the CUDA bytes the trainer still holds once it dropped its weights (0: the engine let go).

``--paths`` picks some of them (default: all that the device has).

For each: the update's seconds, the whole cycle's (pause to resume), the first token after it;
greedy outputs after the update equal those of an engine loaded with the same weights; memory
(device allocated / reserved, process RSS) before load and after shutdown.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
from typing import Any

import anyio
from anyio import to_thread
import torch

from . import common
from .common import now
from .resources import memory_snapshot

CUDA_MODELS = ("random:qwen3-0.6b", "random:llama-3.2-1b")
PATHS = ("tensors", "distributed", "sleep", "ipc", "ipc-bucket")
PROMPT = list(range(100, 164))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _new_weights(eng, seed: int) -> dict[str, torch.Tensor]:
    from .ipc_trainer import trainer_weights  # the trainer child makes the same ones

    return trainer_weights(eng.weight_info(), seed, eng.runner.device)


async def _first_token(eng) -> float:
    from engine import SamplingParams

    t = now()
    async for _ in eng.generate(PROMPT, SamplingParams(max_tokens=1)):
        break
    return now() - t


async def _greedy(eng) -> list[int]:
    from engine import SamplingParams

    return [t async for o in eng.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))
            for t in o.token_ids]


async def _cycle(eng, path: str, weights, sender, version: int) -> dict[str, float]:
    from engine import SamplingParams
    from engine.weight_transfer import metadata

    row: dict[str, float] = {}
    stream = eng.generate(PROMPT, SamplingParams(max_tokens=64, ignore_eos=True))
    got = 0
    async for o in stream:  # a request in flight across the update
        got += len(o.token_ids)
        if got >= 4:
            break
    if path.startswith("ipc"):
        handles, row["export_s"] = sender.export()  # the trainer's side, before the cycle
    t0 = now()
    if path == "sleep":
        await stream.aclose()
        await eng.sleep(1)
    else:
        await eng.pause("keep")
    t1 = now()
    if path == "distributed":
        async with anyio.create_task_group() as tg:
            tg.start_soon(to_thread.run_sync, sender.send, weights)
            await eng.update_weights_from_distributed(metadata(weights), version=version)
    elif path.startswith("ipc"):
        await eng.update_weights_from_ipc(handles, version=version)
    else:
        await eng.update_weights_from_tensors(weights, version=version)
    common.sync(eng.runner.device)
    t2 = now()
    if path == "sleep":
        await eng.wake_up()
    else:
        await eng.resume()
    t3 = now()
    row["first_ttft_s"] = await _first_token(eng)
    if path != "sleep":
        async for o in stream:  # the frozen request goes on, with the new weights
            got += len(o.token_ids)
        row["kept_stream_tokens"] = got
    row.update(stop_s=t1 - t0, update_s=t2 - t1, restart_s=t3 - t2, cycle_s=t3 - t0)
    return row


async def bench_model(args, model: str) -> dict[str, Any]:
    from engine import AsyncEngine
    from engine.weight_transfer import Sender

    from .ipc_trainer import TrainerProcess

    device = torch.device(args.device)
    cfg = common.engine_config(args, model=model, kv_cache_bytes=args.kv_cache_bytes)
    res: dict[str, Any] = {"model": model, "memory_before": memory_snapshot(device)}
    async with AsyncEngine.open(cfg) as eng:
        weights = _new_weights(eng, args.seed + 1)
        res["bytes"] = sum(t.numel() * t.element_size() for t in weights.values())
        res["tensors"] = len(weights)
        await _greedy(eng)
        res["ttft_warm_s"] = await _first_token(eng)
        port = _free_port()
        senders: list = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(to_thread.run_sync, lambda: senders.append(Sender("127.0.0.1", port)))
            await eng.init_weight_transfer("gloo", "127.0.0.1", port, rank=1, world_size=2)
        res["paths"] = {}
        version = 0
        for path in args.paths:
            if path.startswith("ipc") and device.type != "cuda":
                continue
            sender = senders[0]
            if path.startswith("ipc"):
                sender = TrainerProcess(eng.weight_info(), args.seed + 1,
                                        "bucket" if path == "ipc-bucket" else "tensors")
            rows = []
            try:
                for _ in range(args.rounds):
                    version += 1
                    rows.append(await _cycle(eng, path, weights, sender, version))
                res["paths"][path] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                if path.startswith("ipc"):
                    res["paths"][path]["trainer_left_bytes"] = sender.close()
            finally:
                if path.startswith("ipc"):
                    sender.kill()
        res["outputs_after"] = await _greedy(eng)
        senders[0].close()
        await eng.close_weight_transfer()
        del weights
    res["memory_after_shutdown"] = memory_snapshot(device)
    # the same weights loaded fresh: the outputs must agree
    async with AsyncEngine.open(cfg) as fresh:
        await fresh.pause()
        await fresh.update_weights_from_tensors(_new_weights(fresh, args.seed + 1))
        await fresh.resume()
        res["outputs_match_fresh"] = await _greedy(fresh) == res.pop("outputs_after")
    return res


def report(res: dict[str, Any], device) -> None:
    gib = res["bytes"] / 2**30
    print(f"\n== {res['model']}: {res['tensors']} tensors, {gib:.2f} GiB; warm TTFT "
          f"{res['ttft_warm_s'] * 1e3:.1f} ms ==")
    cols = [("path", "path", ""), ("update_s", "update (ms)", ".1f"), ("gbs", "GB/s", ".2f"),
            ("stop_s", "stop (ms)", ".1f"), ("restart_s", "restart (ms)", ".1f"),
            ("cycle_s", "cycle (ms)", ".1f"), ("first_ttft_s", "first TTFT after (ms)", ".1f"),
            ("export_s", "trainer export (ms)", ".1f"), ("trainer_left_bytes", "trainer left (B)", "")]
    rows = []
    for path, r in res["paths"].items():
        row = {"path": path, "gbs": res["bytes"] / r["update_s"] / 1e9}
        row.update({k: v * 1e3 if k.endswith("_s") else v for k, v in r.items()})
        rows.append(row)
    common.print_table("weight sync (median of rounds)", cols, rows)
    before, after = res["memory_before"], res["memory_after_shutdown"]
    extra = ""
    if torch.device(device).type == "cuda":
        extra = (f"allocated {after['allocated'] - before['allocated']:+d} B, reserved "
                 f"{after['reserved'] - before['reserved']:+d} B vs before load; ")
    print(f"after shutdown: {extra}rss {(after['rss'] - before['rss']) / 2**20:+.1f} MiB; "
          f"outputs equal a fresh engine with the same weights: {res['outputs_match_fresh']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.weight_sync", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap, default_cpu_model="random:tiny-llama")
    ap.add_argument("--models", default=None, help="comma-separated model specs (cuda default: "
                                                   + ",".join(CUDA_MODELS) + ")")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="comma-separated, of " + ", ".join(PATHS) + " (ipc*: cuda only)")
    ap.add_argument("--kv-cache-bytes", type=int, default=None,
                    help="default: 4 GiB on cuda, 64 MiB on cpu")
    args = common.finish_common_args(ap.parse_args(argv), "weight_sync")
    args.paths = [p for p in args.paths.split(",") if p]
    if not args.paths or set(args.paths) - set(PATHS):
        ap.error(f"--paths: some of {', '.join(PATHS)}")
    if args.kv_cache_bytes is None:
        args.kv_cache_bytes = 4 * 2**30 if args.device == "cuda" else 64 * 2**20
    models, results = common.models_and_results(args, CUDA_MODELS)
    ok = True
    for model in models:
        res = anyio.run(bench_model, args, model)
        results["models"].append(res)
        report(res, args.device)
        ok &= res["outputs_match_fresh"]
        ok &= all(r.get("trainer_left_bytes", 0) == 0 for r in res["paths"].values())
        if args.device == "cuda":
            ok &= res["memory_after_shutdown"]["allocated"] == res["memory_before"]["allocated"]
    common.write_json(args.out, results)
    print(f"\nwrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The engine's host cost per output token, with the model taken out: bare loop vs in-process.

    python -m tools.host_overhead                  # 256 requests x 100 tokens, 3 rounds, CPU
    python -m tools.host_overhead --sim h200 --workload nano   # against a simulated H200


The model's forward is replaced by one that returns zeros (``random:tiny-llama``: its LM head
and the greedy argmax still run, over a 512-token vocabulary), so what is timed is the engine's
own host work: scheduling, step inputs, sampling launch, the update (stop checks,
detokenization, outputs) -- the bare ``EngineCore.step()`` loop -- and, in-process
(``AsyncEngine``), the step thread hand-over and each output's delivery to its stream and its
consumer's wake-up on the event loop. On a GPU that host work runs beside the device's, and
whatever of it outlasts the device step is device idle time; with no device work at all the
in-process / bare ratio here is the floor of the one ``bench.throughput`` measures on a device
(an in-process / bare >= 0.97 needs the host's part of a step, step thread and event
loop together, below the device's). Deterministic enough to compare host-side changes on a
shared 2-core box (rounds alternate the two modes). JSON: ``bench/results/host_overhead.json``.

``--sim MODEL`` puts a simulated device under the same null model (``bench/device_sim.py``):
each step takes the device time of a cost model fitted to the H200, the host waits for it
with the GIL released, so the ratio is the one a device would show *if* its host were this
machine: what of the host's work (step thread and event loop together) the device time does
not hide. ``--workload nano`` is bench.throughput's CUDA workload (256 requests, prompts and
outputs U[100, 1024]). Both modes record every piece as bench.throughput does.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any, Optional

import anyio
import torch

from bench import common
from bench.device_sim import MODELS, SimDevice, null_model, simulate
from bench.recorder import Recorder


def _prepare(runner, sim: Optional[str], eager_ms: Optional[float]) -> Optional[SimDevice]:
    if sim is None:
        null_model(runner)
        return None
    return simulate(runner, sim, eager_ms)


def _figures(rec: Recorder, device: Optional[SimDevice]) -> dict[str, Any]:
    wall = rec.t1 - rec.t0
    n = sum(rec.out_tokens)
    out = {"us_token": wall / n * 1e6, "tok_s": n / wall, "wall_s": wall}
    if device is not None:
        out["device_busy"] = device.busy_s / wall
    return out


def _params(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_bare(cfg, work, sim: Optional[str] = None, eager_ms: Optional[float] = None) -> dict[str, Any]:
    from engine.core.engine_core import EngineCore
    from engine.runner.model_runner import ModelRunner

    runner = ModelRunner(cfg)
    runner.load()
    try:
        device = _prepare(runner, sim, eager_ms)
        core = EngineCore(runner)
        rec = Recorder(work)
        index = {}
        rec.t0 = time.perf_counter()
        for i, (prompt, out_tokens) in enumerate(work):
            index[f"r{i}"] = i
            rec.submitted(i, time.perf_counter())
            core.add_request(f"r{i}", prompt, _params(out_tokens))
        while core.has_work():
            outs = core.step()
            t = time.perf_counter()
            for out in outs:
                rec.piece(index[out.request_id], t, len(out.token_ids),
                          out.finish_reason if out.finished else None)
        rec.t1 = time.perf_counter()
        return _figures(rec, device)
    finally:
        runner.shutdown()


def run_inproc(cfg, work, sim: Optional[str] = None, eager_ms: Optional[float] = None) -> dict[str, Any]:
    from engine import AsyncEngine

    result: list[dict] = []

    async def main() -> None:
        async with AsyncEngine.open(cfg) as eng:
            device = _prepare(eng.runner, sim, eager_ms)
            rec = Recorder(work)

            async def one(i, prompt, out_tokens) -> None:
                rec.submitted(i, time.perf_counter())
                async for out in eng.generate(prompt, _params(out_tokens)):
                    rec.piece(i, time.perf_counter(), len(out.token_ids),
                              out.finish_reason if out.finished else None)

            rec.t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i, (prompt, out_tokens) in enumerate(work):
                    tg.start_soon(one, i, prompt, out_tokens)
            rec.t1 = time.perf_counter()
            result.append(_figures(rec, device))

    anyio.run(main)
    return result[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.host_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=100, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sim", choices=sorted(MODELS), default=None,
                    help="a simulated device under the null model (bench/device_sim.py)")
    ap.add_argument("--eager-ms", type=float, default=None,
                    help="with --sim: host time (GIL held) of a step with prompt tokens")
    ap.add_argument("--workload", choices=("short", "nano"), default="short",
                    help="short: --requests x --prompt / --tokens; nano: 256 requests, prompts "
                         "and outputs U[100, 1024] (bench.throughput's CUDA workload)")
    ap.add_argument("--step-burst-ms", type=float, default=None,
                    help="EngineConfig.step_burst_ms of the in-process engine (its default if omitted)")
    ap.add_argument("--out", default=str(common.RESULTS_DIR / "host_overhead.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from engine.config import EngineConfig

    rng = random.Random(0)
    if args.workload == "nano":
        args.requests = 256
        work = [([rng.randrange(1, 500) for _ in range(rng.randint(100, 1024))],
                 rng.randint(100, 1024)) for _ in range(args.requests)]
    else:
        work = [([rng.randrange(1, 500) for _ in range(args.prompt)], args.tokens)
                for _ in range(args.requests)]
    cfg = EngineConfig(model="random:tiny-llama", device="cpu", max_num_seqs=args.requests,
                       enable_prefix_caching=False, overlap_scheduling=True,
                       kv_cache_bytes=2**27 if args.workload == "short" else 2**29,
                       **({} if args.step_burst_ms is None else {"step_burst_ms": args.step_burst_ms}))
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        bare = run_bare(cfg, work, args.sim, args.eager_ms)
        inproc = run_inproc(cfg, work, args.sim, args.eager_ms)
        row = {"round": r + 1, "bare_us": bare["us_token"], "inproc_us": inproc["us_token"],
               "ratio": bare["us_token"] / inproc["us_token"]}
        if args.sim:
            row.update(bare_busy=bare["device_busy"], inproc_busy=inproc["device_busy"])
        rows.append(row)
    keys = [k for k in rows[0] if k != "round"]
    med = {k: statistics.median(row[k] for row in rows) for k in keys}
    rows.append({"round": "median", **med})
    cols = [("round", "round", ""), ("bare_us", "bare µs/token", ".2f"),
            ("inproc_us", "in-process µs/token", ".2f"),
            ("ratio", "in-process / bare tok/s", ".3f")]
    if args.sim:
        cols += [("bare_busy", "device busy, bare", ".3f"),
                 ("inproc_busy", "device busy, in-process", ".3f")]
    what = (f"{args.requests} requests x {args.tokens} tokens" if args.workload == "short"
            else "the nano workload (256 requests, in/out U[100, 1024])")
    table = common.print_table(
        f"host cost per output token, null model, {what} (overlap on"
        f"{', simulated device ' + args.sim if args.sim else ''})", cols, rows)
    common.write_json(common.Path(args.out), {"bench": "host_overhead", "args": vars(args),
                                              "environment": common.environment("cpu"),
                                              "rounds": rows[:-1], "median": med, "table": table})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The engine's host cost per output token, with the model taken out: bare loop vs in-process.

    python -m bench.host_overhead                  # 256 requests x 100 tokens, 3 rounds, CPU

The model's forward is replaced by one that returns zeros (``random:tiny-llama``: its LM head
and the greedy argmax still run, over a 512-token vocabulary), so what is timed is the engine's
own host work: scheduling, step inputs, sampling launch, the update (stop checks,
detokenization, outputs) -- the bare ``EngineCore.step()`` loop -- and, in-process
(``AsyncEngine``), the step thread hand-over and each output's delivery to its stream and its
consumer's wake-up on the event loop. On a GPU that host work runs beside the device's, and
whatever of it outlasts the device step is device idle time; with no device work at all the
in-process / bare ratio here is the floor of the one ``bench.throughput`` measures on a device
(issue 14's in-process / bare >= 0.97 needs the host's part of a step, step thread and event
loop together, below the device's). Deterministic enough to compare host-side changes on a
shared 2-core box (rounds alternate the two modes). JSON: ``bench/results/host_overhead.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import anyio
import torch

from . import common


def _null_model(runner) -> None:
    """The runner's model forward returns zero hidden states (no compute, same shapes)."""
    model = runner.resource("weights")
    zeros = torch.zeros(runner.config.max_num_batched_tokens + runner.config.max_num_seqs * 17,
                        model.config.hidden_size)
    # NOTE: object.__setattr__: a plain attribute on the module, past nn.Module's own
    object.__setattr__(model, "forward", lambda ids, pos, kv, meta: zeros[: ids.shape[0]])


def run_bare(cfg, work, out_tokens: int) -> float:
    from engine import SamplingParams
    from engine.core import EngineCore
    from engine.runner import ModelRunner

    runner = ModelRunner(cfg)
    runner.load()
    try:
        _null_model(runner)
        core = EngineCore(runner)
        n = 0
        t0 = time.perf_counter()
        for i, prompt in enumerate(work):
            core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=out_tokens, ignore_eos=True))
        while core.has_work():
            for out in core.step():
                n += len(out.token_ids)
        return (time.perf_counter() - t0) / n
    finally:
        runner.shutdown()


def run_inproc(cfg, work, out_tokens: int) -> float:
    from engine import AsyncEngine, SamplingParams

    result: list[float] = []

    async def main() -> None:
        async with AsyncEngine.open(cfg) as eng:
            _null_model(eng.runner)
            n = [0]

            async def one(prompt) -> None:
                async for out in eng.generate(prompt, SamplingParams(max_tokens=out_tokens,
                                                                     ignore_eos=True)):
                    n[0] += len(out.token_ids)

            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for prompt in work:
                    tg.start_soon(one, prompt)
            result.append((time.perf_counter() - t0) / n[0])

    anyio.run(main)
    return result[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=100, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(common.RESULTS_DIR / "host_overhead.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from engine.config import EngineConfig

    cfg = EngineConfig(model="random:tiny-llama", device="cpu", max_num_seqs=args.requests,
                       enable_prefix_caching=False, kv_cache_bytes=2**27, overlap_scheduling=True)
    rng = random.Random(0)
    work = [[rng.randrange(1, 500) for _ in range(args.prompt)] for _ in range(args.requests)]
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        bare = run_bare(cfg, work, args.tokens)
        inproc = run_inproc(cfg, work, args.tokens)
        rows.append({"round": r + 1, "bare_us": bare * 1e6, "inproc_us": inproc * 1e6,
                     "ratio": bare / inproc})
    med = {k: statistics.median(row[k] for row in rows) for k in ("bare_us", "inproc_us", "ratio")}
    rows.append({"round": "median", **med})
    table = common.print_table(
        f"host cost per output token, null model, {args.requests} requests x {args.tokens} tokens "
        f"(overlap on)", [("round", "round", ""), ("bare_us", "bare µs/token", ".2f"),
                          ("inproc_us", "in-process µs/token", ".2f"),
                          ("ratio", "in-process / bare tok/s", ".3f")], rows)
    common.write_json(common.Path(args.out), {"bench": "host_overhead", "args": vars(args),
                                              "environment": common.environment("cpu"),
                                              "rounds": rows[:-1], "median": med, "table": table})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

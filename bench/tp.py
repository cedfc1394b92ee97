"""Tensor parallelism: output tokens/s and decode step time at TP=1 and TP=N.

    python -m bench.tp --device cpu --tp 1,2                      # random:tiny-llama (2 divides it)
    python -m bench.tp --device cpu --model default --tp 1,3      # SmolLM2-135M (3 divides it)
    python -m bench.tp --device cuda --tp 1,2                     # random:qwen3-0.6b, NCCL

For each TP size, one engine (``AsyncEngine.open``; workers started by the engine) runs, after
a warm-up request:

* ``throughput`` -- ``--num-requests`` random prompts of ``--prompt-len`` tokens, each
  ``--max-tokens`` outputs (greedy, ``ignore_eos``), all submitted at t=0: output tok/s;
* ``decode`` -- at batch 1 and at batch ``--batch``: the median time between two outputs of one
  stream once every stream decodes (one engine step per output, no speculator).

Greedy outputs of every TP size are compared with TP=1's (identical is expected in fp32 on a
real checkpoint; random presets are drawn per rank, so not there). On CPU all ranks share the
machine's cores: TP>1 measures the collectives' cost, not a speedup. JSON: ``bench/results/tp.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import anyio

from . import common


async def _stream(eng, prompt, params, stamps: list[float], toks: list[int]) -> None:
    async for out in eng.generate(prompt, params):
        toks += out.token_ids
        stamps.append(time.perf_counter())


async def _batch(eng, prompts, max_tokens) -> tuple[float, list[list[int]], list[list[float]]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    stamps: list[list[float]] = [[] for _ in prompts]
    toks: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, p in enumerate(prompts):
            tg.start_soon(_stream, eng, p, params, stamps[i], toks[i])
    return time.perf_counter() - t0, toks, stamps


def _decode_ms(stamps: list[float]) -> float:
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # after the first output
    return 1e3 * statistics.median(gaps) if gaps else float("nan")


async def run_tp(tp: int, args, rng_seed: int) -> dict[str, Any]:
    from engine import AsyncEngine

    cfg = common.engine_config(args, tensor_parallel_size=tp, max_model_len=args.max_model_len)
    t0 = time.perf_counter()
    async with AsyncEngine.open(cfg) as eng:
        load_s = time.perf_counter() - t0
        hi = min(eng.runner.model_config.vocab_size - 1, 10000)
        rng = random.Random(rng_seed)
        prompts = [[rng.randint(0, hi) for _ in range(args.prompt_len)]
                   for _ in range(args.num_requests)]
        await _batch(eng, prompts[:1], 4)  # warm-up
        wall, outputs, _ = await _batch(eng, prompts, args.max_tokens)
        n_out = sum(map(len, outputs))
        _, _, s1 = await _batch(eng, prompts[:1], args.decode_tokens)
        _, _, sb = await _batch(eng, prompts[: args.batch], args.decode_tokens)
    return {"tp": tp, "load_s": load_s, "wall_s": wall, "output_tokens": n_out,
            "tok_s": n_out / wall, "decode_ms_b1": _decode_ms(s1[0]),
            f"decode_ms_b{args.batch}": _decode_ms(sb[0]), "outputs": outputs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap, default_cpu_model="random:tiny-llama",
                           default_cuda_model="random:qwen3-0.6b")
    ap.add_argument("--tp", default="1,2", help="comma-separated TP sizes (default 1,2)")
    ap.add_argument("--num-requests", type=int, default=None, help="default: 16 on cpu, 256 on cuda")
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 32 on cpu, 256 on cuda")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 32 on cpu, 256 on cuda")
    ap.add_argument("--decode-tokens", type=int, default=32, help="outputs per decode-time stream")
    ap.add_argument("--batch", type=int, default=8, help="the larger decode batch")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = common.finish_common_args(ap.parse_args(argv), "tp")
    cuda = args.device == "cuda"
    args.num_requests = args.num_requests or (256 if cuda else 16)
    args.prompt_len = args.prompt_len or (256 if cuda else 32)
    args.max_tokens = args.max_tokens or (256 if cuda else 32)
    rows = []
    for tp in (int(x) for x in args.tp.split(",")):
        row = anyio.run(run_tp, tp, args, args.seed)
        rows.append(row)
    ref = rows[0]["outputs"]
    print(f"{'TP':>3} {'load s':>7} {'tok/s':>9} {'decode ms b1':>13} "
          f"{'decode ms b' + str(args.batch):>13} {'same as first':>14}")
    for r in rows:
        r["same_outputs_as_first"] = r["outputs"] == ref
        print(f"{r['tp']:>3} {r['load_s']:7.2f} {r['tok_s']:9.1f} {r['decode_ms_b1']:13.2f} "
              f"{r[f'decode_ms_b{args.batch}']:13.2f} {str(r['same_outputs_as_first']):>14}")
    common.write_json(args.out, {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                                 "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

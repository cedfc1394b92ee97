"""Speculative decoding: output tokens/s with and without each speculator, acceptance.

    python -m bench.speculative --device cpu     # SmolLM2-135M (embedded GGUF), small settings
    python -m bench.speculative --device cuda    # random:qwen3-0.6b

Workloads (token-id prompts, greedy unless ``--temperature``, ``ignore_eos``), every request
submitted at t=0 through the in-process ``AsyncEngine``:

* ``repetitive`` — each prompt is a random unit of 4-16 tokens repeated to ``--prompt-len``:
  the model keeps repeating it, the n-gram lookup finds it (the best case for prompt lookup);
* ``random``     — uniformly random token ids (little to look up).

Speculators: ``none`` (the baseline), ``ngram`` (prompt lookup, k = ``--k``) and ``draft``
(``--draft-model``; default: the target itself, i.e. the acceptance upper bound at twice the
compute — no smaller model with the same vocabulary ships with the repo). One engine per
speculator runs both workloads; model load and a warm-up (one short request, or with
``--warmup full``, the default on cuda, a first untimed pass of each workload so that lazily
captured CUDA graphs are not timed) are outside the timed region.
Reported: output tok/s, speedup over ``none``, engine steps, acceptance rate (accepted /
proposed drafts), mean accepted drafts per verification, and whether the greedy outputs are
token-identical to ``none``. JSON: ``bench/results/speculative.json``.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import anyio

from . import common


def workloads(args, vocab: int) -> dict[str, list[list[int]]]:
    rng = random.Random(args.seed)
    hi = min(vocab - 1, 10000)
    rep, rnd = [], []
    for _ in range(args.num_requests):
        unit = [rng.randint(0, hi) for _ in range(rng.randint(4, 16))]
        rep.append((unit * (args.prompt_len // len(unit) + 1))[: args.prompt_len])
        rnd.append([rng.randint(0, hi) for _ in range(args.prompt_len)])
    out = {"repetitive": rep, "random": rnd}
    return {k: v for k, v in out.items() if k in args.workloads}


async def run_one(eng, prompts: list[list[int]], args) -> dict[str, Any]:
    from engine import SamplingParams

    outputs: dict[int, list[int]] = {}

    async def one(i: int, prompt: list[int]) -> None:
        toks: list[int] = []
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                temperature=args.temperature, seed=i if args.temperature else None)
        async for out in eng.generate(prompt, params):
            toks += out.token_ids
        outputs[i] = toks

    before = eng.statistics()
    spec = eng.runner.speculator
    s0 = spec.stats() if spec is not None else None
    common.sync(args.device)
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, p in enumerate(prompts):
            tg.start_soon(one, i, p)
    common.sync(args.device)
    wall = time.perf_counter() - t0
    after = eng.statistics()
    n_out = sum(len(t) for t in outputs.values())
    row: dict[str, Any] = {
        "wall_s": wall, "output_tokens": n_out, "tok_s": n_out / wall,
        "steps": after.steps - before.steps,
        "proposed": after.spec_proposed - before.spec_proposed,
        "accepted": after.spec_accepted - before.spec_accepted,
        "outputs": [outputs[i] for i in range(len(prompts))],
    }
    row["acceptance_rate"] = row["accepted"] / row["proposed"] if row["proposed"] else None
    if s0 is not None:
        s1 = spec.stats()
        ver = s1["verifications"] - s0["verifications"]
        row["mean_accepted_length"] = (s1["accepted"] - s0["accepted"]) / ver if ver else None
    return row


async def run_speculator(name: str, args, results: list[dict]) -> None:
    from engine import AsyncEngine, SamplingParams

    kw: dict[str, Any] = {}
    if name == "ngram":
        kw = dict(speculator="ngram", num_speculative_tokens=args.k)
    elif name == "draft":
        kw = dict(speculator="draft", num_speculative_tokens=args.k,
                  draft_model=args.draft_model or args.model)
    cfg = common.engine_config(args, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                               **kw)
    t0 = time.perf_counter()
    async with AsyncEngine.open(cfg) as eng:
        load_s = time.perf_counter() - t0
        vocab = eng.runner.model_config.vocab_size
        async for _ in eng.generate([1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)):
            pass  # warm-up
        work = workloads(args, vocab)
        if args.warmup == "full":  # every batch shape once: CUDA graphs are captured lazily
            for prompts in work.values():
                await run_one(eng, prompts, args)
        for wname, prompts in work.items():
            row = await run_one(eng, prompts, args)
            row.update(speculator=name, workload=wname, load_s=load_s,
                       draft_model=kw.get("draft_model"))
            results.append(row)
            print(f"  {name:6s} {wname:10s} {row['tok_s']:8.1f} tok/s  steps={row['steps']}"
                  f"  accept={common.fmt(row['acceptance_rate'], '.3f')}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap, default_cpu_model="default", default_cuda_model="random:qwen3-0.6b")
    ap.add_argument("--draft-model", default=None, help="draft model spec (default: the target)")
    ap.add_argument("--speculators", default="none,ngram,draft")
    ap.add_argument("--workloads", default="repetitive,random")
    ap.add_argument("--num-requests", type=int, default=None, help="default: 4 on cpu, 64 on cuda")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 64 on cpu, 256 on cuda")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 48 on cpu, 256 on cuda")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--warmup", choices=["short", "full"], default=None,
                    help="full: run each workload once untimed first, so that lazily captured "
                         "CUDA graphs are not timed (default: full on cuda, short on cpu)")
    args = common.finish_common_args(ap.parse_args(argv), "speculative")
    cuda = args.device == "cuda"
    args.num_requests = args.num_requests or (64 if cuda else 4)
    args.prompt_len = args.prompt_len or (256 if cuda else 64)
    args.max_tokens = args.max_tokens or (256 if cuda else 48)
    args.warmup = args.warmup or ("full" if cuda else "short")
    args.workloads = args.workloads.split(",")
    specs = args.speculators.split(",")
    if "none" in specs:  # the baseline first
        specs = ["none"] + [s for s in specs if s != "none"]

    results: list[dict] = []
    for name in specs:
        anyio.run(run_speculator, name, args, results)

    base = {r["workload"]: r for r in results if r["speculator"] == "none"}
    for r in results:
        b = base.get(r["workload"])
        r["speedup"] = r["tok_s"] / b["tok_s"] if b else None
        r["identical"] = (r["outputs"] == b["outputs"]) if b and not args.temperature else None
    cols = [("workload", "workload", ""), ("speculator", "speculator", ""),
            ("tok_s", "out tok/s", ".1f"), ("speedup", "speedup", ".2f"), ("steps", "steps", ""),
            ("proposed", "proposed", ""), ("accepted", "accepted", ""),
            ("acceptance_rate", "accept rate", ".3f"), ("mean_accepted_length", "mean acc len", ".2f"),
            ("identical", "= none", "")]
    rows = sorted(results, key=lambda r: (args.workloads.index(r["workload"]), specs.index(r["speculator"])))
    table = common.print_table(
        f"speculative decoding — {args.model} on {args.device}/{args.dtype}, {args.num_requests} "
        f"requests x {args.max_tokens} tokens, prompt {args.prompt_len}, k={args.k}, "
        f"temperature {args.temperature}", cols, rows)
    for r in results:
        del r["outputs"]
    common.write_json(args.out, {
        "bench": "speculative", "args": {k: (str(v) if k == "out" else v) for k, v in vars(args).items()
                                          if not k.startswith("_")},
        "environment": common.environment(args.device), "results": rows, "table": table})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Prefix caching on a chat-shaped workload: TTFT, output throughput and hit ratio, cache on/off.

    python -m bench.prefix --device cpu     # random:tiny-llama, 8 conversations x 3 turns, ~1 min
    python -m bench.prefix --device cuda    # random:qwen3-0.6b bf16, 64 conversations x 4 turns

Workload (token-id prompts, greedy, ``ignore_eos``, seeded): one system prompt of
``--system-len`` tokens (default 1,000) shared by every request; ``--conversations``
conversations of ``--turns`` turns each. Turn t's prompt is the whole conversation so far —
system prompt, every earlier user message and the engine's own answer to it — plus a new user
message of ``--min-user``..``--max-user`` tokens; so each turn extends the previous turn's prompt
exactly, as a chat client sends it. All conversations start at t=0; each submits its next turn
when its previous answer has finished streaming (closed loop). Answers are ``--max-tokens`` long.

Modes: ``on`` (``enable_prefix_caching=True``, the default) and ``off``, one engine each, one
after the other in this process. Model load and a warm-up (a short request with other tokens; on
cuda also an untimed pass of the workload over another system prompt so that lazily captured CUDA
graphs are not timed, then ``reset_prefix_cache()``) are outside the timed region: every timed run
starts with an empty cache.

Reported per mode: TTFT p50/p99 over all requests and for first / later turns, output tok/s,
the hit ratio (prompt tokens served from the cache / prompt tokens looked up, from
``EngineStats.prefix_cache_hits`` / ``prefix_cache_queries``), prompt tokens actually computed,
engine steps, and whether the greedy outputs equal the ``off`` run's. JSON:
``bench/results/prefix.json``.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import anyio

from . import common
from .common import now
from .device_sim import MODELS, simulate
from .recorder import Recorder

CPU_DEFAULTS = dict(model="random:tiny-llama", conversations=8, turns=3, min_user=32, max_user=96,
                    max_tokens=32)
CUDA_DEFAULTS = dict(model="random:qwen3-0.6b", conversations=64, turns=4, min_user=32,
                     max_user=128, max_tokens=128)


def plan(args, vocab: int, seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and every conversation's user messages (the answers come at run time)."""
    rng = random.Random(seed)
    hi = min(vocab - 1, 10000)
    system = [rng.randint(0, hi) for _ in range(args.system_len)]
    users = [[[rng.randint(0, hi) for _ in range(rng.randint(args.min_user, args.max_user))]
              for _ in range(args.turns)] for _ in range(args.conversations)]
    return system, users


async def run_workload(eng, system: list[int], users, args, rec: Recorder | None) -> dict:
    """Run every conversation to its end; returns ``{(conversation, turn): answer tokens}``."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    answers: dict[tuple[int, int], list[int]] = {}
    prompt_tokens = [0]

    async def conversation(c: int) -> None:
        history = list(system)
        for t, user in enumerate(users[c]):
            prompt = history + user
            prompt_tokens[0] += len(prompt)
            i = c * args.turns + t
            toks: list[int] = []
            if rec is not None:
                rec.submitted(i, now())
            async for out in eng.generate(prompt, params):
                toks += out.token_ids
                if rec is not None:
                    rec.piece(i, now(), len(out.token_ids),
                              out.finish_reason if out.finished else None)
                    rec.flush_bar()
            answers[(c, t)] = toks
            history = prompt + toks

    async with anyio.create_task_group() as tg:
        for c in range(len(users)):
            tg.start_soon(conversation, c)
    if rec is not None:
        rec.prompt_tokens = prompt_tokens[0]
    return answers


async def run_mode(name: str, args) -> dict[str, Any]:
    from engine import AsyncEngine, SamplingParams

    cfg = common.engine_config(args, enable_prefix_caching=name == "on",
                               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    t0 = now()
    async with AsyncEngine.open(cfg) as eng:
        load_s = now() - t0
        if args.sim:  # the host's work against a modelled device (bench/device_sim.py)
            simulate(eng.runner, args.sim, args.eager_ms)
        vocab = eng.runner.model_config.vocab_size
        async for _ in eng.generate([3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_tokens=8, ignore_eos=True)):
            pass
        if args.warmup == "full":
            await run_workload(eng, *plan(args, vocab, args.seed + 1), args, None)
        eng.core.blocks.reset_prefix_cache()
        system, users = plan(args, vocab, args.seed)
        n = args.conversations * args.turns
        s0 = eng.statistics()
        with common.progress(n * args.max_tokens, f"prefix caching {name}", "tok",
                             args.no_progress) as bar:
            rec = Recorder([([], args.max_tokens)] * n, bar)
            rec.t0 = now()
            common.sync(args.device)
            answers = await run_workload(eng, system, users, args, rec)
            common.sync(args.device)
            rec.t1 = now()
        s1 = eng.statistics()
    queries = s1.prefix_cache_queries - s0.prefix_cache_queries
    hits = s1.prefix_cache_hits - s0.prefix_cache_hits
    row = rec.summary(name, load_s=load_s, steps=s1.steps - s0.steps,
                      preemptions=s1.preemptions - s0.preemptions,
                      prefix_cache_queries=queries, prefix_cache_hits=hits,
                      hit_ratio=hits / queries if queries else 0.0,
                      computed_prompt_tokens=rec.prompt_tokens - hits)
    for label, turns in (("first", [0]), ("later", range(1, args.turns))):
        ttft = [rec.first[c * args.turns + t] - rec.submit[c * args.turns + t]
                for c in range(args.conversations) for t in turns]
        for p in (50, 99):
            v = common.percentile(ttft, p)
            row[f"ttft_{label}_p{p}_ms"] = None if v is None else v * 1e3
    row["outputs"] = [answers[(c, t)] for c in range(args.conversations) for t in range(args.turns)]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(ap, default_cpu_model=CPU_DEFAULTS["model"],
                           default_cuda_model=CUDA_DEFAULTS["model"])
    ap.add_argument("--modes", default="on,off")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the modes this many times, interleaved (a fresh engine each); each "
                         "row is the run with the median TTFT p50, with each round's ratios")
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--conversations", type=int, default=None)
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--min-user", type=int, default=None)
    ap.add_argument("--max-user", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="answer length of every turn")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: the longest last-turn prompt plus its answer, rounded up")
    ap.add_argument("--warmup", choices=["short", "full"], default=None,
                    help="full: an untimed pass over another system prompt first (default on cuda)")
    ap.add_argument("--sim", default=None, choices=sorted(MODELS),
                    help="cpu only: a null model and a simulated device under the engine "
                         "(bench/device_sim.py): the host's part of TTFT against a modelled H200")
    ap.add_argument("--eager-ms", type=float, default=None,
                    help="with --sim: host time (GIL held) of a step with prompt tokens")
    args = common.finish_common_args(ap.parse_args(argv), "prefix")
    if args.sim and args.device != "cpu":
        ap.error("--sim runs on cpu")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for k, v in defaults.items():
        if k != "model" and getattr(args, k) is None:
            setattr(args, k, v)
    args.warmup = args.warmup or ("full" if args.device == "cuda" else "short")
    if args.max_model_len is None:
        longest = args.system_len + args.turns * (args.max_user + args.max_tokens)
        args.max_model_len = -(-(longest + 1) // 256) * 256
    modes = args.modes.split(",")

    # NOTE: rounds interleave the modes (on, off, on, off ...), each run on a fresh engine: the
    # device host's speed varied by 10-20 % from process to process and run to run (on H100 hosts:
    # off / on 2.53-3.33 in five single pairs on one kind of machine)
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name in modes:
            runs[name].append(anyio.run(run_mode, name, args))
    rows = [common.median_run(runs[name], "ttft_p50_ms", also=("output_tok_s",))
            for name in modes]
    for name, row in zip(modes, rows):
        row["outputs"] = runs[name][0]["outputs"]  # greedy outputs: the first round's
    base = next((r for r in rows if r["mode"] == "off"), None)
    for r in rows:
        r["identical"] = (r["outputs"] == base["outputs"]) if base not in (None, r) else None
    on = next((r for r in rows if r["mode"] == "on"), None)
    ratios = {}
    if on is not None and base is not None:
        ratios = {"ttft_p50 off/on": _ratio(base["ttft_p50_ms"], on["ttft_p50_ms"]),
                  "ttft_p99 off/on": _ratio(base["ttft_p99_ms"], on["ttft_p99_ms"]),
                  "output_tok_s on/off": _ratio(on["output_tok_s"], base["output_tok_s"])}
        if args.rounds > 1:  # each round's, against that round's other mode
            ratios["ttft_p50 off/on by round"] = [
                _ratio(b["ttft_p50_ms"], o["ttft_p50_ms"]) for o, b in zip(runs["on"], runs["off"])]
            ratios["output_tok_s on/off by round"] = [
                _ratio(o["output_tok_s"], b["output_tok_s"]) for o, b in zip(runs["on"], runs["off"])]
    cols = [("mode", "caching", ""), ("ttft_p50_ms", "TTFT p50 ms", ".1f"),
            ("ttft_p99_ms", "TTFT p99 ms", ".1f"), ("ttft_first_p50_ms", "1st turn p50", ".1f"),
            ("ttft_later_p50_ms", "later p50", ".1f"), ("output_tok_s", "out tok/s", ".1f"),
            ("hit_ratio", "hit ratio", ".3f"), ("computed_prompt_tokens", "prompt computed", ""),
            ("prompt_tokens", "prompt total", ""), ("steps", "steps", ""),
            ("identical", "= off", "")]
    table = common.print_table(
        f"prefix caching — {args.model} on {args.device}/{args.dtype}: system prompt "
        f"{args.system_len} tokens, {args.conversations} conversations x {args.turns} turns, user "
        f"[{args.min_user}, {args.max_user}], answers {args.max_tokens}", cols, rows)
    for k, v in ratios.items():
        print(f"  {k}: " + (" ".join(common.fmt(x, '.2f') for x in v) if isinstance(v, list)
                             else common.fmt(v, '.2f')))
    for r in rows:
        r.pop("outputs", None)
    common.write_json(args.out, {
        "bench": "prefix", "args": {k: (str(v) if k == "out" else v) for k, v in vars(args).items()
                                    if not k.startswith("_")},
        "environment": common.environment(args.device), "modes": rows, "ratios": ratios,
        "table": table})
    print(f"wrote {args.out}")
    return 0


def _ratio(a, b):
    return a / b if a is not None and b else None


if __name__ == "__main__":
    raise SystemExit(main())

"""Structured outputs: throughput with 0 %, 50 % and 100 % of the requests constrained by a JSON
schema, and grammar compile time, cold and cached.

    python -m bench.structured --device cpu     # the default model (SmolLM2-135M GGUF), 8 requests
    python -m bench.structured --device cuda    # random:qwen3-0.6b bf16, 256 requests

Workload: ``--requests`` text prompts (the same prompt with a number, so the prefix cache plays
the same part in every mode), all submitted at once; greedy; unconstrained requests run
``--max-tokens`` tokens (``ignore_eos``); constrained ones are held to :data:`SCHEMA` (an object
with an array of ``--items`` short strings: long enough to keep them decoding, bounded so each
ends), and end when the grammar completes or at ``--max-tokens``. On random weights the mask
alone keeps the output valid; on a ``random:`` preset the unconstrained tokens are made
printable text first (:func:`printable_head`; ``--no-text-head``: ids that decode to nothing).
Modes: the fraction of requests constrained (``--fractions``), one after the other on one engine; the schema's grammar is compiled (and cached) before the timed
runs, so every timed constrained request finds it cached. Reported per mode: output tokens,
wall time, output tok/s, engine steps and how many of them were overlapped (scheduled and their
forward launched before the step before's tokens were read back: ``overlap_scheduling``).
Constrained requests keep the overlap, at a price: a step with a constrained request is
sampled "late" -- its forward is launched, then the step before is read back, its matchers take
their tokens, the next masks are filled (on a helper thread, while the rest of the step before
is applied), and only then are the masks applied and the step sampled -- so the host work of
applying a step and filling the masks runs beside the forward but no longer beside the
sampling, and whatever of it outlasts the forward is device idle time. Columns ``late``
(such steps), ``beside`` (those whose grammar work ran on the grammar worker beside the
forward's launch, ``engine/structured/native.py``; the ``grammar_worker`` kill switch turns it
off; ``inside`` / ``after``: of those, the jobs started inside the forward's launch / after
it, the step before being still on the device before it) and, per late step, the host's ms by part: ``fwd`` (launching the forward),
``read`` (waiting for the step before's tokens, feeding them to the matchers, starting the
fill), ``apply`` (stop checks, detokenization, outputs of the step before), ``mask`` (waiting
for the fill, masking, launching the sampling: what the fill costs beyond ``apply``); ``fill``:
the grammar worker's mean wall ms a fill of the next step's masks (on its own thread).
With ``--plain`` (the default) one more mode, ``100 % plain``: every request held to
:func:`schema_plain`, the same shape without length bounds (on random weights a string ends only
when the quote is drawn, so most of these outputs end at ``--max-tokens``, not valid JSON: the row
measures the cost a token inside unbounded strings). Then mean time per step, valid outputs (constrained ones that
``json.loads(strict=False)``, and with ``strict``: xgrammar 0.2.8 lets a string with
``minLength``/``maxLength`` hold raw control characters, which random weights do pick); and the compile times: the first compile of each schema of
:data:`COMPILE_SCHEMAS` (cold) and a second request for it (cached). JSON:
``bench/results/structured.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import anyio

from . import common, resources, step_timeline
from .common import now
from .device_sim import MODELS

CPU_DEFAULTS = dict(model="default", requests=8, max_tokens=64, items=4)
CUDA_DEFAULTS = dict(model="random:qwen3-0.6b", requests=256, max_tokens=256, items=20)


def schema(items: int) -> dict:
    return {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "minItems": items, "maxItems": items,
                 "items": {"type": "string", "minLength": 1, "maxLength": 6}},
        "score": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["title", "tags", "score"]}


def schema_plain(items: int) -> dict:
    """:func:`schema` without the strings' length bounds (a typical schema)."""
    return {"type": "object", "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "minItems": items, "maxItems": items,
                 "items": {"type": "string"}},
        "score": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["title", "tags", "score"]}


#: schemas whose compile time is reported (cold, then cached)
COMPILE_SCHEMAS: dict[str, Any] = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                "age": {"type": "integer", "minimum": 0}},
               "required": ["name", "age"]},
    "order": {"type": "object", "properties": {"id": {"type": "integer"}, "items": {
        "type": "array", "maxItems": 8, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}}},
        "required": ["id", "items"]},
    "json_object": None,  # response_format json_object
}


async def compile_times(eng) -> list[dict]:
    from engine import StructuredOutputs

    rows = []
    for name, s in COMPILE_SCHEMAS.items():
        c = (StructuredOutputs(json_object=True) if s is None
             else StructuredOutputs(json_schema=s))
        t0 = now()
        await eng.grammars.compiled(c)
        cold = now() - t0
        t0 = now()
        await eng.grammars.compiled(StructuredOutputs(json_object=True) if s is None
                                    else StructuredOutputs(json_schema=s))
        rows.append({"schema": name, "cold_ms": 1e3 * cold, "cached_us": 1e6 * (now() - t0)})
    return rows


async def run_mode(eng, args, fraction: float, constraint, label: str = "") -> dict:
    from engine import SamplingParams

    n = args.requests
    k = round(fraction * n)
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                             structured=constraint if i < k else None) for i in range(n)]
    texts: list[str] = [""] * n
    tokens = [0] * n
    steps0 = eng.statistics().steps
    deferred0 = eng.core.deferred_steps
    late0, split0 = eng.core.late_sampled_steps, dict(eng.core.late_seconds)
    jobs0, after0 = eng.core.grammar_jobs, eng.core.grammar_jobs_after
    inside0 = eng.core.grammar_jobs_inside
    fills0 = eng.runner.grammar_worker_fills

    async def one(i: int) -> None:
        async for out in eng.generate(f"Request {i}: describe a product as JSON.\n", params[i]):
            texts[i] += out.text
            tokens[i] = out.num_output_tokens

    common.sync(args.device)
    device = getattr(eng, "sim_device", None)
    busy0 = device.busy_s if device is not None else 0.0
    cpu0, threads0 = resources.cpu_times(), resources.thread_times()
    parts0 = {k: list(v) for k, v in args._phases.items()} if args._phases is not None else None
    t0 = now()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    common.sync(args.device)
    wall = now() - t0
    steal = resources.steal_share(cpu0, resources.cpu_times())
    threads1 = resources.thread_times()
    busy = (device.busy_s - busy0) / wall if device is not None else None
    timeline = args._timeline.summary(t0, t0 + wall) if args._timeline is not None else None
    steps = eng.statistics().steps - steps0
    threads = resources.thread_deltas(threads0, threads1, max(steps, 1))
    parts = (step_timeline.phase_deltas(parts0, args._phases, max(steps, 1))
             if parts0 is not None else None)
    deferred = eng.core.deferred_steps - deferred0
    late = eng.core.late_sampled_steps - late0
    fills = [b - a for a, b in zip(fills0, eng.runner.grammar_worker_fills)]
    split = {f"late_{part}_ms": 1e3 * (v - split0[part]) / late if late else None
             for part, v in eng.core.late_seconds.items()}
    valid = strict = 0
    for t in texts[:k]:
        try:
            json.loads(t, strict=False)
            valid += 1
            json.loads(t)
            strict += 1
        except ValueError:
            pass
    out = sum(tokens)
    return {"constrained": f"{100 * fraction:.0f} %{label}", "requests": n, "output_tokens": out,
            # characters of text delivered (all requests): what detokenization had to produce
            "text_chars": sum(map(len, texts)),
            "wall_s": wall, "tok_s": out / wall, "steps": steps, "overlapped": deferred,
            "late": late, "beside": eng.core.grammar_jobs - jobs0,
            "after_fwd": eng.core.grammar_jobs_after - after0,
            "inside_fwd": eng.core.grammar_jobs_inside - inside0, **split, "device_busy": busy,
            "worker_fill_ms": 1e3 * fills[1] / fills[0] if fills[0] else None,
            "ms_per_step": 1e3 * wall / steps if steps else None, "steal": steal,
            "valid": f"{valid}/{k}" if k else "-", "valid_strict": f"{strict}/{k}" if k else "-",
            "threads_per_step": threads,
            **({"timeline": timeline} if timeline is not None else {}),
            **({"phases_per_step": parts} if parts is not None else {})}


def printable_head(runner) -> int:
    """Make a ``random:`` preset's unconstrained greedy tokens printable text; returns how many
    LM-head rows were zeroed (0: not a byte-level tokenizer's model, left alone).

    A ``random:`` preset's byte-level tokenizer spells ids 0..255 as bytes and every id past
    257 (all but 258 of qwen3-0.6b's 151,936) as nothing, and random weights' argmax is nearly
    always such an id: the unconstrained requests' output is then empty text, and the 0 %
    baseline skips the detokenization and text delivery that a real model's output costs
    (and that the constrained rows, held to JSON, pay). Zeroing the head's rows outside
    printable ASCII (tab and newline kept) makes those logits 0 while the printable ids' stay
    random, so the argmax is a printable character, at the same device cost: the same matmul
    over the same shape. Both modes run the one engine, so both see the same model."""
    import torch

    from engine.memory.owner import Resource as R

    tok = runner.tokenizer
    if tok is None or getattr(tok, "_backend", True) is not None:
        return 0
    model = runner._owner[R.WEIGHTS]
    if getattr(model, "packed_head", None) is not None:  # (a CPU checkpoint's int8 head)
        return 0
    w = (model.model.embed_tokens.weight if model.config.tie_word_embeddings
         else model.lm_head.weight)
    if w.shape[0] != tok.vocab_size:  # a rank's slice of the vocabulary (tensor parallel): the
        return 0  # other ranks' rows are out of reach here, so the tokens would not be text
    keep = torch.zeros(w.shape[0], dtype=torch.bool, device=w.device)
    keep[32:127] = True
    keep[9] = keep[10] = True
    with torch.no_grad():
        w[~keep] = 0
    return int((~keep).sum())


async def bench(args) -> dict:
    from engine import AsyncEngine, SamplingParams, StructuredOutputs

    cfg = common.engine_config(args, max_num_seqs=max(args.requests, 1))
    async with AsyncEngine.open(cfg) as eng:
        device = None
        if args.sim:  # the host's work against a modelled device (bench/device_sim.py)
            from .device_sim import simulate

            device = simulate(eng.runner, args.sim, varied=True)
        eng.sim_device = device
        zeroed = printable_head(eng.runner) if args.text_head else 0
        if args.sim:  # what the engine does on an asynchronous device (EngineCore.step)
            eng.core.apply_after_sampling = args.apply_after_sampling
        # warm-up, untimed: an unconstrained request and the schema's compile (then cached)
        async for _ in eng.generate("warm up", SamplingParams(max_tokens=4)):
            pass
        constraint = StructuredOutputs(json_schema=schema(args.items))
        t0 = now()
        await eng.grammars.compiled(constraint)
        first_compile_ms = 1e3 * (now() - t0)  # includes the tokenizer info, built once
        compiles = await compile_times(eng)
        if args.device == "cuda":  # CUDA graphs are captured lazily: untimed passes, the
            # 100 % one for the kernels' variants only an all-constrained batch uses (Triton
            # compiles each on its first call: tens of ms inside a timed run otherwise)
            await run_mode(eng, args, 0.5, constraint)
            await run_mode(eng, args, 1.0, constraint)
        # NOTE: rounds interleave the fractions (0 %, 100 %, 0 %, 100 % ...): the device host's
        # step time drifted by 10-20 % between runs a minute apart, so one
        # run of each mode can put the ratio anywhere in that band
        runs: dict[float, list[dict]] = {f: [] for f in args.fractions}
        for _ in range(args.rounds):
            for f in args.fractions:
                runs[f].append(await run_mode(eng, args, f, constraint))
        modes = [common.median_run(runs[f], "tok_s") for f in args.fractions]
        if args.plain:
            plain = StructuredOutputs(json_schema=schema_plain(args.items))
            await eng.grammars.compiled(plain)
            modes.append(await run_mode(eng, args, 1.0, plain, " plain"))
    base = modes[0]["tok_s"] if modes and args.fractions[0] == 0 else None
    for m in modes:
        m["vs_unconstrained"] = m["tok_s"] / base if base else None
    if base and args.rounds > 1:  # each round's ratios, against that round's 0 % run
        for f, m in zip(args.fractions, modes):
            m["vs_unconstrained_by_round"] = [
                r["tok_s"] / b["tok_s"] for r, b in zip(runs[f], runs[args.fractions[0]])]
    return {"modes": modes, "compile": compiles, "first_compile_ms": first_compile_ms,
            "head_rows_zeroed": zeroed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(ap, default_cpu_model=CPU_DEFAULTS["model"],
                           default_cuda_model=CUDA_DEFAULTS["model"])
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--items", type=int, default=None, help="strings in the schema's array")
    ap.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.0, 0.5, 1.0])
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the fractions this many times, interleaved; each row is the run "
                         "with the median tok/s, its ratio against the 0 %% median")
    ap.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True,
                    help="one more mode: 100 %% constrained by schema_plain (no maxLength)")
    ap.add_argument("--sim", default=None, choices=sorted(MODELS),
                    help="cpu only: a null model (a random vector per input token) and a simulated "
                         "device under the engine (bench/device_sim.py): the host's cost of "
                         "constraints against a modelled H200 step")
    ap.add_argument("--timeline", action="store_true",
                    help="time every engine step (bench/step_timeline.py): each mode's steps, "
                         "gaps and collections, and its longest steps (in the JSON)")
    ap.add_argument("--phases", action="store_true",
                    help="time the step's parts (bench/step_timeline.py STEP_PARTS): calls, wall "
                         "and the step thread's CPU ms a step, by mode")
    ap.add_argument("--phase-targets", default="",
                    help="with --phases: more parts to time, comma-separated module:Class.method "
                         "or module:function (that module's global)")
    ap.add_argument("--text-head", action=argparse.BooleanOptionalAction, default=True,
                    help="a random: preset (byte-level tokenizer): zero the LM head's rows outside "
                         "printable ASCII, so that unconstrained tokens are text, as a real "
                         "model's are, not ids that decode to nothing (printable_head)")
    ap.add_argument("--apply-after-sampling", action=argparse.BooleanOptionalAction,
                    default=True, help="with --sim: the order of a late-sampled step "
                    "(EngineCore.apply_after_sampling; on by default on CUDA)")
    args = common.finish_common_args(ap.parse_args(argv), "structured")
    if args.sim and args.device != "cpu":
        ap.error("--sim runs on cpu")
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for key in ("requests", "max_tokens", "items"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        args._timeline = stack.enter_context(step_timeline.recording()) if args.timeline else None
        extra = tuple(t for t in args.phase_targets.split(",") if t)
        args._phases = (stack.enter_context(step_timeline.phases(step_timeline.STEP_PARTS + extra))
                        if args.phases else None)
        res = anyio.run(bench, args)
    table = common.print_table(
        f"structured outputs: {args.model} on {args.device}, {args.requests} requests, "
        f"max_tokens {args.max_tokens}",
        [("constrained", "constrained", ""), ("output_tokens", "out tok", ""),
         ("wall_s", "wall s", ".2f"), ("tok_s", "tok/s", ".1f"),
         ("vs_unconstrained", "vs 0 %", ".3f"), ("steps", "steps", ""),
         ("overlapped", "overlapped", ""), ("late", "late", ""), ("beside", "beside", ""),
         ("inside_fwd", "inside", ""), ("after_fwd", "after", ""),
         ("late_forward_ms", "fwd", ".2f"), ("late_read_back_ms", "read", ".2f"),
         ("late_apply_ms", "apply", ".2f"), ("late_mask_sample_ms", "mask", ".2f"),
         ("worker_fill_ms", "fill", ".2f"), ("ms_per_step", "ms/step", ".2f"),
         ("text_chars", "chars", ""),
         ("steal", "steal", ".3f")]
        + ([("device_busy", "device busy", ".3f")] if args.sim else [])
        + [("valid", "valid JSON", ""),
         ("valid_strict", "strict", "")], res["modes"])
    for m in res["modes"]:
        print(f"  {m['constrained']}: threads, a step: " + "; ".join(
            f"{k} cpu {v['cpu_ms']:.2f} runq {v['runq_ms']:.2f} ms, switches "
            f"{v['vol_switches']:.1f}+{v['invol_switches']:.1f}"
            for k, v in m.get("threads_per_step", {}).items()))
        for k, v in m.get("phases_per_step", {}).items():
            print(f"    {k:34s} {v['calls']:5.2f} calls  wall {v['wall_ms']:6.3f}  "
                  f"cpu {v['cpu_ms']:6.3f} ms a step")
        if m.get("timeline"):
            step_timeline.print_summary(m["constrained"], m["timeline"])
    for m in res["modes"]:
        if m.get("vs_unconstrained_by_round"):
            print(f"  {m['constrained']}: vs 0 % by round "
                  + " ".join(f"{x:.3f}" for x in m["vs_unconstrained_by_round"]))
    common.print_table("grammar compile (the schema of the timed runs: "
                       f"{res['first_compile_ms']:.0f} ms, with the vocabulary's tokenizer info)",
                       [("schema", "schema", ""), ("cold_ms", "cold ms", ".1f"),
                        ("cached_us", "cached us", ".1f")], res["compile"])
    common.write_json(args.out, {"benchmark": "structured", "args": {
        k: v for k, v in vars(args).items() if not k.startswith("_")},
        "environment": common.environment(args.device), **res, "table": table,
        "elapsed_s": time.time() - t0})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

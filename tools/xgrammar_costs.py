"""The host cost of structured outputs per engine step, xgrammar alone (no model, no device):
``--requests`` matchers of one cached JSON-schema grammar driven along realistic trajectories.

    python -m tools.xgrammar_costs                       # random:qwen3-0.6b's vocabulary, 256 rows
    python -m tools.xgrammar_costs --fill-threads 1,2,4,8,14

Each step every live matcher's row is filled, then each matcher takes a random token of its row
(what random weights do: any allowed token), until all are complete. Timed per step, on the same
states: the rows filled one at a time on this thread (each row timed, and classed by the state the
output is in: inside a JSON string at a character boundary, inside one mid UTF-8 character, or
elsewhere), the rows filled in one ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` call with
each ``--fill-threads`` count, and the tokens taken one ``accept_token`` call per matcher from
Python (``structured.matcher.advance``) against one ``batch_accept_token`` call
(``structured.matcher.advance_all``). Setups (``--setups``): ``engine``, what the engine does
(``grammars.tokenizer_info``: the ids up to the last one with text or an EOS id; the schema's
bounded strings counted by ``compiler.count_bounded_strings``); ``uncounted``, the same
vocabulary with xgrammar's own ``compile_json_schema``; ``padded``, every id of the model's
vocabulary (the padding as empty special entries) with ``compile_json_schema``: what the engine
did before. The setups draw the same random numbers, so equal masks give equal trajectories:
``same`` says whether a setup's outputs are the first setup's, byte for byte. Schemas
(``--schemas``): ``bench`` (``bench.structured.schema``, strings with ``maxLength``) and
``plain`` (the same shape, no length bounds). Per-row costs are CPU time
of one thread: a fill of N rows on T threads takes about N x (row cost) / T. JSON:
``bench/results/xgrammar_costs.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from bench import common
from bench.structured import schema, schema_plain

STATES = ("string", "string mid-utf8", "other")


def _state(text: bytes) -> str:
    """Where a JSON text that ends with ``text`` is: in a string (at a character boundary or
    inside one) or elsewhere."""
    in_str = esc = False
    start = 0
    for i, b in enumerate(text):
        if esc:
            esc = False
        elif in_str and b == 0x5C:
            esc = True
        elif b == 0x22:
            in_str = not in_str
            start = i + 1
    if not in_str:
        return "other"
    try:
        text[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data":
            return "string mid-utf8"
    return "string"


def padded_info(tokenizer, vocab_size: int):
    """Every id of the model's vocabulary (as before ``grammar_vocab_size``)."""
    import xgrammar as xgr

    table = tokenizer.byte_table
    special = set(tokenizer.special_token_ids())
    vocab = [b"" if i in special else table[i] if i < len(table) else b""
             for i in range(vocab_size)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=sorted(tokenizer.eos_token_ids))


def compile_setup(setup: str, tokenizer, vocab_size: int, grammar_json: dict):
    """(compiled grammar, its vocabulary's size, compile ms) of ``setup``."""
    import xgrammar as xgr

    from engine.structured.compiler import _SEPARATORS, _compile_json_schema
    from engine.structured.grammars import tokenizer_info

    info = (padded_info if setup == "padded" else tokenizer_info)(tokenizer, vocab_size)
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    if setup == "engine":
        g = _compile_json_schema(comp, json.dumps(grammar_json))
    else:
        g = comp.compile_json_schema(json.dumps(grammar_json), any_whitespace=False,
                                     separators=_SEPARATORS)
    return g, info.vocab_size, 1e3 * (time.perf_counter() - t0)


def run(g, vocab: int, n: int, threads: list[int], seed: int, max_steps: int,
        text_of) -> dict:
    import xgrammar as xgr

    from engine.structured.matcher import advance, advance_all

    matchers = [xgr.GrammarMatcher(g) for _ in range(n)]
    words = -(-vocab // 32)
    bm = torch.full((n, words), -1, dtype=torch.int32)
    batches = {t: xgr.BatchGrammarMatcher(max_threads=t) for t in threads}
    rng = np.random.default_rng(seed)
    texts = [b""] * n
    per_state: dict[str, list[float]] = {s: [] for s in STATES}
    steps = []
    for _ in range(max_steps):
        live = [i for i in range(n) if not matchers[i].is_terminated()]
        if not live:
            break
        ms = [matchers[i] for i in live]
        step: dict = {"rows": len(live)}
        t_rows = 0.0
        for i in live:
            t = time.perf_counter()
            matchers[i].fill_next_token_bitmask(bm, i)
            dt = time.perf_counter() - t
            t_rows += dt
            per_state[_state(texts[i])].append(dt)
        step["fill_1"] = t_rows
        for t, b in batches.items():
            t0 = time.perf_counter()
            b.batch_fill_next_token_bitmask(ms, bm, live)
            step[f"batch_fill_{t}"] = time.perf_counter() - t0
        bits = np.unpackbits(bm[live].numpy().view(np.uint8), axis=1, bitorder="little")
        toks = [int(rng.choice(np.flatnonzero(row))) for row in bits]
        t0 = time.perf_counter()
        loop = [advance(m, tok) for m, tok in zip(ms, toks)]
        step["accept_loop"] = time.perf_counter() - t0
        xgr.BatchGrammarMatcher.batch_rollback(ms, 1)
        t0 = time.perf_counter()
        batched = advance_all(ms, toks)
        step["accept_batch"] = time.perf_counter() - t0
        if loop != batched:
            raise AssertionError("advance and advance_all disagree")
        for i, tok in zip(live, toks):
            texts[i] += text_of(tok)
        steps.append(step)
    if not steps:
        raise RuntimeError("no step ran")
    rows = sum(s["rows"] for s in steps)
    every = [x for v in per_state.values() for x in v]
    out = {"steps": len(steps), "rows_per_step": rows / len(steps), "grammar_vocab": vocab,
           "outputs": texts,
           "row_fill_us": 1e6 * statistics.fmean(every),
           "done": sum(m.is_terminated() for m in matchers),
           "sample": texts[0][:120].decode("utf-8", "replace")}
    for key in steps[0]:
        if key != "rows":
            out[f"{key}_ms"] = 1e3 * statistics.fmean(s[key] for s in steps)
    out["accept_loop_us_row"] = 1e3 * out["accept_loop_ms"] * len(steps) / rows
    out["accept_batch_us_row"] = 1e3 * out["accept_batch_ms"] * len(steps) / rows
    total = sum(every)
    out["by_state"] = {s: {"rows": len(v), "mean_us": 1e6 * statistics.fmean(v) if v else None,
                           "median_us": 1e6 * statistics.median(v) if v else None,
                           "share": sum(v) / total if total else None}
                       for s, v in per_state.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3-0.6b", help="whose tokenizer and vocabulary")
    ap.add_argument("--requests", type=int, default=256, help="matchers (rows a step)")
    ap.add_argument("--items", type=int, default=20, help="strings in the schema's array")
    ap.add_argument("--fill-threads", type=lambda s: [int(x) for x in s.split(",")],
                    default=None, help="BatchGrammarMatcher thread counts (default: 1 and the "
                    "engine's own, CPUs less two)")
    ap.add_argument("--setups", default="engine,uncounted,padded")
    ap.add_argument("--schemas", default="bench,plain")
    ap.add_argument("--max-steps", type=int, default=256,
                    help="steps at most (the structured bench's max_tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "xgrammar_costs.json")
    args = ap.parse_args(argv)
    from engine.loader.checkpoint import resolve_source
    from engine.structured.kernels import fill_threads as _fill_threads

    threads = args.fill_threads or sorted({1, _fill_threads()})
    cfg, _, tok = resolve_source(args.model)
    schemas = {"bench": schema(args.items), "plain": schema_plain(args.items)}
    table = tok.byte_table

    def text_of(t: int) -> bytes:
        return table[t] if t < len(table) and t not in tok.eos_token_ids else b""

    rows = []
    for sname in args.schemas.split(","):
        first = None
        for setup in args.setups.split(","):
            g, vocab, compile_ms = compile_setup(setup, tok, cfg.vocab_size, schemas[sname])
            r = run(g, vocab, args.requests, threads, args.seed, args.max_steps, text_of)
            outputs = r.pop("outputs")
            first = outputs if first is None else first
            for s, v in r["by_state"].items():
                r[f"{s}_us"], r[f"{s}_share"] = v["mean_us"], v["share"]
            rows.append({"schema": sname, "setup": setup, "compile_ms": compile_ms,
                         "same": outputs == first, **r})
    cols = [("schema", "schema", ""), ("setup", "setup", ""), ("grammar_vocab", "ids", ""),
            ("same", "same", ""), ("steps", "steps", ""), ("rows_per_step", "rows", ".0f"),
            ("accept_loop_ms", "accept loop ms", ".3f"),
            ("accept_batch_ms", "accept batch ms", ".3f"),
            ("fill_1_ms", "fill 1-by-1 ms", ".2f")]
    cols += [(f"batch_fill_{t}_ms", f"batch fill {t}T ms", ".2f") for t in threads]
    cols += [("row_fill_us", "row us", ".1f")]
    cols += [(f"{s}_us", f"{s} us", ".1f") for s in STATES]
    cols += [(f"{s}_share", f"{s} share", ".2f") for s in STATES]
    title = (f"xgrammar host cost a step: {args.model}'s vocabulary ({cfg.vocab_size} ids), "
             f"{args.requests} matchers, {os.cpu_count()} CPUs; per step (ms) and per row "
             f"(us, one thread)")
    text = common.print_table(title, cols, rows)
    env = common.environment("cpu")
    env["xgrammar"] = metadata.version("xgrammar")
    common.write_json(args.out, {"benchmark": "xgrammar_costs", "args": {
        k: str(v) for k, v in vars(args).items()}, "environment": env, "rows": rows,
        "table": text})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

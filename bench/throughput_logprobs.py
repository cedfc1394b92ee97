"""``bench.throughput --logprobs-compare K``: the same workload without and with ``logprobs``
(the top K) on every request, alternated within each round (each run in a fresh process), and
the ratio with/without per round and its median -- the per-round pairing cancels most of a
shared machine's drifting load. The order within a round alternates too (round 1 without
first, round 2 with first, ...), so neither variant always runs on a warmer machine.

Where a run reports its process CPU seconds (bare, inproc), the ratio of output tokens per CPU
second is printed too: on a machine whose other tenants take the cores in bursts, wall-clock
tok/s swings by 2x between back-to-back runs, while the CPU time the engine itself spent on the
same work moves far less (it still grows somewhat under contention: caches, SMT siblings)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Optional

from . import common, throughput_modes
from .throughput_rounds import run_isolated


def child_argv(argv: list[str], k: Optional[int]) -> list[str]:
    """``argv`` without ``--logprobs-compare`` (and any ``--logprobs``), plus ``--logprobs k``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--logprobs-compare", "--logprobs"):
            skip = True
            continue
        if a.startswith(("--logprobs-compare=", "--logprobs=")):
            continue
        out.append(a)
    return out + (["--logprobs", str(k)] if k is not None else [])


def compare(modes: list[str], rounds: int, k, run: Callable[[str, Optional[int]], dict],
            log=print, what: str = "logprobs") -> dict[str, Any]:
    """``run(mode, logprobs)`` -> a result row, for every mode, ``rounds`` times each variant
    (``k`` the "with" one, None without; ``what`` names it in the progress lines).
    Returns ``{mode: {"without": [tok/s], "with": [tok/s], "ratios": [...], "median_ratio"}}``."""
    res: dict[str, Any] = {m: {"without": [], "with": [], "ratios": [], "cpu_ratios": [],
                               "cpu_s": {"without": [], "with": []}, "errors": []} for m in modes}
    for r in range(rounds):
        for m in modes:
            order = (None, k) if r % 2 == 0 else (k, None)
            got: dict[Optional[int], Optional[float]] = {}
            cpu: dict[Optional[int], Optional[float]] = {}
            for v in order:
                t = time.perf_counter()
                print(f"[round {r + 1}/{rounds}] {m} {f'{what} {v}' if v is not None else 'without'}",
                      file=sys.stderr, flush=True)
                row = run(m, v)
                got[v] = row.get("output_tok_s")
                cpu[v] = row.get("cpu_s")
                if got[v] is None:
                    res[m]["errors"].append(row.get("error") or row.get("skipped") or "no result")
                log(f"  {m:<7} {'with' if v is not None else 'without':<8} "
                    f"{got[v] or 0:>10,.1f} out tok/s"
                    + (f", {cpu[v]:.2f} CPU s" if cpu[v] else "")
                    + f" ({time.perf_counter() - t:.0f} s)")
            res[m]["without"].append(got[None])
            res[m]["with"].append(got[k])
            res[m]["cpu_s"]["without"].append(cpu[None])
            res[m]["cpu_s"]["with"].append(cpu[k])
            if got[None] and got[k]:
                res[m]["ratios"].append(got[k] / got[None])
            if cpu[None] and cpu[k] and got[None] and got[k]:  # the same tokens: CPU s without / with
                res[m]["cpu_ratios"].append(cpu[None] / cpu[k])
    for m in modes:
        for key, med in (("ratios", "median_ratio"), ("cpu_ratios", "median_cpu_ratio")):
            rs = res[m][key]
            res[m][med] = statistics.median(rs) if rs else None
    return res


def print_table(res: dict[str, Any], k, what: str = "logprobs", target: str = ">= 0.90") -> None:
    print(f"\nthroughput with {what} {k} / without, per round (output tok/s):")
    print(f"{'mode':<8} {'without':<36} {'with':<36} ratios (median)")
    for m, r in res.items():
        def fmt(xs):
            return " / ".join(f"{x:,.0f}" if x else "-" for x in xs)
        ratios = ", ".join(f"{x:.2f}" for x in r["ratios"])
        med = f"{r['median_ratio']:.3f}" if r["median_ratio"] is not None else "-"
        print(f"{m:<8} {fmt(r['without']):<36} {fmt(r['with']):<36} {ratios} ({med})")
        if r["cpu_ratios"]:
            cr = ", ".join(f"{x:.2f}" for x in r["cpu_ratios"])
            print(f"{'':<8} tok per CPU s, with / without: {cr} ({r['median_cpu_ratio']:.3f})")
        for e in r["errors"]:
            print(f"  {m}: {e}")
    print(f"target: {target}")


def run_compare(args, argv: list[str], work, runners, modes: list[str], result: dict) -> int:
    """``--logprobs-compare``: :func:`compare` over ``modes`` (each run in its own process unless
    ``--no-isolate``), written into ``result``'s JSON and printed."""
    one = argparse.Namespace(**{**vars(args), "repeat": 1})

    def run(mode: str, k: Optional[int]) -> dict:
        if args.isolate:
            return run_isolated(child_argv(argv, k), mode, 1)
        throughput_modes.LOGPROBS = k
        try:
            return runners[mode](one, work)
        except Exception as exc:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            return {"mode": mode, "error": repr(exc)}

    res = compare(modes, args.repeat, args.logprobs_compare, run)
    result["logprobs_compare"] = {"k": args.logprobs_compare, "rounds": args.repeat, "modes": res}
    common.write_json(args.out, result)
    print_table(res, args.logprobs_compare)
    print(f"wrote {args.out}")
    return 0


__all__ = ["child_argv", "compare", "print_table", "run_compare"]

"""``bench.throughput --deterministic-compare``: the same workload without and with deterministic
mode (``EngineConfig.deterministic``, docs/deterministic.md), alternated within each round, each
run in a fresh process (``--no-isolate``: in this one), and the ratio with/without per round and
its median -- the pairing of ``--logprobs-compare`` (bench/throughput_logprobs.py), whose
machinery this reuses. A run with the mode is ``--deterministic`` added to the run's own flags."""

from __future__ import annotations

import argparse
import traceback
from typing import Optional

from . import common
from .throughput_logprobs import compare, print_table
from .throughput_rounds import run_isolated


def child_argv(argv: list[str], on: bool) -> list[str]:
    """``argv`` without ``--deterministic-compare`` / ``--deterministic``, plus the latter if ``on``."""
    out = [a for a in argv if a not in ("--deterministic-compare", "--deterministic")]
    return out + (["--deterministic"] if on else [])


def run_compare(args, argv: list[str], work, runners, modes: list[str], result: dict) -> int:
    one = argparse.Namespace(**{**vars(args), "repeat": 1})
    base = dict(args.engine_config or {})

    def run(mode: str, on: Optional[int]) -> dict:
        if args.isolate:
            return run_isolated(child_argv(argv, on is not None), mode, 1)
        one.engine_config = {**base, "deterministic": on is not None}
        try:
            return runners[mode](one, work)
        except Exception as exc:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            return {"mode": mode, "error": repr(exc)}

    res = compare(modes, args.repeat, 1, run, what="deterministic mode")
    result["deterministic_compare"] = {"rounds": args.repeat, "modes": res}
    common.write_json(args.out, result)
    print_table(res, "on", what="deterministic mode", target="none set on CPU (docs/deterministic.md)")
    print(f"wrote {args.out}")
    return 0


__all__ = ["child_argv", "run_compare"]

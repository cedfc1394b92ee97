"""``bench.throughput``'s rounds: each mode in a process of its own, interleaved rounds merged
into one row per mode, and the ratios between modes (best, median, and paired within a round,
which cancels the load of a shared machine)."""

from __future__ import annotations

import statistics
import sys


def run_isolated(argv: list[str], mode: str, repeat: int) -> dict:
    """One mode's run(s) in a fresh ``python -m bench.throughput`` process; its result row."""
    import json
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="enginecore-bench-") as tmp:
        out = f"{tmp}/row.json"
        # argparse keeps the last value of a repeated option: these override the caller's
        cmd = [sys.executable, "-m", "bench.throughput", *argv, "--modes", mode, "--repeat",
               str(repeat), "--no-interleave", "--child", "--out", out]
        rc = subprocess.run(cmd).returncode
        try:
            with open(out) as f:
                rows = json.load(f)["modes"]
        except (OSError, ValueError, KeyError):
            rows = []
    if not rows:
        return {"mode": mode, "error": f"benchmark process exited {rc} without a result"}
    return rows[0]


def merge_rounds(rows: list[dict]) -> dict:
    """One row per mode from its interleaved rounds: the best run, with every run's figure."""
    ok = [r for r in rows if "output_tok_s" in r]
    if not ok:
        return rows[-1]
    best = dict(max(ok, key=lambda r: r["output_tok_s"] or 0))
    runs = [x for r in ok for x in r.get("runs_output_tok_s", [r["output_tok_s"]])]
    best["runs_output_tok_s"] = runs
    best["repeat"] = len(runs)
    best["median_output_tok_s"] = statistics.median(runs)
    return best


def ratios(result: dict) -> None:
    pairs = (("inproc", "bare"), ("ipc", "inproc"), ("ipc", "bare"), ("bare", "hf-generate"),
             ("bare", "hf-cb"), ("inproc", "hf-cb"))
    by = {r["mode"]: r.get("output_tok_s") for r in result["modes"]}
    result["ratios"] = {f"{a}/{b}": by[a] / by[b] for a, b in pairs if by.get(a) and by.get(b)}
    med = {r["mode"]: r.get("median_output_tok_s") for r in result["modes"]}
    result["ratios_of_medians"] = {f"{a}/{b}": med[a] / med[b] for a, b in pairs if med.get(a) and med.get(b)}
    # interleaved rounds: the ratio within each round (same machine load), then its median
    runs = {r["mode"]: r.get("runs_output_tok_s") for r in result["modes"]}
    paired = {}
    for a, b in pairs:
        ra, rb = runs.get(a), runs.get(b)
        if ra and rb and len(ra) == len(rb) and len(ra) > 1:
            paired[f"{a}/{b}"] = statistics.median(x / y for x, y in zip(ra, rb))
    result["ratios_paired_median"] = paired

"""SIGTERM -> exit of a real ``enginecore serve`` process: idle, and under load (streams draining).

    python -m bench.sigterm --device cpu [--runs 5]

Times are from ``kill(SIGTERM)`` to the process's exit, measured by the parent; the idle case is
the figure the shutdown issue targets (< 1 s after imports: the process is long past its
imports when the signal arrives). The loaded case also reports how many streams got their
terminal output.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import msgspec

from bench.common import add_common_args, engine_config, finish_common_args, print_table, progress, write_json


def _start(cfg, tmp: Path, drain_timeout: float):
    sock = tmp / "e.sock"
    log = open(tmp / "serve.log", "wb")
    cmd = [sys.executable, "-m", "entrypoints.cli", "serve", "--listen", f"unix://{sock}",
           "--drain-timeout", str(drain_timeout), "--config-json", msgspec.json.encode(cfg).decode()]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while b"enginecore.serve: serving " not in (tmp / "serve.log").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"serve did not start:\n{(tmp / 'serve.log').read_text()}")
        time.sleep(0.02)
    return proc, f"unix://{sock}", log


def idle_run(cfg) -> dict:
    with tempfile.TemporaryDirectory() as d:
        proc, _, log = _start(cfg, Path(d), 30)
        time.sleep(0.2)
        t = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(60)
        log.close()
        return {"case": "idle", "exit_code": code, "sigterm_to_exit_s": time.monotonic() - t}


async def _loaded(cfg, streams: int, max_tokens: int, drain_timeout: float) -> dict:
    from engine import SamplingParams
    from ipc import EngineClient

    with tempfile.TemporaryDirectory() as d:
        proc, address, log = _start(cfg, Path(d), drain_timeout)
        finished: dict[str, int] = {}
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async with EngineClient.connect(address) as c:

            async def one(i):
                async for out in c.generate([1 + (i + j) % 200 for j in range(16)], params):
                    if out.finished:
                        finished[out.finish_reason] = finished.get(out.finish_reason, 0) + 1

            async with anyio.create_task_group() as tg:
                for i in range(streams):
                    tg.start_soon(one, i)
                while (await c.health()).running < streams:
                    await anyio.sleep(0.01)
                t = time.monotonic()
                os.kill(proc.pid, signal.SIGTERM)
        code = await anyio.to_thread.run_sync(proc.wait, 120)
        log.close()
        return {"case": f"{streams} streams, drain-timeout {drain_timeout:g}s", "exit_code": code,
                "sigterm_to_exit_s": time.monotonic() - t, "terminal_outputs": dict(finished)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, default_cpu_model="random:tiny-llama")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=1500)
    a = finish_common_args(ap.parse_args(argv), "sigterm")
    cfg = engine_config(a)
    rows = []
    bar = progress(a.runs + 2, "sigterm", disable=a.no_progress)
    for _ in range(a.runs):
        rows.append(idle_run(cfg))
        bar.update(1)
    for dt in (1.0, 30.0):  # deadline hit vs streams finishing inside the grace period
        rows.append(anyio.run(_loaded, cfg, a.streams, a.max_tokens if dt == 1.0 else 64, dt))
        bar.update(1)
    bar.close()
    print_table(f"SIGTERM -> exit: {a.model} on {a.device}",
                [("case", "case", ""), ("exit_code", "exit", ""), ("sigterm_to_exit_s", "seconds", ".3f"),
                 ("terminal_outputs", "terminal outputs", "")], rows)
    idle = sorted(r["sigterm_to_exit_s"] for r in rows if r["case"] == "idle")
    print(f"idle: median {idle[len(idle) // 2]:.3f} s, max {idle[-1]:.3f} s over {len(idle)} runs")
    write_json(a.out, {"model": a.model, "device": a.device, "runs": rows})


if __name__ == "__main__":
    main()

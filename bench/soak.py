"""Soak: a mixed load of well-behaved clients with misbehaving ones alongside, for N minutes.

    python -m bench.soak --minutes 10 --good-clients 64 --out soak.json

Starts ``enginecore serve --http`` (the default model on CPU unless told otherwise) and runs
three phases: *before* (good clients only), *attack* (good clients plus every attacker) and
*after* (good clients only again). Good clients send short completions (streamed and not) and
retry what the server refuses with a retryable status (429/503 + Retry-After). Attackers, each
bounded in rate and count, send: hostile numbers (top_k 2**63, seeds, huge stop lists),
prompts of millions of characters, oversized bodies, unparseable JSON, slowloris connections
that never finish their headers, clients that vanish mid-stream, and on the engine's IPC socket:
bare connections that never say Hello, garbage frames and wrong tokens.

``--attacks http,slowloris`` runs only those attackers and ``--http-kinds huge_stop_ids`` only
those hostile bodies (to find which one grows a process).

Reported per phase: good requests served / refused (retryable) / failed / lost (no answer at
all), the engine's health, and the RSS, open fds and CPU seconds of the engine and frontend
processes. The *before* figures are the last sample of the before phase: after the good
clients' first requests, before the first attack.
Everything targets 127.0.0.1 and a private Unix socket only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx

from . import common
from .soak_attacks import (ATTACKS, DEFAULT_HTTP_KINDS, HTTP_KINDS, MODEL, Stats, attack_http, attack_ipc,
                           attack_slowloris, attack_vanishing, good_client)

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


async def sampler(base: str, pids: list[int], stats: Stats, stop: anyio.Event, every: float) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=5) as c:
        while not stop.is_set():
            try:
                health = (await c.get("/health")).status_code
            except (httpx.TimeoutException, httpx.TransportError):
                health = 0
            stats.samples.append({"t": time.monotonic(), "phase": stats.phase, "health": health,
                                  "rss_mb": {p: round(_rss_mb(p), 1) for p in pids},
                                  "fds": {p: _fds(p) for p in pids},
                                  "cpu_s": {p: round(_cpu_s(p), 2) for p in pids}})
            if health != 200:
                stats.add(f"health_{health}")
            with anyio.move_on_after(every):
                await stop.wait()


def _phase_summary(stats: Stats, phase: str, pids: list[int]) -> dict:
    rows = [s for s in stats.samples if s["phase"] == phase]
    out = {"counts": stats.counts.get(phase, {})}
    if rows:
        out["rss_mb_last"] = {str(p): rows[-1]["rss_mb"][p] for p in pids}
        out["rss_mb_max"] = {str(p): max(r["rss_mb"][p] for r in rows) for p in pids}
        out["fds_last"] = {str(p): rows[-1]["fds"][p] for p in pids}
        out["fds_max"] = {str(p): max(r["fds"][p] for r in rows) for p in pids}
        out["cpu_s_last"] = {str(p): rows[-1]["cpu_s"][p] for p in pids}
    return out


async def run(args) -> dict:
    port = _free_port()
    tmp = tempfile.mkdtemp(prefix="ec-soak-")
    sock = f"{tmp}/engine.sock"
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "entrypoints.cli", "serve", "--model", args.model, "--device", "cpu",
            "--listen", f"unix://{sock}", "--http", f"127.0.0.1:{port}",
            "--api-servers", str(args.api_servers), "--parent-pid", str(os.getpid()), *args.serve_arg]
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    from .common import wait_ready  # torch comes with it: not at module level

    stats = Stats()
    try:
        async with httpx.AsyncClient(base_url=base, timeout=5) as c:
            MODEL[0] = await wait_ready(c, proc, 180)
        pids = [proc.pid] + common.children(proc.pid)
        phases = [("before", args.calm_s, False), ("attack", args.minutes * 60, True),
                  ("after", args.calm_s, False)]
        async with anyio.create_task_group() as tg:
            stop_all = anyio.Event()
            for k in range(args.good_clients):
                tg.start_soon(good_client, base, stats, stop_all, k, args.request_timeout)
            tg.start_soon(sampler, base, pids, stats, stop_all, args.sample_s)
            for name, secs, attack in phases:
                stats.phase = name
                print(f"soak: phase {name} for {secs:.0f} s", flush=True)
                stop_attack = anyio.Event()
                if attack:
                    async with anyio.create_task_group() as atg:
                        if "http" in args.attacks:
                            atg.start_soon(attack_http, base, stats, stop_attack, args.attack_rate,
                                           args.http_kinds)
                        if "vanishing" in args.attacks:
                            atg.start_soon(attack_vanishing, base, stats, stop_attack)
                        if "slowloris" in args.attacks:
                            atg.start_soon(attack_slowloris, port, stats, stop_attack, args.slowloris)
                        if "ipc" in args.attacks:
                            atg.start_soon(attack_ipc, sock, stats, stop_attack, args.ipc_bare)
                        await anyio.sleep(secs)
                        stop_attack.set()
                        atg.cancel_scope.deadline = anyio.current_time() + 60
                else:
                    await anyio.sleep(secs)
            stop_all.set()
        result = {"phases": {p: _phase_summary(stats, p, pids) for p, _, _ in phases},
                  "pids": {"engine": proc.pid, "frontends": pids[1:]},
                  "engine_alive": proc.poll() is None, "args": vars(args)}
        proc.send_signal(signal.SIGTERM)
        result["exit_code"] = proc.wait(60)
        return result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _print(result: dict) -> None:
    print(f"\nsoak: engine exit code {result.get('exit_code')}; pids {result['pids']}")
    for name, ph in result["phases"].items():
        counts = ph["counts"]
        good = {k: v for k, v in counts.items() if not k.startswith("attack_")}
        print(f"  {name:7s} good: {good}")
        if name == "attack":
            print(f"          attacks: { {k: v for k, v in counts.items() if k.startswith('attack_')} }")
        print(f"          rss MB last {ph.get('rss_mb_last')}  max {ph.get('rss_mb_max')}")
        print(f"          fds last {ph.get('fds_last')}  max {ph.get('fds_max')}")
        print(f"          cpu s so far {ph.get('cpu_s_last')}")


def _names(allowed: tuple):
    """An argparse type: a comma-separated subset of ``allowed`` (empty: none)."""
    def parse(text: str) -> tuple:
        names = tuple(n for n in text.split(",") if n)
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {','.join(allowed)}")
        return names
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the attack phase")
    ap.add_argument("--calm-s", type=float, default=30.0, help="length of the before/after phases")
    ap.add_argument("--good-clients", type=int, default=64)
    ap.add_argument("--api-servers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attack-rate", type=float, default=2.0, help="hostile HTTP bodies per second")
    ap.add_argument("--attacks", type=_names(ATTACKS), default=ATTACKS,
                    help=f"comma-separated attackers to run (default all: {','.join(ATTACKS)})")
    ap.add_argument("--http-kinds", type=_names(HTTP_KINDS), default=DEFAULT_HTTP_KINDS,
                    help=f"the hostile bodies the http attacker sends, of {','.join(HTTP_KINDS)} "
                         f"(default all but many_prompts)")
    ap.add_argument("--slowloris", type=int, default=300)
    ap.add_argument("--ipc-bare", type=int, default=300)
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra serve flag (repeatable)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = anyio.run(run, args)
    _print(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    lost = sum(ph["counts"].get("lost", 0) for ph in result["phases"].values())
    return 0 if result["engine_alive"] and lost == 0 and result["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

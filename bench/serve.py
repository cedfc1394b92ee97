"""The HTTP server under load, against the in-process engine on the same workload.

    python -m bench.serve --device cpu                        # 256 requests at t=0 (cpu sizes)
    python -m bench.serve --device cuda                       # nano-vllm: 256 req, [100, 1024]
    python -m bench.serve --concurrency 1,8,64,256 --request-rate 32 --api-servers 4
    python -m bench.serve --workload chat --no-inproc

Starts the real ``enginecore serve --http`` itself (on a free loopback port, its engine built
from exactly the ``EngineConfig`` the in-process run uses, passed as ``--config-json``) and
drives it from ``--clients`` client processes (``bench/serve_client.py``: httpx streams,
msgspec JSON over pipes; no torch in them), so the client is not the bottleneck.

Workloads: ``nano`` (default) is ``bench.throughput``'s nano-vllm workload with the same
defaults -- token-id prompts of U[min, max] tokens, outputs of U[min, max] tokens, ``ignore_eos``,
temperature 0.6, ``random.seed``-seeded -- streamed as ``/v1/completions`` with ``logprobs: 0``
so that every token is counted; ``chat``: ``/v1/chat/completions``, one user message of U[min,
max] random words, the same output lengths, ``logprobs: true, top_logprobs: 0``.

Load: every value of ``--concurrency`` (default: all requests at once) is one point: at most
that many requests in flight (split evenly over the clients), each sent at its arrival time:
all at t=0, or Poisson at ``--request-rate`` requests a second. A short warm-up (``--warmup``
requests of 8 tokens) goes first; the server is started once for all points and rounds, so
both engines run with prefix caching off and, on a GPU, the same KV cache (``GPU_KV_GIB``).

Reported per point: out tok/s (tokens counted / t0 to the last response's end), TTFT, ITL and
end-to-end latency p50 / p90 / p99, errors (failed requests and any that ended other than by
length), and the CPU seconds of the server's API processes and of the clients. Beside it, the
in-process figure of the same workload (``bench.throughput --modes inproc`` in a fresh process,
with ``--logprobs 0`` as the HTTP requests ask) and the ratios at the burst point: out tok/s HTTP /
in-process, TTFT p50 HTTP / in-process. TTFT by hop (``bench/serve_hops.py``): the clients' TTFT
split at the response head, the server's histograms over each point (``/metrics`` scraped before
and after: API server TTFT and time to submit, the engine's queue, prefill and arrival offset), the
engine's same histograms over the in-process run. ``--rounds R`` repeats in-process then HTTP R
times (the machine's load changes: the median of the per-round ratios is the fairest figure). JSON
to ``bench/results/serve.json``; a plot of TTFT and ITL against concurrency beside it (PNG, when
matplotlib is installed). ``--spy DIR``: a py-spy profile (raw, the samples on CPU) of the engine process and every API
server process during each point.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import msgspec

from . import common, serve_hops, serve_report
from .serve_client import Done, Item, Job, Result, Start, poisson_offsets
from .throughput import CPU_DEFAULTS, CUDA_DEFAULTS

#: each engine's KV cache on a GPU unless --kv-cache-gib (the server's and the in-process run's
#: fit side by side on an 80 GB card with a 0.6B model's weights)
GPU_KV_GIB = 30.0
from .throughput_modes import engine_cfg
from .throughput_rounds import run_isolated

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force").split()


# -- the server ------------------------------------------------------------------------------------
def _cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0


def _is_frontend(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"entrypoints.http.frontend" in f.read()
    except OSError:
        return False


def _config_json(config) -> str:
    """``config`` as JSON with only the fields that differ from their defaults: an older
    server (``--server-root``) refuses fields it does not know, and needs only these."""
    import msgspec.structs

    out = {}
    for f in msgspec.structs.fields(config):
        value = getattr(config, f.name)
        default = f.default if f.default is not msgspec.NODEFAULT else (
            f.default_factory() if f.default_factory is not msgspec.NODEFAULT else msgspec.NODEFAULT)
        if default is msgspec.NODEFAULT or msgspec.to_builtins(value) != msgspec.to_builtins(default):
            out[f.encode_name] = value
    return msgspec.json.encode(out).decode()


class Server:
    """``enginecore serve --http 127.0.0.1:<free port>`` on ``config``, in its own session."""

    def __init__(self, config, args) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.tmp = tempfile.mkdtemp(prefix="ec-bench-serve-")
        self.argv = [sys.executable, "-m", "entrypoints.cli", "serve",
                     "--config-json", _config_json(config),
                     "--listen", f"unix://{self.tmp}/engine.sock", "--http", f"127.0.0.1:{self.port}",
                     "--parent-pid", str(os.getpid()), "--drain-timeout", "5", "--disable-log-stats",
                     *(["--api-servers", str(args.api_servers)] if args.api_servers else []),
                     *(["--threads", str(args.threads)] if args.threads else []), *args.serve_arg]
        self.log_path = Path(self.tmp) / "server.log"
        root = args.server_root or ROOT  # another checkout's server: an A/B against it
        # the tree first, then what the caller's path had (e.g. a site dir of carried wheels)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.frontends: list[int] = []

    def wait_ready(self, timeout: float) -> str:
        import anyio
        import httpx

        async def wait() -> str:
            async with httpx.AsyncClient(base_url=self.base_url, timeout=10) as c:
                return await common.wait_ready(c, self.proc, timeout)

        try:
            model = anyio.run(wait)
        except BaseException:
            print(self.log_tail(), file=sys.stderr)
            raise
        self.frontends = [p for p in common.children(self.proc.pid) if _is_frontend(p)]
        return model

    def cpu(self) -> tuple[float, float, float]:
        """CPU seconds so far: (engine process, API server processes, of which system)."""
        fe = [_cpu_s(p) for p in self.frontends]
        return sum(_cpu_s(self.proc.pid)), sum(u + s for u, s in fe), sum(s for _, s in fe)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return self.proc.returncode


# -- the workload ----------------------------------------------------------------------------------
def bodies(args, work: list[tuple[list[int], int]], model: str) -> list[bytes]:
    """One JSON body per request of ``work`` (prompt token ids, output length)."""
    common_fields = {"model": model, "temperature": args.temperature, "ignore_eos": True,
                     "stream": True, "stream_options": {"include_usage": True}}
    rng = random.Random(args.seed + 1)
    out = []
    for prompt, max_tokens in work:
        if args.workload == "chat":
            text = " ".join(rng.choice(WORDS) for _ in prompt)  # as many words as prompt tokens
            body = {**common_fields, "messages": [{"role": "user", "content": text}],
                    "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 0}
        else:
            body = {**common_fields, "prompt": prompt, "max_tokens": max_tokens, "logprobs": 0}
        out.append(msgspec.json.encode(body))
    return out


def _spy(server: "Server", out_dir: Optional[Path], tag: str) -> list[subprocess.Popen]:
    """py-spy on the engine process and on every API server process, one raw file each."""
    if out_dir is None:
        return []
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out_dir.mkdir(parents=True, exist_ok=True)
    named = [("engine", server.proc.pid)] + [(f"frontend{k}", p) for k, p in enumerate(server.frontends)]
    return [subprocess.Popen([exe, "record", "-r", "200", "-f", "raw", "--threads", "-o",
                              str(out_dir / f"{name}-{tag}.txt"), "--pid", str(pid)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in named]


def run_point(server: Server, args, payloads: list[bytes], offsets: list[float], concurrency: int,
              expected_tokens: int, tag: str = "") -> dict[str, Any]:
    """One load point: the requests spread over the client processes, sent from one start."""
    path = "/v1/chat/completions" if args.workload == "chat" else "/v1/completions"
    k = max(1, min(args.clients, concurrency, len(payloads)))
    shares = [concurrency // k + (w < concurrency % k) for w in range(k)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    workers = [subprocess.Popen([sys.executable, "-m", "bench.serve_client"], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(k)]
    try:
        for w, proc in enumerate(workers):
            items = [Item(i, msgspec.Raw(payloads[i]), offsets[i]) for i in range(w, len(payloads), k)]
            proc.stdin.write(msgspec.json.encode(Job(server.base_url, path, items, shares[w],
                                                     args.request_timeout, args.client)) + b"\n")
            proc.stdin.flush()
        for proc in workers:
            if json.loads(proc.stdout.readline() or b"{}").get("ready") is not True:
                raise RuntimeError("a client process did not start")
        spies = _spy(server, args.spy, tag) if tag else []
        metrics0 = serve_hops.scrape(server.base_url)  # the server's histograms before and after
        cpu0 = server.cpu()
        t0 = time.monotonic() + 0.05
        for proc in workers:
            proc.stdin.write(msgspec.json.encode(Start(t0)) + b"\n")
            proc.stdin.flush()
        results: list[Result] = []
        client_cpu = 0.0
        for proc in workers:
            for line in proc.stdout:
                if line.startswith(b'{"done"'):
                    client_cpu += msgspec.json.decode(line, type=Done).cpu_s
                else:
                    results.append(msgspec.json.decode(line, type=Result))
        cpu1 = server.cpu()
        metrics1 = serve_hops.scrape(server.base_url)
        for s in spies:
            s.send_signal(signal.SIGINT)
            s.wait(30)
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return serve_report.summarize(
        results, t0, expected_tokens, concurrency=concurrency, clients=k,
        engine_cpu_s=cpu1[0] - cpu0[0], frontend_cpu_s=cpu1[1] - cpu0[1],
        frontend_sys_s=cpu1[2] - cpu0[2], client_cpu_s=client_cpu,
        hops=serve_hops.http_hops(results, metrics0, metrics1, t0))


def run_inproc(args) -> dict[str, Any]:
    """``bench.throughput --modes inproc`` on the same workload and engine, in a fresh process."""
    argv = ["--device", args.device, "--model", args.model, "--dtype", args.dtype,
            "--seed", str(args.seed), "--num-requests", str(args.num_requests),
            "--min-input", str(args.min_input), "--max-input", str(args.max_input),
            "--min-output", str(args.min_output), "--max-output", str(args.max_output),
            "--max-model-len", str(args.max_model_len), "--temperature", str(args.temperature),
            "--warmup", str(args.warmup), "--logprobs", "0", "--no-progress",
            "--engine-config", json.dumps(args.engine_config)]
    for flag in ("threads", "max_num_seqs", "max_num_batched_tokens", "kv_cache_gib"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return run_isolated(argv, "inproc", 1)


def _int_list(text: str) -> list[int]:
    vals = [int(v) for v in text.split(",") if v.strip()]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of integers >= 1")
    return vals


def parse_args(argv: Optional[list[str]]):
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    common.add_common_args(ap, default_cpu_model="random:tiny-llama")
    ap.add_argument("--workload", choices=["nano", "chat"], default="nano")
    for name in ("num-requests", "min-input", "max-input", "min-output", "max-output"):
        ap.add_argument(f"--{name}", type=int, default=None, help="default: bench.throughput's")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--concurrency", type=_int_list, default=None, metavar="LIST",
                    help="comma list of concurrency limits, one point each (default: all requests)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="Poisson arrivals, requests a second (default inf: all at t=0)")
    ap.add_argument("--clients", type=int, default=min(12, max(2, (os.cpu_count() or 2) - 2)),
                    help="client processes (default: CPUs - 2, at least 2, at most 12)")
    ap.add_argument("--client", choices=["httpx", "raw"], default="raw",
                    help="how the clients read the streams: a plain HTTP/1.1 reader (default: "
                         "~1/3 of httpx's CPU per token, so that the clients take less of the "
                         "host the server is measured on), or httpx")
    ap.add_argument("--api-servers", type=int, default=None, help="default: the server's own")
    ap.add_argument("--serve-arg", action="append", default=[], help="more serve flags (repeatable)")
    ap.add_argument("--server-root", type=Path, default=None, metavar="DIR",
                    help="run the server from this source tree (e.g. an unpacked older commit: "
                         "before / after on the same machine); default: this one")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: max input + max output")
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests (8 tokens)")
    ap.add_argument("--rounds", type=int, default=1, help="in-process then HTTP, this many times")
    ap.add_argument("--inproc", action=argparse.BooleanOptionalAction, default=True,
                    help="run the in-process figure beside (nano workload only)")
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--plot", type=Path, default=None, help="default: the JSON path, .png")
    ap.add_argument("--spy", type=Path, default=None, metavar="DIR",
                    help="py-spy profiles of the engine and API server processes during each point")
    args = common.finish_common_args(ap.parse_args(argv), "serve")
    for k, v in (CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_model_len is None:
        args.max_model_len = args.max_input + args.max_output + 1
    # both engines alike: the in-process run starts beside the server's memory (a default KV
    # cache, 40 % of free memory, is smaller there); one server gets the warm-up and every
    # round (its prefix cache answered round 2's: TTFT p50 101 ms against ~450, measured)
    if args.device == "cuda" and args.kv_cache_gib is None:
        args.kv_cache_gib = GPU_KV_GIB
    args.engine_config = {"enable_prefix_caching": False, **args.engine_config}
    if args.concurrency is None:
        args.concurrency = [args.num_requests]
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    from engine.loader.checkpoint import resolve_source

    cfg, _, _ = resolve_source(args.model)
    work = common.nano_vllm_workload(args.num_requests, args.min_input, args.max_input,
                                     args.min_output, args.max_output, cfg.vocab_size, args.seed)
    expected = sum(o for _, o in work)
    config = engine_cfg(args)
    result: dict[str, Any] = {
        "benchmark": "serve",
        "command": " ".join(["python -m bench.serve"] + (argv if argv is not None else sys.argv[1:])),
        "environment": common.environment(args.device),
        "workload": {"kind": args.workload, "model": args.model, "dtype": args.dtype,
                     "device": args.device, "num_requests": args.num_requests,
                     "input_len": [args.min_input, args.max_input],
                     "output_len": [args.min_output, args.max_output], "temperature": args.temperature,
                     "request_rate": args.request_rate, "ignore_eos": True, "seed": args.seed,
                     "prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": expected},
        "engine_config": msgspec.to_builtins(config), "clients": args.clients, "client": args.client,
        "rounds": [], "notes": []}
    inproc = args.inproc and args.workload == "nano"
    if args.inproc and not inproc:
        result["notes"].append("no in-process figure for the chat workload (it has no token-id twin)")
    offsets = poisson_offsets(args.num_requests, args.request_rate, args.seed)
    print(f"serve: {args.workload} workload, {args.model} {args.dtype} on {args.device}; "
          f"{args.num_requests} requests ({result['workload']['prompt_tokens']} prompt + {expected} "
          f"output tokens), concurrency {args.concurrency}, rate {args.request_rate}/s, "
          f"{args.clients} client processes", flush=True)
    server = Server(config, args)
    try:
        model = server.wait_ready(args.ready_timeout)
        result["server"] = {"argv": server.argv[2:], "api_servers": len(server.frontends),
                            "api_servers_label": f"{len(server.frontends)} API server"
                                                 + ("s" if len(server.frontends) != 1 else "")}
        payloads = bodies(args, work, model)
        if args.warmup:
            warm = bodies(args, [(p, min(o, 8)) for p, o in work[:args.warmup]], model)
            run_point(server, args, warm, [0.0] * len(warm), len(warm), 0)
        for r in range(args.rounds):
            rnd: dict[str, Any] = {"points": []}
            if inproc:
                print(f"[round {r + 1}/{args.rounds}] in-process", file=sys.stderr, flush=True)
                rnd["inproc"] = run_inproc(args)
            for c in args.concurrency:
                print(f"[round {r + 1}/{args.rounds}] HTTP, concurrency {c}", file=sys.stderr, flush=True)
                rnd["points"].append(run_point(server, args, payloads, offsets, c, expected,
                                               tag=f"r{r + 1}-c{c}"))
            burst = [p for p in rnd["points"] if p["concurrency"] >= args.num_requests]
            if burst and math.isinf(args.request_rate):
                rnd["ratios"] = serve_report.burst_ratios(burst[0], rnd.get("inproc"))
            result["rounds"].append(rnd)
            common.write_json(args.out, result)
    finally:
        result["server_exit_code"] = server.stop()
    result["ratios_median"] = serve_report.median_ratios(result["rounds"])
    note = serve_report.plot(result, args.plot or Path(args.out).with_suffix(".png"))
    if note:
        result["notes"].append(note)
    common.write_json(args.out, result)
    print()
    serve_report.report(result)
    serve_hops.report(result)
    print(f"wrote {args.out}")
    failed = any(p["errors"] for rnd in result["rounds"] for p in rnd["points"])
    return 1 if failed or result["server_exit_code"] not in (0, None) else 0


if __name__ == "__main__":
    raise SystemExit(main())

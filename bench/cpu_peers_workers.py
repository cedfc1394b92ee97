"""``bench.cpu_peers``'s workers, one engine each: enginecore (in-process, HTTP), llama.cpp, transformers."""

# Only the standard library at module level: the llama.cpp worker runs under its venv's Python,
# which has no torch.

from __future__ import annotations

import json
import statistics
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prompt_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, vocab - 200) for _ in range(n)]


def single_requests(a) -> list[tuple[str, list[int], int]]:
    """The one-at-a-time requests of an engine row, in order: ``a.repeats`` 64-token streams
    (the 1-stream rate), then ``a.repeats`` one-token requests per prompt length (TTFT); other
    prompts each time, so that no engine reuses a cached prompt."""
    reqs = [("decode", prompt_ids(16, 1 + 1000 * r), a.tokens) for r in range(a.repeats)]
    for plen in (20, 128, 1000):
        reqs += [(f"ttft_{plen}", prompt_ids(plen, plen + 1000 * r), 1) for r in range(a.repeats)]
    return reqs


def single_figures(reqs, results, out: dict) -> None:
    """The medians of :func:`single_requests`' ``results`` ((t0, first, last, tokens) each)."""
    rates = [(n - 1) / (last - first) for (k, _, _), (_, first, last, n) in zip(reqs, results)
             if k == "decode"]
    out["decode_1_tok_s"] = statistics.median(rates)
    out["decode_1_tok_s_each"] = rates
    for plen in (20, 128, 1000):
        out[f"ttft_{plen}_ms"] = statistics.median(
            (first - t0) * 1e3 for (k, _, _), (t0, first, _, _) in zip(reqs, results)
            if k == f"ttft_{plen}")


# -- workers: one engine, one process; print one JSON line --------------------------------------
async def measure(stream, a, out: dict) -> None:
    """The figures of an engine row, from ``stream(prompt ids, max tokens) -> (t0, first token
    time, last token time, tokens)``: 1-stream decode, TTFT of 128 and 1,000 tokens, the
    aggregate of ``a.streams`` concurrent streams, and with ``a.busy`` 1-stream decode beside a
    spinning process."""
    import anyio

    await stream(prompt_ids(16, 0), 8)  # warm-up
    reqs = single_requests(a)
    single_figures(reqs, [await stream(ids, n) for _, ids, n in reqs], out)
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


def _free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to a server started in its own session; its process group killed after ``grace``."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


def work_enginecore_http(a) -> dict:
    """``enginecore serve --http`` in its own process group; streamed /v1/completions with the
    prompt as token ids (what benchmark clients send), timed at each SSE chunk."""
    import anyio
    import httpx

    from bench.common import wait_ready

    port = _free_port()
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
        _stop(proc, 60)  # SIGTERM: the server drains and exits
    return out


def work_llamacpp_server(a) -> dict:
    """llama.cpp's ``llama-server`` (32 slots, continuous batching; its own process group);
    streamed ``/completion`` with the prompt as token ids, greedy, EOS ignored, no prompt cache,
    timed at each SSE chunk (one a token)."""
    import tempfile

    import anyio
    import httpx

    from bench.common import wait_http

    port = _free_port()
    slots = max(32, *a.streams)
    exe = Path(a.llama_server_build) / "bin" / "llama-server"
    argv = [str(exe), "-m", a.gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(a.threads),
            "-tb", str(a.threads), "-np", str(slots), "-c", str(slots * 1088), "-cb", "--no-webui"]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    out: dict = {}

    async def stream(c, ids, n):
        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "stream": True,
                "ignore_eos": True, "cache_prompt": False}
        t0, first, last, count = time.perf_counter(), None, None, 0
        async with c.stream("POST", "/completion", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("stop"):
                    continue
                now = time.perf_counter()
                first = now if first is None else first
                last, count = now, count + 1
        return t0, first, last, count

    async def main():
        t = time.perf_counter()
        # a connection a request: llama-server may close a kept-alive connection after a
        # stream, and the next request on it then fails ("Server disconnected")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as c:
            await wait_http(c, proc, 300, "/health", "llama-server")
            out["load_s"] = time.perf_counter() - t
            out["rss_after_load_mib"] = _tree_rss_mib(proc.pid)
            await measure(lambda ids, n: stream(c, ids, n), a, out)

    try:
        anyio.run(main)
    except Exception:
        log.seek(0)
        print(log.read()[-3000:].decode(errors="replace"), file=sys.stderr)  # the server's own words
        raise
    finally:
        _stop(proc, 30)
        log.close()
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
    reqs = single_requests(a)
    single_figures(reqs, [stream(ids, n) for _, ids, n in reqs], out)
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
    for plen in (20, 128, 1000):
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
           "llamacpp_server": work_llamacpp_server,
           "llamacpp": work_llamacpp, "llamacpp_native": work_llamacpp, "hf": work_hf}

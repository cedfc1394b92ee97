"""Shared helpers for the benchmarks: devices and timing, memory figures, progress bars, tables,
workloads and JSON results. Works on torch 2.11 (the lent GPU) and 2.13 (CPU machines)."""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# -- arguments -----------------------------------------------------------------------------------
def add_common_args(ap: argparse.ArgumentParser, *, default_cpu_model: str,
                    default_cuda_model: str = "random:qwen3-0.6b") -> None:
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default=None,
                    help=f"engine model spec (default: {default_cpu_model} on cpu, {default_cuda_model} on cuda)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: fp32 on cpu, bf16 on cuda)")
    ap.add_argument("--seed", type=int, default=0, help="workload and random-weights seed")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default 1 on cpu; the torch default on cuda)")
    ap.add_argument("--out", type=Path, default=None, help="JSON result path")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--engine-config", type=json.loads, default={}, metavar="JSON",
                    help='extra EngineConfig fields, e.g. \'{"max_num_batched_tokens": 4096}\'')
    ap.set_defaults(_default_cpu_model=default_cpu_model, _default_cuda_model=default_cuda_model)


def _terminate(signum, frame):  # pragma: no cover - signal path
    raise KeyboardInterrupt(f"signal {signum}")


def finish_common_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    # A benchmark is a process entry point: SIGTERM (e.g. from `timeout`) and SIGINT unwind like
    # Ctrl-C, so engines drain and spawned engine processes are shut down on the way out.
    import signal

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch.cuda.is_available() is False")
    if args.model is None:
        args.model = args._default_cuda_model if args.device == "cuda" else args._default_cpu_model
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.out is None:
        args.out = RESULTS_DIR / f"{name}.json"
    if args.threads is None and args.device == "cpu":
        # One intra-op thread: on small shared CPU boxes, OpenMP workers spin against the event
        # loop thread and other processes and make step times erratic (10x and worse, measured).
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
        # the same for child processes (the IPC mode's engine process reads these at start)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    return args


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[name]


# -- timing ----------------------------------------------------------------------------------------
def sync(device) -> None:
    """Wait for the device (no-op on cpu)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def now() -> float:
    return time.perf_counter()


class DeviceTimer:
    """Seconds for a region: CUDA events on cuda (after a synchronize), perf_counter on cpu."""

    def __init__(self, device):
        self.device = torch.device(device)

    def __enter__(self) -> "DeviceTimer":
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0


def cpu_times() -> Optional[list[int]]:
    """The machine's CPU time counters (``/proc/stat``'s ``cpu`` line, in ticks; None off Linux)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(before: Optional[list[int]], after: Optional[list[int]]) -> Optional[float]:
    """Of the CPU time between two :func:`cpu_times`, the share the hypervisor gave to other
    guests (``steal``, the 8th field): a noisy virtual host's mark on a timed run."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    return (after[7] - before[7]) / total if total > 0 else None


def thread_times() -> dict[str, tuple[int, int, int, int]]:
    """Every thread of this process (Linux; else empty): name -> (ns on a CPU, ns runnable but
    waiting for one, voluntary and involuntary context switches), from ``/proc/self/task``.
    Python threads are named by ``threading`` (their ``native_id``), the rest ``comm:tid``.

    Where a host-bound step's wall time goes: a thread's CPU time against the wall says how
    much of it the thread ran; its voluntary switches count the times it blocked (the GIL, a
    condition, the device)."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, tuple[int, int, int, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            base = f"/proc/self/task/{tid}/"
            with open(base + "schedstat") as f:
                run, wait = (int(x) for x in f.read().split()[:2])
            with open(base + "status") as f:
                ctx = {k: int(v) for k, _, v in (line.partition(":") for line in f)
                       if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}
            with open(base + "comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError):
            continue
        name = names.get(int(tid), f"{comm}:{tid}")
        out[name] = (run, wait, ctx.get("voluntary_ctxt_switches", 0),
                     ctx.get("nonvoluntary_ctxt_switches", 0))
    return out


def thread_deltas(before: dict, after: dict, per: float, min_ms: float = 0.01) -> dict[str, dict]:
    """:func:`thread_times` between two readings, per ``per`` (e.g. a run's steps): ms on a CPU,
    ms waiting for one, switches; threads below ``min_ms`` a ``per`` left out."""
    out = {}
    for name, b in after.items():
        a = before.get(name, (0, 0, 0, 0))
        run = (b[0] - a[0]) / 1e6 / per
        if run >= min_ms:
            out[name] = {"cpu_ms": run, "runq_ms": (b[1] - a[1]) / 1e6 / per,
                         "vol_switches": (b[2] - a[2]) / per, "invol_switches": (b[3] - a[3]) / per}
    return out


def percentile(values: Sequence[float], p: float) -> Optional[float]:
    """Linear-interpolated percentile (p in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median_run(runs: Sequence[dict], key: str, also: Sequence[str] = ()) -> dict:
    """Of one mode's interleaved rounds (a bench's ``--rounds``): a copy of the run with the
    median ``key`` (the lower middle one of an even count; None sorts as 0), with every run's
    ``key`` and ``also`` values beside it as ``<field>_by_round`` when there are several."""
    ranked = sorted(runs, key=lambda r: r[key] if r[key] is not None else 0)
    out = dict(ranked[(len(ranked) - 1) // 2])
    if len(runs) > 1:
        for field in (key, *also):
            out[f"{field}_by_round"] = [r[field] for r in runs]
    return out


# -- memory ----------------------------------------------------------------------------------------
def rss_bytes() -> int:
    try:
        import psutil  # optional

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # peak, not current


def memory_snapshot(device, collect: bool = True) -> dict[str, Any]:
    """Device memory now. cuda: allocated/reserved (+ free/total from the driver); cpu: RSS."""
    dev = torch.device(device)
    if collect:
        gc.collect()
    if dev.type == "cuda":
        sync(dev)
        if collect:
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        return {"allocated": int(torch.cuda.memory_allocated(dev)),
                "reserved": int(torch.cuda.memory_reserved(dev)),
                "driver_used": int(total - free), "rss": rss_bytes()}
    snap = {"rss": rss_bytes()}
    if collect and malloc_trim():
        snap["rss_trimmed"] = rss_bytes()
    anon = _proc_status("RssAnon")
    if anon is not None:
        snap["rss_anon"] = anon  # heap/anonymous pages only: no shared-library code pages
    return snap


def _proc_status(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def malloc_trim() -> bool:
    """Give glibc's free heap pages back to the OS (so RSS shows what is still held). False if
    not glibc."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def primary_memory(snapshot: dict[str, Any]) -> int:
    """The one figure to compare: allocated on cuda; on cpu anonymous RSS after malloc_trim
    (file-backed library pages, which the first model run touches once, excluded)."""
    if "allocated" in snapshot:
        return snapshot["allocated"]
    return snapshot.get("rss_anon", snapshot.get("rss_trimmed", snapshot["rss"]))


def mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


# -- environment -----------------------------------------------------------------------------------
def environment(device) -> dict[str, Any]:
    dev = torch.device(device)
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "device": str(dev), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    if dev.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def write_json(path: Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


# -- progress --------------------------------------------------------------------------------------
class _SimpleBar:
    """A minimal stderr progress bar for machines without tqdm."""

    def __init__(self, total: Optional[int], desc: str, unit: str, disable: bool):
        self.total, self.desc, self.unit, self.disable = total, desc, unit, disable
        self.n = 0
        self._t0 = time.perf_counter()
        self._last = 0.0

    def update(self, k: int = 1) -> None:
        self.n += k
        t = time.perf_counter()
        if not self.disable and (t - self._last >= 0.25 or (self.total and self.n >= self.total)):
            self._last = t
            self._draw(t)

    def _draw(self, t: float) -> None:
        rate = self.n / max(t - self._t0, 1e-9)
        if self.total:
            frac = min(1.0, self.n / self.total)
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r{self.desc}: {frac:4.0%} |{bar:<30}| {self.n}/{self.total} "
                             f"[{t - self._t0:5.1f}s, {rate:,.0f} {self.unit}/s]")
        else:
            sys.stderr.write(f"\r{self.desc}: {self.n} [{t - self._t0:5.1f}s, {rate:,.0f} {self.unit}/s]")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.disable:
            self._draw(time.perf_counter())
            sys.stderr.write("\n")
            sys.stderr.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def progress(total: Optional[int], desc: str, unit: str = "it", disable: bool = False):
    """tqdm on stderr when installed, else a simple bar. Use as a context manager; ``.update(k)``."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, disable=disable, file=sys.stderr,
                    dynamic_ncols=True, mininterval=0.25, leave=True)
    except ImportError:
        return _SimpleBar(total, desc, unit, disable)


# -- tables ----------------------------------------------------------------------------------------
def fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and spec:
        return format(v, spec)
    return str(v)


def print_table(title: str, columns: Sequence[tuple[str, str, str]], rows: Iterable[dict]) -> str:
    """columns: (key, header, format spec). Prints and returns the table text."""
    rows = list(rows)
    cells = [[fmt(r.get(k), spec) for k, _, spec in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, (_, h, _) in enumerate(columns)]
    lines = [title]
    head = "  ".join(h.rjust(w) if i else h.ljust(w) for i, ((_, h, _), w) in enumerate(zip(columns, widths)))
    lines += [head, "-" * len(head)]
    for c in cells:
        lines.append("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(c, widths))))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


# -- workload --------------------------------------------------------------------------------------
def nano_vllm_workload(num_requests: int, min_input: int, max_input: int, min_output: int,
                       max_output: int, vocab_size: int, seed: int = 0,
                       max_token_id: int = 10000) -> list[tuple[list[int], int]]:
    """The nano-vllm bench workload: ``random.seed(seed)``; prompts of ``randint(min_input,
    max_input)`` token ids drawn from ``randint(0, max_token_id)``; then output lengths
    ``randint(min_output, max_output)`` (with nano-vllm's defaults 256 / [100, 1024] / [100, 1024]
    / 10000 this is its exact prompt set). Ids are capped below ``vocab_size`` for small presets."""
    rng = random.Random(seed)
    hi = min(max_token_id, vocab_size - 1)
    prompts = [[rng.randint(0, hi) for _ in range(rng.randint(min_input, max_input))]
               for _ in range(num_requests)]
    outputs = [rng.randint(min_output, max_output) for _ in range(num_requests)]
    return list(zip(prompts, outputs))


async def wait_ready(client, proc, timeout: float) -> str:
    """Poll ``enginecore serve``'s ``/ready`` through ``client`` (an ``httpx.AsyncClient`` on
    its base URL) until it answers 200, failing if ``proc`` exits or ``timeout`` seconds pass;
    returns the served model's id (``/v1/models``)."""
    import anyio
    import httpx

    with anyio.fail_after(timeout):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}")
            try:
                if (await client.get("/ready")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await anyio.sleep(0.2)
    return (await client.get("/v1/models")).json()["data"][0]["id"]


def engine_config(args, **overrides):
    """An EngineConfig for ``args`` (model/device/dtype/seed) plus ``overrides``."""
    from engine import EngineConfig

    kw = dict(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    kw.update({k: v for k, v in overrides.items() if v is not None})
    kw.update(getattr(args, "engine_config", None) or {})
    return EngineConfig(**kw)

"""Shared helpers for the benchmarks: arguments, devices and timing, statistics, progress bars,
tables, workloads and JSON results (CPU and memory figures: ``bench/resources.py``). Works on
torch 2.11 (the lent GPU) and 2.13 (CPU machines)."""

from __future__ import annotations

import argparse
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


# -- statistics ------------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc), sorted."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):  # gone meanwhile
                pass
    return sorted(out)


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


async def wait_http(client, proc, timeout: float, path: str, what: str) -> None:
    """Poll ``path`` through ``client`` (an ``httpx.AsyncClient`` on the server's base URL)
    until it answers 200, failing if ``proc`` (the server, ``what``) exits or ``timeout``
    seconds pass."""
    import anyio
    import httpx

    with anyio.fail_after(timeout):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}")
            try:
                if (await client.get(path)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await anyio.sleep(0.2)


async def wait_ready(client, proc, timeout: float) -> str:
    """``enginecore serve``'s ``/ready`` (:func:`wait_http`); returns the served model's id
    (``/v1/models``)."""
    await wait_http(client, proc, timeout, "/ready", "serve")
    return (await client.get("/v1/models")).json()["data"][0]["id"]


def models_and_results(args, cuda_models: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """The models a multi-model benchmark runs (``--models``; on cuda with the default model:
    ``cuda_models``) and its results' head (environment, arguments, an empty ``models`` list);
    on cuda the device context is created first (it is not the engine's)."""
    if getattr(args, "models", None):
        models = args.models.split(",")
    elif args.device == "cuda" and args.model == args._default_cuda_model:
        models = list(cuda_models)
    else:
        models = [args.model]
    if args.device == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")
    return models, {"environment": environment(args.device), "args": {
        k: v for k, v in vars(args).items() if not k.startswith("_") and k != "out"}, "models": []}


def engine_config(args, **overrides):
    """An EngineConfig for ``args`` (model/device/dtype/seed) plus ``overrides``."""
    from engine import EngineConfig

    kw = dict(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed)
    kw.update({k: v for k, v in overrides.items() if v is not None})
    kw.update(getattr(args, "engine_config", None) or {})
    return EngineConfig(**kw)

"""A run's use of the machine: CPU time and steal, per-thread scheduling, host and device memory."""

from __future__ import annotations

import gc
import os
from typing import Any, Optional

import torch

from .common import sync


# -- CPU -------------------------------------------------------------------------------------------
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

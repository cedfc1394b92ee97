"""How many CPUs this process may use, and the intra-op thread count that follows from it.

``cpu_budget()`` reads the process's CPU affinity (``os.sched_getaffinity``) and the cgroup CPU
quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) -- not ``os.cpu_count()``,
which counts the host's CPUs even in a container limited to two. ``choose_threads()`` turns an
explicit ``--threads``, ``$OMP_NUM_THREADS`` or the budget into a count and says which it used.

The default leaves one CPU of the budget to the event loop, the IPC sender, the step thread's own
Python and the neighbours: OpenMP workers that spin at their barriers while another process holds
a core stall every op. Measured on the 2-core box with a compile job beside it (default GGUF,
decode step, batch 1 / batch 8): 1 thread 116 / 590 ms median, 2 threads 1,313 / 6,072 ms.

Setting torch's thread count is process-wide state, so only an entry point calls
:func:`apply_threads` (``entrypoints/cli.py``); importing the library changes nothing.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Optional

log = logging.getLogger("enginecore.threads")

_CGROUP = Path("/sys/fs/cgroup")


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _own_cgroup_dirs(root: Path) -> list[Path]:
    """The process's cgroup directories (v2 unified path, v1 cpu controller), then the root."""
    dirs: list[Path] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[2].startswith("/"):
            rel = parts[2].lstrip("/")
            if parts[1] == "":
                dirs.append(root / rel)
            elif "cpu" in parts[1].split(","):
                dirs += [root / parts[1] / rel, root / "cpu" / rel, root / "cpu,cpuacct" / rel]
    return dirs + [root, root / "cpu", root / "cpu,cpuacct"]


def cgroup_cpu_quota(root: Path = _CGROUP) -> Optional[float]:
    """CPUs the cgroup quota allows (e.g. 1.5), or None when there is no quota."""
    for d in _own_cgroup_dirs(root):
        try:
            fields = (d / "cpu.max").read_text().split()
            if fields and fields[0] != "max":
                return int(fields[0]) / int(fields[1] if len(fields) > 1 else 100_000)
            if fields:
                return None
        except (OSError, ValueError, ZeroDivisionError):
            pass
        try:
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
            return quota / period if quota > 0 and period > 0 else None
        except (OSError, ValueError):
            pass
    return None


def default_threads(cpus: int) -> int:
    """Intra-op threads for a budget of ``cpus``: all but one (at least one)."""
    return max(1, cpus - 1)


def cpu_budget() -> tuple[int, str]:
    """``(cpus, why)``: the CPUs this process may run on, the smaller of affinity and quota."""
    cpus, why = _affinity(), "sched_getaffinity"
    quota = cgroup_cpu_quota()
    if quota is not None and math.ceil(quota) < cpus:
        cpus, why = max(1, math.ceil(quota)), f"cgroup CPU quota {quota:g}"
    return cpus, f"{why} ({cpus} CPU{'s' if cpus != 1 else ''})"


def choose_threads(explicit: Optional[int] = None, environ=os.environ) -> tuple[int, str]:
    """``(threads, why)``: ``explicit`` (``--threads``), else ``$OMP_NUM_THREADS``, else the
    CPU budget less one (:func:`default_threads`). Raises ``ValueError`` for a count below 1."""
    if explicit is not None:
        if explicit < 1:
            raise ValueError("--threads must be >= 1")
        return explicit, "--threads"
    env = environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env), "$OMP_NUM_THREADS"
    cpus, why = cpu_budget()
    return default_threads(cpus), f"{why} less one for the event loop and neighbours"


def apply_threads(explicit: Optional[int] = None) -> int:
    """Entry points only: set torch's intra-op threads (and ``$OMP_NUM_THREADS`` for child
    processes) to :func:`choose_threads`, and log which and why."""
    import torch

    n, why = choose_threads(explicit)
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    log.info("intra-op threads: %d (from %s)", n, why)
    return n


__all__ = ["cpu_budget", "default_threads", "cgroup_cpu_quota", "choose_threads", "apply_threads"]

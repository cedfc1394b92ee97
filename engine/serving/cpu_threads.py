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


def adaptive_ceiling(environ=os.environ) -> Optional[int]:
    """Entry points: the ceiling for a :class:`ThreadGovernor` when the thread count is the
    default one (no ``$OMP_NUM_THREADS``) and the budget is the process's affinity (a cgroup
    quota would let other processes' use of the same CPUs be counted wrongly): all of it."""
    if environ.get("OMP_NUM_THREADS", "").strip() or cgroup_cpu_quota() is not None:
        return None
    cpus = _affinity()
    return cpus if cpus > 1 else None


class ThreadGovernor:
    """Intra-op threads that follow the machine, between 1 and ``ceiling``.

    Before each CPU step (on the thread that runs it), at most every ``period`` seconds, it
    reads how busy the CPUs this process may run on were (``/proc/stat``) less this process's
    own CPU time (``/proc/self/stat``): the CPUs' worth other processes used since the last
    reading. Threads = the CPUs they left free, rounded (at most ``ceiling``, at least 1): down
    at once, up after two readings in a row agree.

    Why: OpenMP workers wait for each other at every op's end, so a worker whose core another
    process holds stalls the whole step. On the 2-core box two threads made a quiet 1-stream
    decode 1.5x faster than one (83 against 54 tok/s) but fell to 4-7 tok/s beside
    one busy process, where one thread keeps ~50 (engine/serving/cpu_threads.py's module note).

    Setting torch's thread count is process-wide state: the governor runs only when the engine
    is configured for it (``EngineConfig.cpu_threads_max``), which entry points do for the
    default thread count (:func:`adaptive_ceiling`).
    """

    def __init__(self, ceiling: int, *, period: float = 0.1, cpus: Optional[list[int]] = None,
                 clock=None, read=None, set_threads=None, threads: Optional[int] = None):
        import time

        import torch

        self.ceiling = max(1, ceiling)
        self.period = period
        if cpus is None:
            try:
                cpus = sorted(os.sched_getaffinity(0))
            except (AttributeError, OSError):  # pragma: no cover - not Linux
                cpus = list(range(os.cpu_count() or 1))
        self.cpus = cpus
        self._clock = clock or time.monotonic
        self._read = read or _busy_and_own_ticks
        self._set = set_threads or torch.set_num_threads
        self.threads = threads if threads is not None else torch.get_num_threads()
        self._last: Optional[tuple[float, int, int]] = None
        self._up = 0  # readings in a row that asked for more threads
        self.changes = 0
        self.others = 0.0  # CPUs' worth other processes used, at the last reading

    def tick(self) -> int:
        """Read the machine if ``period`` has passed; set the thread count it asks for."""
        now = self._clock()
        last = self._last
        if last is not None and now - last[0] < self.period:
            return self.threads
        reading = self._read(self.cpus)
        if reading is None:  # no /proc: leave the count alone
            return self.threads
        busy, own = reading
        self._last = (now, busy, own)
        if last is None:
            return self.threads
        ticks = (now - last[0]) * _CLK_TCK
        self.others = max(0.0, ((busy - last[1]) - (own - last[2])) / ticks) if ticks > 0 else 0.0
        want = max(1, min(self.ceiling, int(len(self.cpus) - self.others + 0.5)))
        if want < self.threads:
            self._apply(want)
        elif want > self.threads:
            self._up += 1
            if self._up >= 2:
                self._apply(want)
        else:
            self._up = 0
        return self.threads

    def _apply(self, n: int) -> None:
        log.info("intra-op threads %d -> %d (other processes used %.2f of %d CPUs)",
                 self.threads, n, self.others, len(self.cpus))
        self._set(n)
        self.threads = n
        self._up = 0
        self.changes += 1


def governed(step, ceiling: Optional[int]):
    """``step`` itself, or with a ``ceiling`` (``EngineConfig.cpu_threads_max``) ``step`` with a
    :class:`ThreadGovernor` ticked before each call (on the thread that runs the steps)."""
    if ceiling is None:
        return step
    governor = ThreadGovernor(ceiling)

    def governed_step():
        governor.tick()
        return step()

    return governed_step


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_and_own_ticks(cpus: list[int]) -> Optional[tuple[int, int]]:
    """(busy ticks of ``cpus`` from /proc/stat, this process's user + system ticks)."""
    try:
        want = {f"cpu{c}" for c in cpus}
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if name in want:
                    v = [int(x) for x in rest.split()]
                    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
                    busy += sum(v[:3]) + sum(v[5:8])
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        own = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        return busy, own
    except (OSError, ValueError, IndexError):
        return None


__all__ = ["cpu_budget", "default_threads", "cgroup_cpu_quota", "choose_threads", "apply_threads",
           "adaptive_ceiling", "ThreadGovernor", "governed"]

"""glibc malloc setting for the ``enginecore`` process. Process-wide, so only its entry point
(entrypoints/cli.py) calls :func:`tune_malloc`, never the library.

NOTE: written by hand because no library does it: one ``mallopt(M_TOP_PAD)`` call through ctypes.
Why: each step allocates and frees large temporaries (logits, a prefill chunk's activations) on
the step thread's malloc arena. With glibc's defaults a fresh process, by all signs, keeps
trimming the arena's free top and faulting it back in: measured on the 2-core CPU machine
(bench.throughput, IPC mode, random:tiny-llama), the engine process's step thread took 160k-250k
minor page faults per run against 8.5k for the same steps in the long-lived benchmark process,
and its steps took 5-15% longer. A 64 MiB top pad (kept when trimming) brought it to 6.7k
faults. glibc's dynamic mmap threshold stays on (setting ``M_TRIM_THRESHOLD`` or
``M_MMAP_THRESHOLD`` turns it off, and either alone made it 700k faults). The cost: up to 64 MiB
of free memory kept per arena until the process exits.
Not a general setting: in a process that first ran steps on its *main* thread (the benchmark's
bare loop) and then on a worker thread, the same pad made the worker's steps fault 718k times.
The CLI's engine always steps on a worker thread, which is the case measured above.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("enginecore.malloc")

M_TOP_PAD = -2  # mallopt parameter number from glibc's <malloc.h>
TOP_PAD = 64 << 20


def tune_malloc(environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """Set glibc's ``M_TOP_PAD`` to :data:`TOP_PAD`; True if set.

    Skipped (False) off glibc, with ``ENGINECORE_MALLOC_TUNING=0``, or when the user already set
    a ``MALLOC_*`` variable or a ``glibc.malloc`` tunable (their settings win)."""
    env = os.environ if environ is None else environ
    if env.get("ENGINECORE_MALLOC_TUNING", "1") == "0":
        return False
    if any(k.startswith("MALLOC_") for k in env) or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - unusual libc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_TOP_PAD, TOP_PAD) != 1:  # pragma: no cover
        log.warning("mallopt(M_TOP_PAD) refused; glibc defaults stay")
        return False
    return True

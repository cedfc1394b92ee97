"""Helpers of :class:`~engine.structured.bitmask.TokenBitmask` with no state of their own:
how many threads a fill is spread over, and xgrammar's Triton bitmask kernel as it is launched
here (directly, compiled once for every row count).
"""

from __future__ import annotations

import functools
import os

import torch

#: a batch fill's work (one thread's time) per thread it is spread over: below it, more
#: threads cost more than they save (xgrammar starts its threads on every call: 256 rows of the
#: bench's schema took 0.14 ms on one thread, 0.35 ms on two, on the 2-core development box)
_WORK_PER_THREAD_S = 1e-3


def fill_threads() -> int:
    """Threads xgrammar may use at most to fill a batch's rows: the CPUs this process may use,
    less two (the step's own thread, the event loop's), at most 16."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(16, n - 2))


def threads_for(work_s: float, most: int) -> int:
    """Threads for a fill of ``work_s`` of one thread's work (the last fill's, as an estimate
    of the next): one per ``_WORK_PER_THREAD_S``, at least 1, at most ``most``. Small masks
    (a byte vocabulary, a grammar inside a string) stay on one thread; large ones (a 150k-token
    vocabulary at a grammar's branch points) spread."""
    return max(1, min(most, int(work_s / _WORK_PER_THREAD_S)))


def direct_kernel(device: torch.device) -> tuple:
    """(xgrammar's Triton bitmask kernel, the grid's programs) on a CUDA device -- or on the
    CPU under Triton's interpreter (``TRITON_INTERPRET=1``, the tests) -- where the kernel can
    be had; else (None, 0): xgrammar's public function."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpret:
        return None, 0
    try:  # (xgrammar 0.2's module, pinned in pyproject.toml)
        from xgrammar.kernels.apply_token_bitmask_inplace_triton import \
            apply_token_bitmask_inplace_kernel as kernel
    except Exception:  # no Triton, or another layout: the public function
        return None, 0
    kernel = unspecialized(kernel)
    if device.type != "cuda":
        return kernel, 4
    return kernel, torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def unspecialized(kernel):
    """xgrammar's kernel compiled once for every row count.

    NOTE: Triton specializes an integer argument on whether it is 1 and whether it divides by
    16, and compiles the kernel again for each new class: ``num_rows`` is the step's
    constrained rows, which change as requests end, so serving compiled it anew in the middle
    of a decode (a 47 ms step in a 100 % constrained run on the H100). The same
    kernel body, jitted again without that specialization (the row count only bounds the
    loop), is the kernel launched here."""
    try:
        import triton

        return triton.jit(kernel.fn, do_not_specialize=["num_rows"])
    except Exception:  # pragma: no cover - another Triton: xgrammar's as it is
        return kernel


__all__ = ["fill_threads", "threads_for", "direct_kernel", "unspecialized"]

"""Device memory figures for the GPU release tests: a clean baseline, and the two counters."""

import gc

import torch


def mem() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def baseline() -> tuple[int, int]:
    """``mem()`` with nothing left over: collected, cuBLAS's workspaces and the cache emptied."""
    torch.cuda.init()
    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    return mem()

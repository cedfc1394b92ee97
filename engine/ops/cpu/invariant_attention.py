"""Batch-invariant paged attention for deterministic mode (engine/model/invariant.py).

Each query row attends to keys ``0 .. lens[r] - 1`` of its sequence, read from the paged KV
cache through the row's own block table; what it computes depends only on its query, those keys
and their count -- not on the other rows of the step, on how its prompt was chunked, or on
whether a key was written this step or by an earlier request (a cached prefix). Two ways, chosen
once by :func:`kernel`:

* the C++ kernel (``invariant_csrc/invariant_attention.cpp``): a plain C-ABI library without
  torch's headers (a few seconds to build, not ~45 s), built once per source and flags by the
  system compiler (engine/ops/native_lib.py) and called through ctypes (:class:`Kernel` checks
  every tensor first); the ``cpu_ext`` kill switch covers it too. One task per (row, KV head),
  sums in key order -- the file says why it is written by hand;
* :func:`attention_torch`, torch ops whose reduction order per row is fixed by construction: the
  scores as an elementwise product summed over the head dimension, a softmax over the keys padded
  to a multiple of 16 with -inf (padding adds exact zeros to its lanes: measured equal bit for bit
  for every padded length), the values summed within each KV block (a fixed length) and the
  blocks added in order by a cumulative sum. For devices other than the CPU and machines
  without the extension; ~5-10x slower than the kernel on CPU.

The two do not agree bit for bit with each other (different summation orders): an engine uses
one of them throughout.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from pathlib import Path
import platform
import sys
import threading
import time
from typing import Callable, Optional

import torch

from . import cpu_ext
from .. import native_lib

log = logging.getLogger("enginecore.invariant_attention")

SOURCE = Path(__file__).with_name("invariant_csrc") / "invariant_attention.cpp"
_lock = threading.Lock()
#: elements of the largest temporary :func:`attention_torch` makes at once (rows are chunked)
_TORCH_BUDGET = 1 << 24


#: the compiler's flags (part of the library's name). Only IEEE operations, each rounded on its
#: own (the source's header says why): no contraction into FMAs, no -ffast-math;
#: -fno-trapping-math lets loops with a select vectorize and changes no value
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off",
         "-fno-fast-math", "-fno-trapping-math")
#: the cache's dtypes, as the C function numbers them
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class Kernel:
    """The built library's functions, each argument checked here before a pointer is passed."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self._attend = lib.enginecore_invariant_attention
        self._attend.argtypes = [_ptr, _ptr, ctypes.c_int32, _ptr, _ptr, _i64, _i64, _i64, _i64,
                                 _i64, _i64, _i64, ctypes.c_float, _ptr, ctypes.c_int32]
        self._attend.restype = _i64
        self._fexp = lib.enginecore_invariant_fexp
        self._fexp.argtypes = [_ptr, _ptr, _i64]
        self._fexp.restype = None

    def invariant_attention(self, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
                            lens: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, H, D] float32; cache [2, blocks, bs, Hkv, D] float32 / bfloat16 / float16;
        tables [T, W] int64; lens [T] int64 (each >= 1, its blocks in the table and the cache)
        -> [T, H, D] float32. All on the CPU and contiguous; anything else is a ValueError."""
        for name, t in (("q", q), ("cache", cache), ("tables", tables), ("lens", lens)):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"invariant attention: {name} is not a contiguous CPU tensor")
        if q.dim() != 3 or q.dtype != torch.float32:
            raise ValueError("invariant attention: q must be [T, H, D] float32")
        rows, heads, dim = q.shape
        if cache.dim() != 5 or cache.shape[0] != 2 or cache.dtype not in _DTYPES:
            raise ValueError("invariant attention: cache must be [2, blocks, bs, Hkv, D] float32, "
                             "bfloat16 or float16")
        _, blocks, bs, kv_heads, cache_dim = cache.shape
        if (cache_dim != dim or dim < 1 or min(blocks, bs, kv_heads) < 1 or heads < 1
                or heads % kv_heads != 0):
            raise ValueError("invariant attention: cache and q disagree")
        if tables.dtype != torch.int64 or tables.dim() != 2 or tables.shape[0] != rows:
            raise ValueError("invariant attention: tables must be [T, W] int64")
        if lens.dtype != torch.int64 or lens.dim() != 1 or lens.shape[0] != rows:
            raise ValueError("invariant attention: lens must be [T] int64")
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError("invariant attention: the scale is not finite")
        out = torch.empty_like(q)
        # (the C side checks each row's length and blocks before reading any key)
        err = self._attend(q.data_ptr(), cache.data_ptr(), _DTYPES[cache.dtype],
                           tables.data_ptr(), lens.data_ptr(), rows, heads, dim, blocks, bs,
                           kv_heads, tables.shape[1], scale, out.data_ptr(),
                           max(1, torch.get_num_threads()))
        if err != 0:
            raise ValueError(f"invariant attention: row {err - 1}: its length or a block of its "
                             "table is out of range" if err > 0 else "invariant attention: bad sizes")
        return out

    def fexp(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's exp, elementwise (for the tests): x float32, contiguous, on the CPU."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError("fexp: x must be a contiguous float32 CPU tensor")
        out = torch.empty_like(x)
        self._fexp(x.data_ptr(), out.data_ptr(), x.numel())
        return out


@functools.lru_cache(maxsize=1)
def _build() -> Optional[Kernel]:
    if not sys.platform.startswith("linux") or native_lib.compiler() is None:
        log.info("batch-invariant attention kernel: not built (no C++ compiler or not Linux); "
                 "torch's ops run it")
        return None
    # AVX2 where the CPU has it (8 lanes, no FMA: -ffp-contract=off keeps the same bits); the
    # name says so, so that a machine without it never loads that build
    avx2 = platform.machine() in ("x86_64", "AMD64") and cpu_ext.cpu_capability() != "DEFAULT"
    t0 = time.perf_counter()
    try:
        path = native_lib.library(SOURCE, f"enginecore_invariant_attention{'_avx2' * avx2}",
                                  (*FLAGS, *(["-mavx2"] if avx2 else [])))
        mod = Kernel(path)
    except Exception as exc:  # a compiler error: the torch path still works
        log.warning("batch-invariant attention kernel: build failed (%s); torch's ops run it", exc)
        return None
    if time.perf_counter() - t0 > 2:
        log.info("batch-invariant attention kernel: built in %.1f s", time.perf_counter() - t0)
    return mod


def module() -> Optional[Kernel]:
    """The compiled kernel, or None (not buildable here, or the ``cpu_ext`` kill switch off)."""
    if not cpu_ext.enabled():
        return None
    with _lock:
        return _build()


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def kernel(device: torch.device) -> tuple[Attention, str]:
    """The attention a deterministic engine on ``device`` runs, and its name for the log."""
    ext = module() if device.type == "cpu" else None
    if ext is None:
        return attention_torch, "torch ops (engine/ops/cpu/invariant_attention.py attention_torch)"
    return functools.partial(_attention_cpp, ext), "C++ kernel (engine/ops/cpu/invariant_csrc)"


def _attention_cpp(ext, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
                   lens: torch.Tensor, scale: float) -> torch.Tensor:
    return ext.invariant_attention(q.float().contiguous(), cache, tables, lens, scale).to(q.dtype)


def attention_torch(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]; cache [2, blocks, bs, Hkv, D]; tables [T, W] long (row r's blocks); lens [T]
    long (row r sees keys ``0 .. lens[r] - 1``) -> [T, H, D] in q's dtype."""
    t, heads, dim = q.shape
    bs, kv_heads = cache.shape[2], cache.shape[3]
    gqa = heads // kv_heads
    nb = -(-int(lens.max()) // bs)
    if bs < 16:  # whole vectors in the softmax's lanes: keys padded to a multiple of 16
        nb = -(-nb // (16 // bs)) * (16 // bs)
    if tables.shape[1] < nb:
        tables = torch.cat([tables, tables.new_zeros(t, nb - tables.shape[1])], 1)
    length = nb * bs
    qf = q.float().view(t, kv_heads, gqa, 1, dim)
    out = torch.empty(t, heads, dim, dtype=torch.float32, device=q.device)
    step = max(1, _TORCH_BUDGET // (heads * length * dim))
    keys = torch.arange(length, device=q.device)
    for r0 in range(0, t, step):
        r1 = min(t, r0 + step)
        n = r1 - r0
        blocks = tables[r0:r1, :nb]
        valid = keys[None, :] < lens[r0:r1, None]  # [n, L]
        k = cache[0][blocks].view(n, length, kv_heads, dim).permute(0, 2, 1, 3).float()
        s = (qf[r0:r1] * k[:, :, None]).sum(-1) * scale  # [n, Hkv, gqa, L]: over D, in order
        p = torch.softmax(s.masked_fill(~valid[:, None, None, :], float("-inf")), -1)
        v = cache[1][blocks].view(n, length, kv_heads, dim).float()
        v = v.masked_fill(~valid[:, :, None, None], 0.0).permute(0, 2, 1, 3)  # [n, Hkv, L, D]
        part = (p.view(n, kv_heads, gqa, nb, bs, 1) * v.reshape(n, kv_heads, 1, nb, bs, dim)).sum(-2)
        out[r0:r1] = part.cumsum(-2)[..., -1, :].reshape(n, heads, dim)
    return out.to(q.dtype)


__all__ = ["kernel", "module", "attention_torch", "Kernel", "SOURCE", "FLAGS"]

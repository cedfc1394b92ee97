"""Batch-invariant paged attention for deterministic mode (engine/model/invariant.py).

Each query row attends to keys ``0 .. lens[r] - 1`` of its sequence, read from the paged KV
cache through the row's own block table; what it computes depends only on its query, those keys
and their count -- not on the other rows of the step, on how its prompt was chunked, or on
whether a key was written this step or by an earlier request (a cached prefix). Two ways, chosen
once by :func:`kernel`:

* the C++ kernel (``invariant_csrc/invariant_attention.cpp``, built once per source like
  engine/ops/cpu/cpu_ext.py's extension; the ``cpu_ext`` kill switch covers it too): one task
  per (row, KV head), sums in key order -- the file says why it is written by hand;
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

import functools
import hashlib
import logging
import os
from pathlib import Path
import platform
import shutil
import sys
import threading
import time
from typing import Any, Callable, Optional

import torch

from . import cpu_ext

log = logging.getLogger("enginecore.invariant_attention")

SOURCE = Path(__file__).with_name("invariant_csrc") / "invariant_attention.cpp"
_lock = threading.Lock()
#: elements of the largest temporary :func:`attention_torch` makes at once (rows are chunked)
_TORCH_BUDGET = 1 << 24


@functools.lru_cache(maxsize=1)
def _build() -> Optional[Any]:
    if not sys.platform.startswith("linux") or shutil.which(os.environ.get("CXX", "c++")) is None:
        log.info("batch-invariant attention kernel: not built (no C++ compiler or not Linux); "
                 "torch's ops run it")
        return None
    from torch.utils import cpp_extension

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    # AVX2 where the CPU has it (8 lanes, no FMA: -ffp-contract=off keeps the same bits); the
    # name says so, so that a machine without it never loads that build
    avx2 = platform.machine() in ("x86_64", "AMD64") and cpu_ext.cpu_capability() != "DEFAULT"
    flags = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fopenmp",
             *(["-mavx2"] if avx2 else [])]
    t0 = time.perf_counter()
    try:
        mod = cpp_extension.load(name=f"enginecore_invariant_attention_{digest}{'_avx2' * avx2}",
                                 sources=[str(SOURCE)], extra_cflags=flags,
                                 extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # a compiler error: the torch path still works
        log.warning("batch-invariant attention kernel: build failed (%s); torch's ops run it", exc)
        return None
    if time.perf_counter() - t0 > 2:
        log.info("batch-invariant attention kernel: built in %.1f s", time.perf_counter() - t0)
    return mod


def module() -> Optional[Any]:
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


__all__ = ["kernel", "module", "attention_torch", "SOURCE"]

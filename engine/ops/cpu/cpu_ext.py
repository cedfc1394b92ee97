"""The CPU extension of woq models, built once per source: the decode step's layers in one call
(engine/ops/cpu/csrc/woq_decode.cpp) and a 4-bit matmul with exact GGUF group scales
(engine/ops/cpu/csrc/int4_mm.cpp).

``module()`` returns the compiled extension, or ``None`` where it cannot be had: not on Linux,
no C++ compiler, a failed build, or the ``cpu_ext`` kill switch off (engine/envs.py); callers then keep the Python
path and torch's int4 kernel (tests/test_woq_forward.py checks the C++ step against the Python
one). The build
(``torch.utils.cpp_extension.load``, ~25-60 s on 2 cores) lands in torch's extensions
directory (``TORCH_EXTENSIONS_DIR``) under a name that carries the source's hash, so a changed
source is rebuilt and concurrent processes share one build (torch locks the directory while one
of them compiles). ``scripts/setup.sh`` builds it ahead (``python -m engine.ops.cpu.cpu_ext``) so that
neither the tests nor the first generation wait for the compiler.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
import shutil
import sys
import threading
import time
from typing import Any, Optional

from engine import envs

log = logging.getLogger("enginecore.cpu_ext")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "woq_decode.cpp", CSRC / "int4_mm.cpp", CSRC / "decode_ops.cpp")
_lock = threading.Lock()


def enabled() -> bool:
    """The ``cpu_ext`` kill switch (engine/envs.py), read when the extension is first asked
    for (the engine's load)."""
    return envs.on(envs.CPU_EXT)


def _name() -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    digest = h.hexdigest()[:12]
    return f"enginecore_woq_decode_{digest}"


@functools.lru_cache(maxsize=1)
def _build() -> Optional[Any]:
    if not sys.platform.startswith("linux"):
        log.info("C++ decode step: not built (%s; the Python step runs)", sys.platform)
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("C++ decode step: no C++ compiler found; the Python step runs (slower on CPU)")
        return None
    from torch.utils import cpp_extension

    t0 = time.perf_counter()
    try:
        mod = cpp_extension.load(name=_name(), sources=[str(p) for p in SOURCES],
                                 extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)], verbose=False)
    except Exception as exc:  # a compiler error, a missing header: the Python step still works
        log.warning("C++ decode step: build failed (%s); the Python step runs", exc)
        return None
    took = time.perf_counter() - t0
    if took > 2:
        log.info("C++ decode step: built in %.1f s", took)
    return mod


def module() -> Optional[Any]:
    """The extension (``woq_decode``), or ``None``; see the module docstring."""
    if not enabled():
        return None
    with _lock:
        return _build()


def bf16_cpu() -> bool:
    """This CPU has AVX512-BF16."""
    import torch

    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


def amx_cpu() -> bool:
    """This CPU has AMX tiles."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> tuple[bool, bool]:
    return bf16_cpu(), amx_cpu()


@functools.lru_cache(maxsize=1)
def cpu_capability() -> str:
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # an old or exotic build
        return "DEFAULT"


def int4_usable(out_features: int, in_features: int) -> bool:
    """engine/ops/cpu/csrc/int4_mm.cpp can hold this weight and run here: the extension built, a CPU
    with AVX512-BF16, outputs in blocks of 16 and inputs in groups of 32."""
    return (out_features % 16 == 0 and in_features % 32 == 0 and _cpu_flags()[0]
            and module() is not None)


def int4_options() -> tuple[bool, bool]:
    """(lo, amx) for ``int4_mm``: the input carried as two bf16 parts (hi + lo, ~16 bits;
    engine/ops/cpu/csrc/int4_mm.cpp says what it costs and buys), and AMX tiles for 2+ rows
    where the CPU has them."""
    return True, _cpu_flags()[1]


def int4_mm(x, q4, d16, m16):
    """float32 ``x`` [M, K] @ the 4-bit weight (``PackedLinear``'s q4/d16/m16) -> float32 [M, N]."""
    lo, amx = int4_options()
    return module().int4_mm(x, q4, d16, m16, lo, amx)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if module() is None:
        print("enginecore: the C++ decode step was not built (see above); the Python step runs")
    else:
        print("enginecore: the C++ decode step is built")

__all__ = ["module", "enabled", "SOURCES", "int4_usable", "int4_options", "int4_mm", "bf16_cpu", "amx_cpu",
           "cpu_capability"]

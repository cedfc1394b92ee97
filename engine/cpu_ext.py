"""The C++ decode step of woq models (engine/csrc/woq_decode.cpp), built once per source.

``module()`` returns the compiled extension, or ``None`` where it cannot be had: not on Linux,
no C++ compiler, a failed build, or ``ENGINECORE_CPU_EXT=0``; callers then keep the Python
path, which computes the same thing (bit for bit: tests/test_cpu_ext.py). The build
(``torch.utils.cpp_extension.load``, ~25-60 s on 2 cores) lands in torch's extensions
directory (``TORCH_EXTENSIONS_DIR``) under a name that carries the source's hash, so a changed
source is rebuilt and concurrent processes share one build (torch locks the directory while one
of them compiles). ``scripts/setup.sh`` builds it ahead (``python -m engine.cpu_ext``) so that
neither the tests nor the first generation wait for the compiler.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("enginecore.cpu_ext")

SOURCE = Path(__file__).with_name("csrc") / "woq_decode.cpp"
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("ENGINECORE_CPU_EXT", "1") != "0"


def _name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
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
        mod = cpp_extension.load(name=_name(), sources=[str(SOURCE)], extra_cflags=["-O2"],
                                 verbose=False)
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


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if module() is None:
        print("enginecore: the C++ decode step was not built (see above); the Python step runs")
    else:
        print("enginecore: the C++ decode step is built")

__all__ = ["module", "enabled", "SOURCE"]

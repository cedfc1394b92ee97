"""Build the C++ parts ahead, for scripts/setup.sh: the CPU decode step's extension
(engine/ops/cpu/cpu_ext.py), deterministic mode's attention kernel
(engine/ops/cpu/invariant_attention.py) and the grammar worker (engine/structured/native.py).

A part that this machine cannot build is skipped with a note: not Linux, no C++ compiler
(``$CXX``, else ``c++``), no ``ninja`` for the decode step (torch's extension builder needs it),
no xgrammar or tvm-ffi for the grammar worker, or its kill switch off (engine/envs.py). The engine then runs
without it, as it does at run time.

A part that this machine *can* build but that does not build is an error: exit 1, with the
build's own message. Otherwise the engine would silently run without it, and the tests that
need it would be skipped rather than fail.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
import shutil
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's engine/


def _cannot_build(ninja: bool = False) -> str | None:
    """Why this machine cannot build a C++ part, or None."""
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found)"
    if ninja:
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            return "no ninja (torch builds its C++ extensions with it)"
    return None


def cpu_ext() -> bool:
    """The CPU decode step; False: it could be built here and was not."""
    from engine import envs
    from engine.ops.cpu import cpu_ext as ext

    if not ext.enabled():
        print(f"setup: the C++ decode step is switched off ({envs.CPU_EXT}=0): not built",
              file=sys.stderr)
        return True
    why = _cannot_build(ninja=True)
    if why is not None:
        print(f"setup: the C++ decode step cannot be built here: {why}; the Python step runs",
              file=sys.stderr)
        return True
    if ext.module() is None:  # cpu_ext logged the build's error
        print("setup: ERROR: the C++ decode step (engine/ops/cpu/csrc/) failed to build on a "
              "machine that has what it needs; see the error above", file=sys.stderr)
        return False
    print("setup: the C++ decode step is built")
    return True


def invariant_attention() -> bool:
    """Deterministic mode's attention kernel; False: it could be built here and was not."""
    from engine.ops.cpu import cpu_ext, invariant_attention as ext

    if not cpu_ext.enabled():
        return True  # (said once, for the decode step)
    why = _cannot_build()  # (a plain library, no torch headers: the compiler alone)
    if why is not None:
        print(f"setup: deterministic mode's attention kernel cannot be built here: {why}; "
              "torch's ops run it", file=sys.stderr)
        return True
    if ext.module() is None:
        print("setup: ERROR: deterministic mode's attention kernel (engine/ops/cpu/invariant_csrc/) "
              "failed to build on a machine that has what it needs; see the error above",
              file=sys.stderr)
        return False
    print("setup: deterministic mode's attention kernel is built")
    return True


def grammar_worker() -> bool:
    """The grammar worker; False: it could be built here and was not."""
    from engine import envs
    from engine.structured import native

    if not native.enabled():
        print(f"setup: the grammar worker is switched off ({envs.GRAMMAR_WORKER}=0): not built",
              file=sys.stderr)
        return True
    why = _cannot_build()
    if why is None:
        try:
            import tvm_ffi  # noqa: F401
            import tvm_ffi.libinfo as libinfo
            import xgrammar  # noqa: F401

            libinfo.find_include_path()
            libinfo.find_dlpack_include_path()
            libinfo.find_libtvm_ffi()
        except Exception as exc:  # ImportError, or tvm-ffi without its headers or library
            why = f"no xgrammar/tvm-ffi headers and library ({exc})"
    if why is not None:
        print(f"setup: the grammar worker cannot be built here: {why}; grammar work stays on "
              "the step thread", file=sys.stderr)
        return True
    if native.worker_module() is None:  # native logged the build's error
        print("setup: ERROR: the grammar worker (engine/structured/grammar_worker.cc) failed to "
              "build on a machine that has what it needs; see the error above", file=sys.stderr)
        return False
    print("setup: the grammar worker is built")
    return True


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    ok = [part() for part in (cpu_ext, invariant_attention, grammar_worker)]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())

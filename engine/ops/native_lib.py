"""One C/C++ source built into a shared library with the system compiler, cached by name.

Used by the parts that need no torch headers (deterministic mode's attention kernel,
engine/ops/cpu/invariant_attention.py; the grammar worker, engine/structured/native.py): a direct
``c++`` run takes seconds where ``torch.utils.cpp_extension`` (torch's headers, ninja) takes tens
of seconds. The library lands in ``$TORCH_EXTENSIONS_DIR`` (else ``~/.cache/enginecore``) under a
name carrying a digest of everything the build depends on -- the source, the compiler and its
flags, the machine, and what the caller adds -- so a cache shared by two hosts, or a change of
flags, never loads a library built another way.

NOTE: by hand, not with ``tvm_ffi.cpp.build`` or ``cpp_extension``: both need ``ninja`` (which
the device hosts were never checked to have) and their cache keys leave the compiler and the
machine out.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
import platform
import shutil
import subprocess
import tempfile
from typing import Optional, Sequence


def build_dir() -> Path:
    """Where the libraries are cached."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "enginecore"


def compiler() -> Optional[str]:
    """The C++ compiler's path (``$CXX``, else ``c++``), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def library(source: Path, prefix: str, flags: Sequence[str], after: Sequence[str] = (),
            key: str = "") -> Path:
    """The library built from ``source`` (built now if missing): ``c++ flags source after -o
    out``; ``key`` adds what else the build depends on (headers' versions) to the name. Raises
    RuntimeError on a failed build or without a compiler."""
    cxx = compiler()
    h = hashlib.sha256(source.read_bytes())
    h.update(f"{key} {platform.machine()} {cxx} {list(flags)} {list(after)}".encode())
    out = build_dir() / f"{prefix}_{h.hexdigest()[:12]}.so"
    if out.exists():
        return out
    if cxx is None:
        raise RuntimeError("no C++ compiler")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *flags, str(source), *after, "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"c++ failed: {done.stderr.strip()[-2000:]}")
        # mkstemp made the file 0600 and the linker keeps its mode: readable (and loadable) by
        # the other users of a shared cache, as a file the compiler created would be
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)
        os.replace(tmp, out)  # atomic: a concurrent build of the same source loses nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


__all__ = ["build_dir", "compiler", "library"]

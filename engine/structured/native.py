"""The grammar worker: a late step's grammar work on a C++ thread that never takes the GIL
(``grammar_worker.cc`` beside this file).

Overlapped scheduling launches a constrained step's forward before the step before's tokens
have been fed to the matchers, and needs those tokens' next masks only at sampling. The core
hands both to a :class:`GrammarWorker` before the forward's launch (``EngineCore._grammar_job``)
and waits for them after it: xgrammar's batch accept and batch fill then run on another core
beside the step thread's Python. A Python helper thread did not gain (measured on the H200):
it needs the GIL back after every xgrammar call and for its own glue, so it and the step thread
took turns.

``worker_module()`` builds the source once (``c++`` against tvm-ffi's headers, a few seconds)
into ``$TORCH_EXTENSIONS_DIR`` (else ``~/.cache/enginecore``; engine/ops/native_lib.py) under a
name carrying the source's, tvm-ffi's and Python's versions, and loads it; ``None`` where it cannot be had (not
Linux, no compiler, no xgrammar, a failed build, the ``grammar_worker`` kill switch off): the core then
does the grammar work on the step thread, as before. ``scripts/setup.sh`` builds it ahead.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
from pathlib import Path
import sys
import threading
from typing import Any, Optional, Sequence
import weakref

from engine import envs
from engine.ops import native_lib

log = logging.getLogger("enginecore.structured")

SOURCE = Path(__file__).with_name("grammar_worker.cc")
#: the compiler's flags (part of the built library's name, with the rest of the build command)
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-pthread")
_lock = threading.Lock()


def enabled() -> bool:
    """The ``grammar_worker`` kill switch (engine/envs.py), read when the worker is first
    asked for (an engine's first constrained step, or setup's build)."""
    return envs.on(envs.GRAMMAR_WORKER)


def _library(libinfo) -> Path:
    """The built worker's path (built now if missing), by engine/ops/native_lib.py: its name
    covers the source, the compiler and its flags, the headers and library it is built
    against, and the machine.

    NOTE: not ``torch.utils.cpp_extension``: the worker links tvm-ffi, not torch, and is
    loaded by ``tvm_ffi.load_module``."""
    import tvm_ffi

    lib = Path(libinfo.find_libtvm_ffi()).parent
    after = [f"-I{libinfo.find_include_path()}", f"-I{libinfo.find_dlpack_include_path()}",
             f"-L{lib}", "-ltvm_ffi", f"-Wl,-rpath,{lib}"]
    return native_lib.library(SOURCE, "enginecore_grammar_worker", FLAGS, after,
                              key=f"{tvm_ffi.__version__} {sys.version_info[:2]}")


@functools.lru_cache(maxsize=1)
def _load() -> Optional[Any]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import tvm_ffi
        import tvm_ffi.libinfo as libinfo
        import xgrammar  # noqa: F401  (the functions the worker calls)
    except ImportError:
        return None
    try:
        mod = tvm_ffi.load_module(str(_library(libinfo)))
    except Exception as exc:  # a compiler error, a missing header: the step thread does it
        log.warning("grammar worker: not built (%s); grammar work stays on the step thread", exc)
        return None
    for name in ("grammar_worker_new", "grammar_worker_free", "grammar_worker_submit",
                 "grammar_worker_done", "grammar_worker_wait_done"):
        fn = getattr(mod, name)
        if hasattr(fn, "release_gil"):  # short calls: giving the GIL up costs a wait for it
            fn.release_gil = False
    # grammar_worker_wait keeps tvm-ffi's default: it gives the GIL up while it waits
    return mod


def worker_module() -> Optional[Any]:
    """The built worker module, or ``None``; see the module docstring."""
    if not enabled():
        return None
    with _lock:
        return _load()


@functools.lru_cache(maxsize=1)
def _xgrammar_functions() -> tuple:
    """(batch accept, batch fill, is_terminated, accept_token, fill_next_token_bitmask):
    xgrammar's tvm-ffi function objects."""
    from .gil import xgrammar_methods

    def method(cls, name):
        found = xgrammar_methods(cls, (name,))
        if not found:
            raise RuntimeError(f"xgrammar has no {cls}.{name}")
        return found[0]

    return (method("BatchGrammarMatcher", "batch_accept_token"),
            method("BatchGrammarMatcher", "batch_fill_next_token_bitmask"),
            method("GrammarMatcher", "is_terminated"), method("GrammarMatcher", "accept_token"),
            method("GrammarMatcher", "fill_next_token_bitmask"))


_HANDLE = operator.attrgetter("_handle")  # an xgrammar object's tvm-ffi object


class GrammarWorker:
    """One C++ thread and at most one job at a time (:meth:`submit`, then :meth:`wait`)."""

    def __init__(self, module) -> None:
        self._mod = module
        self._fns = _xgrammar_functions()
        self._handle = module.grammar_worker_new()
        self._pending = False
        self._last: Optional[tuple] = None  # (matchers, their handles): _handles
        # a worker dropped unclosed (its bitmask never closed) ends its thread when collected:
        # the C++ side finishes a job still running first. Not at exit (atexit=False): a step
        # thread may still be waiting on it then, and the process's end stops the thread
        self._pid = os.getpid()
        self._free = weakref.finalize(self, _free_here, self._pid, module, self._handle)
        self._free.atexit = False

    def submit(self, batch, matchers: Sequence, tokens: Sequence[int], ask: Sequence[int],
               fill_matchers: Optional[Sequence], fill_rows: Sequence[int],
               fill_fed: Optional[Sequence[int]], host, check_rows: Sequence[int] = (),
               vocab: int = 0, budget_ns: int = 0, fill_by_row: bool = False) -> None:
        """Start a job: feed ``matchers`` (xgrammar ``GrammarMatcher``) their ``tokens`` (every
        one in its mask), ask ``is_terminated`` of the positions ``ask``, then fill ``host``'s
        ``fill_rows`` from ``fill_matchers`` through ``batch`` (a ``BatchGrammarMatcher``),
        leaving out each fill entry whose position among ``matchers`` (``fill_fed``, -1: not
        fed) ended; ``fill_matchers`` and ``fill_fed`` None: the fill entries are ``matchers``
        themselves, in order. With ``check_rows`` (one per token): first check that each token
        is below ``vocab`` and set in that row of ``host`` (the mask it was sampled with); if
        one is not, nothing is fed or filled (:meth:`wait` says so). The caller leaves every
        matcher of the job alone until :meth:`wait`. ``budget_ns`` > 0: each row's accept, and
        (``fill_by_row``, or one row) each row's fill, is timed against it (``budget.py``)."""
        if self._pending:
            raise RuntimeError("grammar worker: the last job was not waited for")
        # (a bitmask that is not a 2-d, row-major int32 host tensor: refused by the C++ side,
        # ValueError -- xgrammar fills row r at r * width words, and the check reads them so)
        accept, fill, is_terminated, accept_one, fill_one = self._fns
        handles = self._handles(matchers)
        if fill_matchers is None:
            if fill_fed is not None:
                raise ValueError("grammar worker: fill_fed without fill_matchers")
            fill_handles, fill_fed = (), ()
        else:
            fill_handles = (handles if fill_matchers is matchers
                            else list(map(_HANDLE, fill_matchers)))
        self._mod.grammar_worker_submit(
            self._handle, accept, fill, is_terminated, accept_one, fill_one, int(budget_ns),
            bool(fill_by_row), batch._handle, handles, tokens,
            check_rows, vocab, ask, fill_handles, fill_rows, fill_fed, host)
        self._pending = True

    def _handles(self, matchers: Sequence):
        """``matchers``' tvm-ffi objects as one tvm-ffi array, the last one's again when the
        matchers are the same objects in the same order (a late step's usual case: converting
        256 handles costs more than comparing them; the list kept holds the matchers, so an
        id cannot be reused meanwhile)."""
        last = self._last
        if (last is not None and len(last[0]) == len(matchers)
                and all(map(operator.is_, last[0], matchers))):
            return last[1]
        import tvm_ffi

        handles = tvm_ffi.convert(list(map(_HANDLE, matchers)))
        self._last = (list(matchers), handles)
        return handles

    def done(self) -> bool:
        """Whether the job submitted has ended (without waiting)."""
        return bool(self._mod.grammar_worker_done(self._handle))

    def wait(self) -> Optional[tuple[float, list[int], list[int]]]:
        """The job's (fill seconds, positions among its matchers that ended, rows over the
        budget as pairs: position i >= 0 the accept of matcher i, -1-k the fill of entry k,
        then its CPU ns), once it has ended; None: a token failed the job's check (nothing fed
        or filled). The GIL is given up meanwhile. Raises the job's error (xgrammar's)."""
        if not self._pending:  # the C++ wait would return at once, with no result
            raise RuntimeError("grammar worker: no job to wait for")
        self._pending = False
        # NOTE: a job already done is collected with the GIL kept: given up, a thread that
        # wants it (the event loop delivering outputs) runs first, and this one waits for it
        # (as Launched.wait's event query before a synchronize)
        mod, handle = self._mod, self._handle
        wait = mod.grammar_worker_wait_done if mod.grammar_worker_done(handle) \
            else mod.grammar_worker_wait
        out = list(wait(handle))
        if out[0] < 0:
            return None
        n = out[1]
        return out[0] * 1e-9, out[2:2 + n], out[2 + n:]

    def close(self) -> None:
        """Wait for a job still running, then end the thread (idempotent)."""
        if self._handle:
            self._free.detach()
            if os.getpid() == self._pid:  # (a forked child's copy has no thread: see _free_here)
                if self._pending:
                    try:
                        self.wait()
                    except Exception:  # its request is being dropped with the engine
                        pass
                self._mod.grammar_worker_free(self._handle)
            self._handle = 0
            self._pending = False
            self._last = None


def _free_here(pid: int, module, handle: int) -> None:
    """End worker ``handle``'s thread -- in the process that started it only: a forked child
    has a copy of the worker without its thread, and joining that thread would wait forever
    (the child's copy is left as it is)."""
    if os.getpid() == pid:
        module.grammar_worker_free(handle)


def new_worker() -> Optional[GrammarWorker]:
    """A :class:`GrammarWorker`, or ``None`` where the module or xgrammar's functions cannot
    be had (the grammar work then stays on the step thread)."""
    mod = worker_module()
    if mod is None:
        return None
    try:
        return GrammarWorker(mod)
    except Exception as exc:  # an xgrammar without these tvm-ffi functions
        log.warning("grammar worker: not started (%s); grammar work stays on the step thread",
                    exc)
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("enginecore: the grammar worker is "
          + ("built" if worker_module() is not None else "not built (see above)"))

__all__ = ["GrammarWorker", "new_worker", "worker_module", "enabled", "SOURCE"]

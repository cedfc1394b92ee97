"""xgrammar's per-step calls keep the GIL.

xgrammar 0.2's Python API calls C++ through tvm-ffi, and tvm-ffi releases the GIL around every
call by default, however short. A thread that gives the GIL up must win it back: while another
thread runs Python (the event loop delivering a step's outputs to 256 streams), that takes up to
the interpreter's switch interval (5 ms) per call. A constrained step makes hundreds of such
calls on the step thread (``accept_token`` and ``is_terminated`` per matcher, the mask fill;
a returned Array is read back one ``ArrayGetItem`` call per element), so the event loop's
delivery turned ~0.4 ms of grammar work into 5-30 ms (measured here with a Python thread
spinning beside it: fill 0.4 -> 5.5 ms, a batch accept 0.3 -> 26 ms; kept: 0.56 and 0.46 ms).

The calls made per step are short (microseconds a matcher): they gain nothing from giving the
GIL up, so :func:`keep_gil_on_step_calls` turns the release off for exactly those tvm-ffi
functions. The grammar compile (``GrammarCompiler``, seconds on a worker thread) keeps
releasing it, as it must. The setting belongs to the tvm-ffi function objects, so it is
process-wide; it changes when the GIL is held, never what a call returns.

Written here because no library offers it: xgrammar exposes no per-call GIL choice, and tvm-ffi's
only global switch (``TVM_FFI_RELEASE_GIL_BY_DEFAULT``, read at import) would also make the
compile hold the GIL.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("enginecore.structured")

# the calls the engine makes while stepping (matcher.py, bitmask.py)
_MATCHER = ("accept_token", "is_terminated", "fill_next_token_bitmask", "stop_token_ids",
            "rollback")
_BATCH = ("batch_fill_next_token_bitmask", "batch_accept_token")
_CONTAINERS = ("ArrayGetItem", "ArraySize")  # a returned Array read back element by element


def xgrammar_methods(cls_name: str, names: tuple) -> tuple:
    """The tvm-ffi function objects of xgrammar class ``cls_name``'s methods ``names`` (empty
    when this xgrammar is not built on tvm-ffi)."""
    try:
        from xgrammar.tvm_ffi_binding import _ffi_api as binding
    except ImportError:
        return ()
    info = getattr(getattr(binding, cls_name, None), "__tvm_ffi_type_info__", None)
    return tuple(m.func for m in getattr(info, "methods", None) or ()
                 if m.name in names and hasattr(m.func, "release_gil"))


@functools.cache
def keep_gil_on_step_calls() -> int:
    """Turn the GIL release off for xgrammar's per-step calls (once; later calls return the
    same count). Returns how many functions were changed (0 when this xgrammar is not built on
    tvm-ffi: nothing to do then)."""
    try:
        from tvm_ffi import _ffi_api as containers
    except ImportError:
        return 0
    fns = xgrammar_methods("GrammarMatcher", _MATCHER) + _batch_functions()
    fns += tuple(fn for fn in (getattr(containers, name, None) for name in _CONTAINERS)
                 if hasattr(fn, "release_gil"))
    for fn in fns:
        fn.release_gil = False
    log.debug("xgrammar: %d per-step tvm-ffi calls keep the GIL", len(fns))
    return len(fns)


@functools.cache
def _batch_functions() -> tuple:
    """xgrammar's batch accept and batch fill functions."""
    return xgrammar_methods("BatchGrammarMatcher", _BATCH)


__all__ = ["keep_gil_on_step_calls", "xgrammar_methods"]

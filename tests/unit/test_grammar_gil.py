"""A constrained step's xgrammar calls keep the GIL (``engine/structured/gil.py``): while the
step thread accepts tokens, reads the verdicts and fills masks (torch's ops, which do give it
up, are not xgrammar's), a Python thread beside it (the
event loop delivering outputs) never runs; the grammar compile still gives the GIL up.

The check is by behaviour, not by timing: with a long switch interval, a thread spinning in
Python gets the GIL only when the main thread gives it up, so its counter moves during a
stretch of calls exactly when one of them released the GIL."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

xgr = pytest.importorskip("xgrammar")

from engine.loader.tokenizer import Tokenizer  # noqa: E402
from engine.structured.bitmask import TokenBitmask  # noqa: E402
from engine.structured.gil import keep_gil_on_step_calls  # noqa: E402
from engine.structured.compiler import _SEPARATORS  # noqa: E402
from engine.structured.grammars import grammar_vocab_size, tokenizer_info  # noqa: E402
from engine.structured.matcher import advance_all, new_matcher  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"]}
V = 512


def _compiler():
    tok = Tokenizer.bytes(V)
    return tok, xgr.GrammarCompiler(tokenizer_info(tok, V), max_threads=1, cache_enabled=False)


def _ran_beside(calls) -> int:
    """How far a spinning Python thread got while ``calls()`` ran on this thread."""
    old = sys.getswitchinterval()
    count, stop = [0], threading.Event()

    def spin():
        end = time.monotonic() + 5.0
        while not stop.is_set() and time.monotonic() < end:
            count[0] += 1

    sys.setswitchinterval(0.25)
    th = threading.Thread(target=spin, daemon=True)
    try:
        th.start()
        time.sleep(0.01)  # the spinner holds the GIL; getting it back starts a fresh interval
        before = count[0]
        calls()
        after = count[0]
    finally:
        stop.set()
        sys.setswitchinterval(old)
        th.join()
    return after - before


def test_the_per_step_calls_are_the_ones_changed():
    assert keep_gil_on_step_calls() >= 8  # matcher, batch matcher and container reads
    from tvm_ffi import _ffi_api as containers
    from xgrammar.tvm_ffi_binding import _ffi_api as binding

    methods = {m.name: m.func for m in binding.GrammarMatcher.__tvm_ffi_type_info__.methods}
    assert not methods["accept_token"].release_gil and not methods["is_terminated"].release_gil
    assert not containers.ArrayGetItem.release_gil
    compiler_methods = {m.name: m.func
                        for m in binding.GrammarCompiler.__tvm_ffi_type_info__.methods}
    assert compiler_methods["compile_json_schema"].release_gil  # seconds: must give it up


def test_a_step_of_grammar_work_never_lets_another_thread_run():
    tok, comp = _compiler()
    compiled = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                        separators=_SEPARATORS)
    matchers = [new_matcher(compiled) for _ in range(16)]  # turns the release off
    bits = TokenBitmask(16, V, "cpu", grammar_vocab=lambda: grammar_vocab_size(tok, V))
    assert bits.host is not None  # its rows are allocated once (a torch op): not per step

    def step():
        bits.fill([(m, i, ()) for i, m in enumerate(matchers)], background=False).rows()
        verdicts = advance_all(matchers, [ord("{")] * len(matchers))
        assert all(v == (None, None) for v in verdicts)

    assert _ran_beside(step) == 0


@pytest.mark.alone  # needs a free core for the other thread
def test_the_compile_still_lets_other_threads_run():
    _, comp = _compiler()
    keep_gil_on_step_calls()
    # a schema that takes xgrammar a while to compile (~1 s here: long enough for the spinner
    # to be scheduled on a busy 2-core box; 40 properties once left it no turn): the other
    # thread runs meanwhile
    big = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 20}
                                           for i in range(120)}}
    assert _ran_beside(lambda: comp.compile_json_schema(json.dumps(big))) > 0

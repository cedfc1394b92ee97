"""The grammar worker (``engine/structured/native.py``, ``grammar_worker.cc``): a job's masks and
verdicts are those of the step thread's own calls, it runs without the GIL, and its errors and
misuse are reported, never lost."""

from __future__ import annotations

import json
import random
import shutil
import sys
import time

import pytest

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

from engine.loader.tokenizer import Tokenizer  # noqa: E402
from engine.structured import native  # noqa: E402
from engine.structured.bitmask import TokenBitmask  # noqa: E402
from engine.structured.compiler import _SEPARATORS  # noqa: E402
from engine.structured.grammars import grammar_vocab_size, tokenizer_info  # noqa: E402
from engine.structured.matcher import advance_all, new_matcher  # noqa: E402

V = 512
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "maxItems": 3}},
          "required": ["name", "tags"]}


def test_the_worker_is_built_where_a_compiler_is():
    """CI has a C++ compiler: the worker must build there (else the engine silently keeps the
    grammar work on the step thread)."""
    if shutil.which("c++") is None or not sys.platform.startswith("linux"):
        pytest.skip("no C++ compiler")
    assert native.worker_module() is not None


needs_worker = pytest.mark.skipif(native.worker_module() is None, reason="no grammar worker")


@pytest.fixture(scope="module")
def grammars():
    tok = Tokenizer.bytes(V)
    comp = xgr.GrammarCompiler(tokenizer_info(tok, V), max_threads=1, cache_enabled=False)
    return tok, [comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                          separators=_SEPARATORS),
                 comp.compile_regex("(ab|cd){1,3}x")]


def _allowed(host, row, vocab):
    words = host[row].tolist()
    return [t for t in range(vocab) if (words[t >> 5] >> (t & 31)) & 1]


@needs_worker
def test_jobs_equal_the_step_threads_own_calls_along_random_trajectories(grammars):
    """Two copies of 24 matchers walk the same random trajectories (stop tokens included, so
    matchers end mid-walk; some rows not fed in a step, some new): one copy through
    ``TokenBitmask.accept_then_fill`` on the worker, the other through ``advance_all`` and a
    fill on this thread. Every step: the same ended matchers, the same rows filled, the same
    masks."""
    tok, compiled = grammars
    gv = grammar_vocab_size(tok, V)
    rnd = random.Random(5)
    n = 24
    a_bits = TokenBitmask(n + 1, V, "cpu", grammar_vocab=gv)
    b_bits = TokenBitmask(n + 1, V, "cpu", grammar_vocab=gv)
    pairs = [(new_matcher(compiled[k % 2]), new_matcher(compiled[k % 2])) for k in range(n)]
    live = list(range(n))
    for e in (a_bits, b_bits):
        e.fill([(pairs[k][e is b_bits], k, ()) for k in live], background=False)
    steps = 0
    while live and steps < 200:
        steps += 1
        fed = [k for k in live if rnd.random() < 0.8]  # the others sit a step out
        toks = []
        for k in fed:
            allowed = _allowed(a_bits.host, k, gv)
            assert allowed == _allowed(b_bits.host, k, gv)
            toks.append(rnd.choice(allowed))
        nxt = live  # every live matcher's row is filled next (fed or not)
        job = a_bits.accept_then_fill([pairs[k][0] for k in fed], toks,
                                      [(pairs[k][0], k, ()) for k in nxt])
        assert job is not None
        ended_a, rows_a = job.result()
        verdicts = advance_all([pairs[k][1] for k in fed], toks)
        ended_b = {k for k, v in zip(fed, verdicts) if v[0] == "stop"}
        assert {k for k in fed if id(pairs[k][0]) in ended_a} == ended_b
        assert all(v[0] != "error" for v in verdicts)
        rows_b = b_bits.fill([(pairs[k][1], k, ()) for k in nxt if k not in ended_b],
                             background=False).rows()
        assert rows_a == rows_b == [k for k in nxt if k not in ended_b]
        for k in rows_a:
            assert torch.equal(a_bits.host[k], b_bits.host[k])
        live = [k for k in live if k not in ended_b]
    assert not live, "every trajectory ends (each grammar is bounded)"
    a_bits.close()
    b_bits.close()


@needs_worker
def test_a_job_runs_while_this_thread_keeps_the_gil(grammars):
    """With a switch interval of 100 s this thread never gives the GIL up while it spins (the
    ``done`` calls keep it too): a job needing the GIL could not end before the spin's 20 s
    deadline. It ends."""
    tok, compiled = grammars
    bits = TokenBitmask(64, V, "cpu", grammar_vocab=grammar_vocab_size(tok, V))
    ms = [new_matcher(compiled[0]) for _ in range(64)]
    entries = [(m, k, ()) for k, m in enumerate(ms)]
    bits.fill(entries, background=False)
    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        job = bits.accept_then_fill(ms, [ord("{")] * 64, entries)
        end = time.monotonic() + 20
        while not bits._worker.done() and time.monotonic() < end:
            pass
        finished = bits._worker.done()
    finally:
        sys.setswitchinterval(old)
    assert finished
    assert job.result() == (set(), list(range(64)))
    bits.close()


@needs_worker
def test_errors_and_misuse_are_reported(grammars):
    import tvm_ffi

    tok, compiled = grammars
    gv = grammar_vocab_size(tok, V)
    host = torch.full((4, -(-gv // 32)), -1, dtype=torch.int32)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    m = new_matcher(compiled[1])
    w = native.new_worker()
    # xgrammar's own error inside the job (a bitmask of the wrong width): raised by wait, and
    # the worker takes the next job
    w.submit(batch, [m], [ord("a")], [], [m], [0], [0], torch.zeros((4, 3), dtype=torch.int32))
    with pytest.raises(RuntimeError, match="bitmask"):
        w.wait()
    w.submit(batch, [m], [ord("b")], [], [m], [0], [0], host)
    assert w.wait()[1] == []
    assert _allowed(host, 0, gv) == [ord("a"), ord("c"), ord("x")]
    # a function that raises: its kind and message
    w._fns = (tvm_ffi.convert(lambda *a: (_ for _ in ()).throw(KeyError("nope"))),) + w._fns[1:]
    w.submit(batch, [m], [ord("x")], [], [], [], [], host)
    with pytest.raises(RuntimeError, match="KeyError"):
        w.wait()
    w._fns = native._xgrammar_functions()
    # misuse: a second job before the wait; lists of unequal lengths; positions out of range
    w.submit(batch, [], [], [], [], [], [], host)
    with pytest.raises(RuntimeError, match="not waited"):
        w.submit(batch, [], [], [], [], [], [], host)
    w.wait()
    with pytest.raises(ValueError, match="unequal"):
        w.submit(batch, [m], [], [], [], [], [], host)
    with pytest.raises(IndexError, match="ask position"):
        w.submit(batch, [m], [1], [1], [], [], [], host)
    with pytest.raises(IndexError, match="fed position"):
        w.submit(batch, [m], [1], [], [m], [0], [3], host)
    w.close()
    w.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        w.submit(batch, [], [], [], [], [], [], host)


@needs_worker
def test_close_waits_for_a_running_job(grammars):
    tok, compiled = grammars
    bits = TokenBitmask(256, V, "cpu", grammar_vocab=grammar_vocab_size(tok, V))
    ms = [new_matcher(compiled[0]) for _ in range(256)]
    entries = [(m, k, ()) for k, m in enumerate(ms)]
    bits.fill(entries, background=False)
    assert bits.accept_then_fill(ms, [ord("{")] * 256, entries) is not None
    bits.close()  # joins the thread after the job
    assert bits._worker is None
    # the matchers took their token: '{' again is refused
    assert not ms[0].accept_token(ord("{"))


@needs_worker
def test_entries_with_drafts_stay_on_the_step_thread(grammars):
    tok, compiled = grammars
    bits = TokenBitmask(8, V, "cpu", grammar_vocab=grammar_vocab_size(tok, V))
    m = new_matcher(compiled[1])
    assert bits.accept_then_fill([], [], [(m, 0, (ord("a"),))]) is None
    bits.close()


def test_an_xgrammar_without_the_functions_keeps_the_work_on_the_step_thread(monkeypatch):
    def missing():
        raise RuntimeError("xgrammar has no BatchGrammarMatcher.batch_accept_token")

    monkeypatch.setattr(native, "_xgrammar_functions", missing)
    assert native.new_worker() is None
    bits = TokenBitmask(4, V, "cpu", grammar_vocab=V)
    assert bits.accept_then_fill([], [], []) is None
    bits.close()


@needs_worker
def test_the_job_checks_each_token_against_its_row_first(grammars):
    """With check rows, a token out of its row's mask -- not set there, at or past the grammar's
    vocabulary, negative, or a row out of range -- ends the job before anything: no matcher fed,
    no row filled, and the wait says so (None). All in: the job runs as without the check."""
    tok, compiled = grammars
    gv = grammar_vocab_size(tok, V)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    host = torch.zeros((4, -(-gv // 32)), dtype=torch.int32)
    w = native.new_worker()
    ms = [new_matcher(compiled[1]) for _ in range(2)]
    b = xgr.BatchGrammarMatcher(max_threads=1)
    b.batch_fill_next_token_bitmask(ms, host, [0, 1])  # rows 0, 1: "a" or "c" first
    before = host.clone()
    for toks, rows in (([ord("a"), ord("b")], [0, 1]),   # "b" is not in row 1's mask
                       ([ord("a"), gv], [0, 1]),         # past the grammar's vocabulary
                       ([ord("a"), -1], [0, 1]),
                       ([ord("a"), ord("c")], [0, 4])):  # a row past the bitmask
        w.submit(batch, ms, toks, [], None, [2, 3], None, host, check_rows=rows, vocab=gv)
        assert w.wait() is None
        assert torch.equal(host, before)  # nothing filled
    # nothing fed: both matchers still take their first token
    w.submit(batch, ms, [ord("a"), ord("c")], [], None, [2, 3], None, host, check_rows=[0, 1],
             vocab=gv)
    assert w.wait()[1] == []
    assert _allowed(host, 2, gv) == [ord("b")] and _allowed(host, 3, gv) == [ord("d")]
    # every id, against the step thread's own check (TokenBitmask.allows)
    bits = TokenBitmask(1, V, "cpu", grammar_vocab=gv)
    m = new_matcher(compiled[1])
    bits.fill([(m, 0, ())], background=False)
    ids = list(range(-1, gv + 2))
    for t, ok in zip(ids, bits.allows([0] * len(ids), ids)):
        w.submit(batch, [m], [t], [], None, [], None, bits.host, check_rows=[0], vocab=gv)
        assert (w.wait() is not None) == ok, t
        if ok:  # fed: a fresh matcher for the next id
            m = new_matcher(compiled[1])
    bits.close()
    with pytest.raises(ValueError, match="unequal"):
        w.submit(batch, ms, [1, 2], [], None, [0, 1], None, host, check_rows=[0], vocab=gv)
    with pytest.raises(ValueError, match="int32 host"):
        w.submit(batch, ms, [1, 2], [], None, [0, 1], None, host.long())
    with pytest.raises(ValueError, match="fill_fed without"):
        w.submit(batch, ms, [1, 2], [], None, [0, 1], [0, 1], host)
    w.close()


@needs_worker
def test_the_fed_matchers_fill_by_default_and_their_handles_are_reused(grammars):
    """``fill_matchers=None``: the fed matchers fill their rows, in order, as the explicit lists
    do; the handles' conversion is reused while the matchers are
    the same objects in the same order, and redone otherwise."""
    tok, compiled = grammars
    gv = grammar_vocab_size(tok, V)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    width = -(-gv // 32)
    a, b = torch.zeros((8, width), dtype=torch.int32), torch.zeros((8, width), dtype=torch.int32)
    ma = [new_matcher(compiled[1]) for _ in range(3)]
    mb = [new_matcher(compiled[1]) for _ in range(3)]
    wa, wb = native.new_worker(), native.new_worker()
    for toks in ([ord("a")] * 3, [ord("b")] * 3, [ord("x"), ord("c"), ord("c")]):
        wa.submit(batch, ma, toks, [], None, [5, 6, 7], None, a)
        wb.submit(batch, mb, toks, [], mb, [5, 6, 7], [0, 1, 2], b)
        assert wa.wait()[1] == wb.wait()[1] == []
        assert torch.equal(a, b)
    handles = wa._last[1]
    wa.submit(batch, list(ma), [ord("d")] * 3, [], None, [1, 2, 3], None, a)
    wa.wait()
    assert wa._last[1] is handles  # a new list of the same matchers
    other = [ma[1], ma[0], ma[2]]
    wa.submit(batch, other, [ord("a")] * 3, [], None, [1, 2, 3], None, a)
    wa.wait()
    assert wa._last[1] is not handles and wa._last[0] == other
    wa.close()
    wb.close()
    assert wa._last is None


@needs_worker
def test_the_check_reads_rows_of_a_view_and_refuses_a_strided_bitmask(grammars):
    """The worker's check reads the rows of the tensor it is given: a view into a larger one
    (a storage offset) reads the view's rows; a tensor that is not row-major (an expanded row:
    one row of storage) is refused by the C++ side itself, not only by ``submit``."""
    tok, compiled = grammars
    gv = grammar_vocab_size(tok, V)
    width = -(-gv // 32)
    big = torch.zeros((6, width), dtype=torch.int32)
    host = big[2:]
    ms = [new_matcher(compiled[1]) for _ in range(2)]
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    batch.batch_fill_next_token_bitmask(ms, host, [0, 1])
    assert big[:2].eq(0).all()
    w = native.new_worker()
    w.submit(batch, ms, [ord("a"), ord("c")], [], None, [2, 3], None, host, check_rows=[0, 1],
             vocab=gv)
    assert w.wait() is not None
    strided = torch.zeros((1, width), dtype=torch.int32).expand(4096, width)
    accept, fill, is_terminated, accept_one, fill_one = w._fns
    with pytest.raises(ValueError, match="contiguous"):
        w._mod.grammar_worker_submit(w._handle, accept, fill, is_terminated, accept_one,
                                     fill_one, 0, False, batch._handle,
                                     w._handles(ms[:1]), [ord("b")], [4095], gv, [], (), [],
                                     (), strided)
    w.close()


@needs_worker
def test_a_timed_job_reports_its_rows_over_the_budget(grammars):
    """``budget_ns``: each row's accept and (``fill_by_row``) fill is timed on the worker, and
    the rows over the budget come back as (accept position i, or -1-k for fill entry k, CPU
    ns); the masks and verdicts are those of an untimed job. A budget of 1 ns: every row is
    over it (a row's work is microseconds); a budget of a minute: none is."""
    tok, compiled = grammars
    gv = grammar_vocab_size(tok, V)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    w = native.new_worker()
    hosts = []
    for budget_ns, by_row in ((0, False), (1, True), (1, False), (60 * 10**9, True)):
        ms = [new_matcher(compiled[1]) for _ in range(3)]
        host = torch.full((4, -(-gv // 32)), -1, dtype=torch.int32)
        w.submit(batch, ms, [ord("a"), ord("c"), ord("a")], [], None, [0, 1, 2], None, host,
                 budget_ns=budget_ns, fill_by_row=by_row)
        fill_s, ended, over = w.wait()
        assert ended == [] and fill_s > 0
        hosts.append(host)
        pairs = dict(zip(over[::2], over[1::2]))
        if budget_ns == 1:  # accepts always row by row; fills only when asked
            assert set(pairs) == ({0, 1, 2, -1, -2, -3} if by_row else {0, 1, 2}), over
            assert all(ns > 1 for ns in pairs.values())
        else:
            assert over == []
    assert all(torch.equal(h, hosts[0]) for h in hosts[1:])
    w.close()

"""xgrammar's vocabulary ends at the last id with text or an EOS id (``grammar_vocab_size``);
the padding past it is refused by the bitmask's zero tail. The masks are the ones the whole
padded vocabulary gives, bit for bit, along random trajectories; a step's tokens taken in one
``batch_accept_token`` call give ``advance``'s verdicts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from engine.loader.tokenizer import Tokenizer  # noqa: E402
from engine.structured.bitmask import TokenBitmask  # noqa: E402
from engine.structured.compiler import _SEPARATORS  # noqa: E402
from engine.structured.grammars import grammar_vocab_size, tokenizer_info  # noqa: E402
from engine.structured.matcher import advance, advance_all  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 5},
    "tags": {"type": "array", "minItems": 2, "maxItems": 3,
             "items": {"type": "string", "minLength": 1, "maxLength": 3}},
    "note": {"type": "string"},
    "score": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["title", "tags", "note", "score"]}


def _padded_info(tok: Tokenizer, vocab_size: int):
    """Every id of the vocabulary, the padding as empty (special) entries: the old view."""
    table = tok.byte_table
    special = set(tok.special_token_ids())
    vocab = [b"" if i in special else table[i] if i < len(table) else b""
             for i in range(vocab_size)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=sorted(tok.eos_token_ids))


def _compile(info, constraint):
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    if constraint is None:
        return comp.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                        separators=_SEPARATORS)
    return comp.compile_json_schema(json.dumps(constraint), any_whitespace=False,
                                    separators=_SEPARATORS)


@pytest.mark.parametrize("vocab, want", [(258, 258), (300, 288), (512, 288), (151936, 288)])
def test_grammar_vocab_is_the_ids_with_text_in_whole_words(vocab, want):
    assert grammar_vocab_size(Tokenizer.bytes(vocab), vocab) == want
    assert tokenizer_info(Tokenizer.bytes(vocab), vocab).vocab_size == want


def test_an_eos_id_in_the_padding_stays_in_the_grammar_vocabulary():
    tok = Tokenizer(None, vocab_size=4096, bos_token_id=256, eos_token_ids=(257, 1000))
    assert grammar_vocab_size(tok, 4096) == 1024
    info = tokenizer_info(tok, 4096)
    assert info.vocab_size == 1024 and sorted(info.stop_token_ids) == [257, 1000]


@pytest.mark.parametrize("constraint", [SCHEMA, None], ids=["schema", "json_object"])
def test_masks_equal_the_padded_vocabularys_along_random_trajectories(constraint):
    V, n, rng = 4096, 24, np.random.default_rng(1)
    tok = Tokenizer.bytes(V)
    ours, padded = _compile(tokenizer_info(tok, V), constraint), _compile(_padded_info(tok, V),
                                                                         constraint)
    a = [xgr.GrammarMatcher(ours) for _ in range(n)]
    b = [xgr.GrammarMatcher(padded) for _ in range(n)]
    bits = TokenBitmask(n, V, "cpu", grammar_vocab=lambda: grammar_vocab_size(tok, V))
    ref = torch.full((n, V // 32), -1, dtype=torch.int32)
    compared = 0
    for _ in range(60):
        live = [i for i in range(n) if not b[i].is_terminated()]
        assert live == [i for i in range(n) if not a[i].is_terminated()]
        entries = [(a[i], i, ()) for i in live]
        logits = torch.zeros(n, V)
        masked = bits.apply(logits, entries, copy=True)
        for i in live:
            b[i].fill_next_token_bitmask(ref, i)
        for i in live:
            allowed = np.flatnonzero(np.unpackbits(ref[i].numpy().view(np.uint8),
                                                   bitorder="little"))
            got = torch.nonzero(masked[i] == 0).flatten().numpy()
            assert np.array_equal(got, allowed), i
            assert torch.isinf(masked[i, 288:]).all()
            compared += 1
            # a random allowed token (what random weights pick) or, now and then, any id
            tok_id = int(rng.choice(allowed)) if rng.random() < 0.9 else int(rng.integers(V))
            va, vb = advance(a[i], tok_id), advance(b[i], tok_id)
            assert va == vb, (i, tok_id)
            if va[0] is not None:  # a dead end, or complete: start this row again
                a[i], b[i] = xgr.GrammarMatcher(ours), xgr.GrammarMatcher(padded)
    assert compared == 60 * n


def test_unconstrained_rows_are_left_alone():
    V = 512
    tok = Tokenizer.bytes(V)
    m = xgr.GrammarMatcher(_compile(tokenizer_info(tok, V), SCHEMA))
    bits = TokenBitmask(4, V, "cpu", grammar_vocab=lambda: grammar_vocab_size(tok, V))
    logits = torch.randn(4, V)
    out = bits.apply(logits, [(m, 2, ())], copy=True)
    assert torch.equal(out[[0, 1, 3]], logits[[0, 1, 3]])
    assert torch.nonzero(torch.isfinite(out[2])).flatten().tolist() == [ord("{")]
    assert bits.host.shape == (4, 9) and bits.dev.shape == (4, 16)


def test_advance_all_gives_advances_verdicts():
    V = 512
    tok = Tokenizer.bytes(V)
    g = _compile(tokenizer_info(tok, V), {"type": "string", "maxLength": 2})
    # go on, dead end (a digit where the quote must be), an id past the grammar's vocabulary,
    # the EOS that completes the grammar
    states = [b"", b"", b"", b'"ab"']
    tokens = [ord('"'), ord("1"), 400, 257]

    def matchers():
        out = []
        for s in states:
            m = xgr.GrammarMatcher(g)
            for c in s:
                assert m.accept_token(c)
            out.append(m)
        return out

    one = [advance(m, t) for m, t in zip(matchers(), tokens)]
    assert [v[0] for v in one] == [None, "error", "error", "stop"]
    assert advance_all(matchers(), tokens) == one
    assert advance_all(matchers()[:1], tokens[:1]) == one[:1]
    assert advance_all([], []) == []


def test_tokens_checked_against_the_masks_are_fed_in_one_unread_call():
    """A late step's verdicts: each token checked against the host row its step was masked
    with (``TokenBitmask.allows``); all allowed -> one batch accept whose result is not read,
    with ``advance``'s verdicts and the matchers' states; one refused -> each on its own."""
    V, n, rng = 512, 16, np.random.default_rng(3)
    tok = Tokenizer.bytes(V)
    g = _compile(tokenizer_info(tok, V), SCHEMA)
    a = [xgr.GrammarMatcher(g) for _ in range(n)]
    b = [xgr.GrammarMatcher(g) for _ in range(n)]
    bits = TokenBitmask(n, V, "cpu", grammar_vocab=lambda: grammar_vocab_size(tok, V))
    fast = slow = 0
    for step in range(80):
        live = [i for i in range(n) if not a[i].is_terminated()]
        if not live:
            break
        rows = list(range(len(live)))  # packed rows, as a step's sampled rows are
        bits.fill([(a[i], r, ()) for r, i in zip(rows, live)]).rows()
        toks = []
        for r in rows:
            allowed = np.flatnonzero(np.unpackbits(bits.host[r].numpy().view(np.uint8),
                                                   bitorder="little"))
            toks.append(int(rng.choice(allowed)))
        if step % 7 == 3:  # now and then a refused token: a dead end
            toks[0] = 400 if step % 2 else ord("}") if toks[0] != ord("}") else ord("1")
        ok = bits.allows(rows, toks)
        assert all(bits.allows(rows, toks)) == all(ok)
        assert ok == [bool(b[i].accept_token(t)) and (b[i].rollback(1) or True)
                      for i, t in zip(live, toks)]
        got = advance_all([a[i] for i in live], toks, ok)
        want = [advance(b[i], t) for i, t in zip(live, toks)]
        assert got == want
        fast, slow = fast + all(ok), slow + (not all(ok))
        for i, v in zip(live, want):
            if v[0] == "error":  # restart a row that hit a dead end
                a[i], b[i] = xgr.GrammarMatcher(g), xgr.GrammarMatcher(g)
    assert fast > 10 and slow > 2
    assert [m.is_terminated() for m in a] == [m.is_terminated() for m in b]
    assert bits.allows([], []) == [] and all(bits.allows([], []))


def test_a_background_fill_is_under_way_when_fill_returns():
    """The caller's Python would keep the GIL from the helper thread: fill() returns once the
    fill has started, so it overlaps what the caller does next."""
    V, n = 512, 8
    tok = Tokenizer.bytes(V)
    g = _compile(tokenizer_info(tok, V), SCHEMA)
    ms = [xgr.GrammarMatcher(g) for _ in range(n)]
    bits = TokenBitmask(n, V, "cpu", grammar_vocab=lambda: grammar_vocab_size(tok, V))
    try:
        for _ in range(20):
            filling = bits.fill([(m, i, ()) for i, m in enumerate(ms)], background=True)
            assert filling.future.running() or filling.future.done()
            assert filling.rows() == list(range(n))
    finally:
        bits.close()


def test_a_fill_spreads_over_threads_only_when_its_work_is_large():
    from engine.structured.kernels import threads_for as _threads_for

    assert _threads_for(0.0001, 14) == 1  # 256 rows of a byte vocabulary: one thread
    assert _threads_for(0.0035, 14) == 3
    assert _threads_for(0.5, 14) == 14  # capped by the CPUs
    assert _threads_for(0.5, 1) == 1


def test_the_thread_count_follows_the_last_fills_work_and_masks_stay_the_same():
    V, n = 4096, 24
    tok = Tokenizer.bytes(V)
    compiled = _compile(tokenizer_info(tok, V), SCHEMA)
    ms = [xgr.GrammarMatcher(compiled) for _ in range(n)]
    bits = TokenBitmask(n, V, "cpu", grammar_vocab=lambda: grammar_vocab_size(tok, V))
    entries = [(m, i, ()) for i, m in enumerate(ms)]
    bits.fill(entries).rows()
    one = bits.host.clone()
    assert bits._threads == 1  # tiny work
    bits._threads = 2  # as after a large fill: the same rows come out
    bits.host.fill_(0)
    bits.fill(entries).rows()
    assert torch.equal(bits.host, one)


@pytest.mark.parametrize("kind", ["schema", "json", "regex"])
def test_allows_is_exactly_what_accept_token_takes(kind):
    """``advance_all``'s batch path rests on it: at each state of a walk, every id of the
    grammar's vocabulary is allowed by the filled row (``TokenBitmask.allows``) exactly when
    ``accept_token`` takes it (stop tokens, the builtin JSON grammar's strings included)."""
    V, rng = 512, np.random.default_rng(1)
    tok = Tokenizer.bytes(V)
    info = tokenizer_info(tok, V)
    gv = grammar_vocab_size(tok, V)
    comp = xgr.GrammarCompiler(info)
    g = {"schema": lambda: _compile(info, SCHEMA),
         "json": comp.compile_builtin_json_grammar,
         "regex": lambda: comp.compile_regex(r"(ab|cd){2,9}x[0-9]+\"?")}[kind]()
    bits = TokenBitmask(1, V, "cpu", grammar_vocab=gv)
    for _ in range(2):
        m = xgr.GrammarMatcher(g)
        for _ in range(40):
            if m.is_terminated():
                break
            bits.fill([(m, 0, ())]).rows()
            allowed = bits.allows([0] * (gv + 3), list(range(-1, gv + 2)))
            assert not allowed[0] and not any(allowed[-2:])
            assert not all(bits.allows([0] * (gv + 3), list(range(-1, gv + 2))))
            allowed = allowed[1:-2]
            inside = list(range(gv))  # the in-range path equals the general one
            assert bits.allows([0] * gv, inside) == allowed
            ok = [t for t in inside if allowed[t]]
            assert all(bits.allows([0] * len(ok), ok)) and not (
                len(ok) < gv and all(bits.allows([0] * gv, inside)))
            took = []
            for t in range(gv):
                took.append(bool(m.accept_token(t)))
                if took[-1]:
                    m.rollback(1)
            assert took == allowed
            m.accept_token(int(rng.choice(np.flatnonzero(allowed))))

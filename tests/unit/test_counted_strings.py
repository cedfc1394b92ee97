"""A schema's bounded strings (``minLength`` / ``maxLength``) compiled as rules that count the
characters left (``compiler.count_bounded_strings``) keep xgrammar's language exactly: along
random trajectories over a vocabulary of multi-character tokens (some longer than the bounds,
some closing the string and going on), every mask is the one ``compile_json_schema`` gives, bit
for bit, and every token gets the same verdict."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from engine.structured.compiler import (  # noqa: E402
    MAX_COUNTED, _SEPARATORS, _compile_json_schema, count_bounded_strings)
from engine.structured.matcher import advance  # noqa: E402


def _vocab() -> list[bytes]:
    v = [bytes([i]) for i in range(256)]
    words = ["ab", "abc", "abcdef", "abcdefghijklmn", "title", "tags", "score", "é", "日本",
             '"', '",', '","', '"]', '"],', '"}', 'a"', 'xyz"', 'ab",', '":', ':"', '{"', '"t',
             "\\n", "\\", "\\u00e9", " a", "  ", "1", "12", "100", "0}", "1}", "[\"", '",["',
             "é\"", '"],"score":', ',"tags":["', "\n", "\t"]
    v += [w.encode() for w in words]
    v += [b"\xc3", b"\xa9", b"\xe6\x97"]  # partial UTF-8 characters
    v += [b""]  # EOS
    return v


SCHEMAS = [
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "minItems": 3, "maxItems": 3,
                 "items": {"type": "string", "minLength": 1, "maxLength": 6}},
        "score": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["title", "tags", "score"]},
    {"type": "object", "properties": {
        "a": {"type": "string", "minLength": 2, "maxLength": 2},
        "b": {"type": "string", "maxLength": 0},
        "c": {"type": "array", "items": {"type": "object", "properties": {
            "d": {"type": "string", "minLength": 3}, "e": {"type": "string", "maxLength": 4}},
            "required": ["d", "e"]}, "maxItems": 2}},
     "required": ["a", "b", "c"]},
    {"type": "string", "minLength": 1, "maxLength": 3},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["bench", "mixed", "top-string"])
def test_counted_strings_keep_the_language(schema):
    vocab = _vocab()
    eos = len(vocab) - 1
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab),
                             stop_token_ids=[eos])
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    ref = comp.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                   separators=_SEPARATORS)
    ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=_SEPARATORS))
    assert count_bounded_strings(ebnf) != ebnf  # there is something to count
    ours = _compile_json_schema(comp, json.dumps(schema))
    n, rng = 16, np.random.default_rng(7)
    a, b = [xgr.GrammarMatcher(ref) for _ in range(n)], [xgr.GrammarMatcher(ours) for _ in range(n)]
    words = -(-len(vocab) // 32)
    ma = torch.zeros((n, words), dtype=torch.int32)
    mb = torch.zeros((n, words), dtype=torch.int32)
    ended = 0
    for _ in range(120):
        for i in range(n):
            a[i].fill_next_token_bitmask(ma, i)
            b[i].fill_next_token_bitmask(mb, i)
            assert torch.equal(ma[i], mb[i]), i
            allowed = np.flatnonzero(np.unpackbits(ma[i].numpy().view(np.uint8),
                                                   bitorder="little")[: len(vocab)])
            tok = int(rng.choice(allowed)) if rng.random() < 0.9 else int(rng.integers(len(vocab)))
            va, vb = advance(a[i], tok), advance(b[i], tok)
            assert va == vb, (i, tok)
            if va[0] is not None:  # complete, or a dead end: again from the start
                ended += va[0] == "stop"
                a[i], b[i] = xgr.GrammarMatcher(ref), xgr.GrammarMatcher(ours)
    assert ended > 0  # trajectories reached the end of the language too


def test_what_is_not_counted_stays():
    plain = 'root ::= "\\"" c{0, -1} "\\""\nc ::= [a-z]'
    assert count_bounded_strings(plain) == plain
    big = f'root ::= "\\"" c{{0, {MAX_COUNTED + 1}}} "\\""\nc ::= [a-z]'
    assert count_bounded_strings(big) == big
    taken = 'root ::= "\\"" c{0, 3} "\\"" c_left_0\nc ::= [a-z]\nc_left_0 ::= "x"'
    assert count_bounded_strings(taken) == taken
    got = count_bounded_strings('root ::= "\\"" c{2, 4} "\\""\nc ::= [a-z]')
    assert got.splitlines()[0] == 'root ::= "\\"" c c c_left_2'
    assert 'c_left_2 ::= "\\"" | c c_left_1' in got and "c_left_3" not in got


def test_a_counted_grammar_that_does_not_compile_falls_back(monkeypatch, caplog):
    from engine.structured import compiler

    monkeypatch.setattr(compiler, "count_bounded_strings", lambda e: e + "\nbroken ::= (")
    vocab = _vocab()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab),
                             stop_token_ids=[len(vocab) - 1])
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    g = _compile_json_schema(comp, json.dumps(SCHEMAS[2]))
    m = xgr.GrammarMatcher(g)
    assert m.accept_string('"ab"') and "does not compile" in caplog.text

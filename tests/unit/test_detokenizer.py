"""The incremental detokenizer on its own: no broken UTF-8 in any delta, stop strings that span
token boundaries never reach a delta, held-back text comes out at the end."""

from __future__ import annotations

import pytest

from engine.core.detokenizer import IncrementalDetokenizer
from engine.loader.tokenizer import Tokenizer


class WordPieces:
    """A fake tokenizer: token i is the string ``pieces[i]``."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids) -> str:
        return "".join(self.pieces[i] for i in ids)


BYTES = Tokenizer.bytes(300)


def feed(detok: IncrementalDetokenizer, ids) -> list[str]:
    return [detok.add([i]) for i in ids]


def test_a_character_split_across_byte_tokens_waits_for_its_last_byte():
    text = "é€😀"
    ids = list(text.encode())  # 2 + 3 + 4 bytes, one token each
    d = IncrementalDetokenizer(BYTES, [], [])
    deltas = feed(d, ids)
    assert deltas == ["", "é", "", "", "€", "", "", "", "😀"]
    assert all("\ufffd" not in x for x in deltas)
    assert d.flush() == "" and d.text == text


def test_prompt_tail_gives_context_but_is_never_emitted():
    d = IncrementalDetokenizer(BYTES, list("Hello".encode()), [])
    assert "".join(feed(d, list(" world".encode()))) + d.flush() == " world"


def test_stop_string_across_token_boundaries_never_reaches_a_delta():
    tok = WordPieces(["The", " ans", "wer", " is", " 4", "2", ".", " Done"])
    d = IncrementalDetokenizer(tok, [], ["is 42"])
    deltas = []
    for i in range(8):
        deltas.append(d.add([i]))
        if d.stopped:
            break
    assert d.stopped and i == 5  # found on the token that completes it
    assert "".join(deltas) == d.text == "The answer "
    assert not any("is" in x for x in deltas)
    assert d.flush() == "" and d.add([6]) == ""  # nothing more after a stop


def test_text_that_may_start_a_stop_string_is_held_then_released():
    tok = WordPieces(["ab", "c", "x", "y"])
    d = IncrementalDetokenizer(tok, [], ["cxz"])
    assert d.add([0]) == ""  # "ab" could still be followed by the start of the stop
    assert d.add([1]) == "a"  # hold back len("cxz") - 1 = 2 characters
    assert d.add([2]) == "b"
    assert d.add([3]) == "c" and not d.stopped  # "cxy" is not the stop string
    assert d.flush() == "xy" and d.text == "abcxy"


@pytest.mark.parametrize("stops", [["\n\n"], ["END", "\n\n"]])
def test_earliest_stop_wins_and_multibyte_text_before_it_is_whole(stops):
    ids = list("naïve\n\nEND".encode())
    d = IncrementalDetokenizer(BYTES, [], stops)
    out = ""
    for i in ids:
        out += d.add([i])
        if d.stopped:
            break
    assert d.stopped and out == "naïve"


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string():
    tok = WordPieces(["Hel", "lo", " wor", "ld", "!"])
    d = IncrementalDetokenizer(tok, [], ["wor", "lo w"], include_stop_str=True)
    out = "".join(feed(d, [0, 1, 2, 3]))
    assert d.stopped and out == "Hello w" and d.text == "Hello w"  # the earliest stop, kept
    d = IncrementalDetokenizer(tok, [], ["wor", "lo w"])
    assert "".join(feed(d, [0, 1, 2, 3])) == "Hel" and d.stopped


def test_special_tokens_are_kept_when_asked():
    class Special(WordPieces):
        def decode(self, ids, skip_special_tokens=True) -> str:
            pieces = [self.pieces[i] for i in ids]
            return "".join(p for p in pieces if not (skip_special_tokens and p.startswith("<")))

    tok = Special(["a", "<eos>", "b"])
    assert "".join(feed(IncrementalDetokenizer(tok, [], []), [0, 1, 2])) == "ab"
    d = IncrementalDetokenizer(tok, [], [], skip_special_tokens=False)
    assert "".join(feed(d, [0, 1, 2])) + d.flush() == "a<eos>b"


def test_byte_stream_equals_window_decoding_on_random_bytes():
    """The byte-level tokenizer's incremental decoder gives the window decoder's text exactly
    (invalid bytes, partial characters at the end, ids >= 256, prompt tails)."""
    import random

    class Window:
        def decode(self, ids, skip_special_tokens=True):
            return BYTES.decode(ids, skip_special_tokens)

    rng = random.Random(3)
    alphabet = list("aé€😀\n{\"1".encode()) + [0x80, 0xC3, 0xE2, 0xF0, 256, 257, 299]
    for n in range(800):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 24))]
        prompt = list("ok".encode()) + [rng.choice(alphabet) for _ in range(rng.randint(0, 3))]
        stops = ["é€"] if n % 3 == 0 else []
        got = []
        for tok in (BYTES, Window()):
            d = IncrementalDetokenizer(tok, prompt, stops)
            deltas = [d.add([i]) for i in ids] + [d.flush()]
            got.append(("".join(deltas), d.stopped))
        assert got[0] == got[1], (prompt, ids)
    d = IncrementalDetokenizer(BYTES, list("ok".encode()), [])
    assert d._stream is not None  # the byte tokenizer streams


def test_a_long_output_text_is_every_delta_joined():
    from engine.core.detokenizer import _JOIN_EVERY, IncrementalDetokenizer

    class Chars:  # token i decodes to chr(97 + i % 26): one character a token
        def decode(self, ids, skip=True):
            return "".join(chr(97 + i % 26) for i in ids)

    d = IncrementalDetokenizer(Chars(), [], [])
    deltas = [d.add([i]) for i in range(10 * _JOIN_EVERY + 3)]
    assert len(d._out) <= _JOIN_EVERY + 1  # kept in few pieces, not one a token
    assert d.text == "".join(deltas) == "".join(chr(97 + i % 26) for i in range(len(deltas)))
    assert d.flush() == "" and d.text == "".join(deltas)

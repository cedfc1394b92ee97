"""engine.sample.bad_words: the token forms of each word and which of them a step bans."""

from engine.params import SamplingParams
from engine.sample.bad_words import bad_word_sequences, banned_now


class WordTokenizer:
    """One token per space-separated word; a leading space makes a different token (as BPE)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        words = text.split(" ")
        pieces = [words[0]] + [" " + w for w in words[1:]]
        return [self.vocab.setdefault(p, len(self.vocab)) for p in pieces if p]


def test_each_word_as_written_and_after_a_space_deduplicated():
    tok = WordTokenizer()
    seqs = bad_word_sequences(tok, ["  cat", "big dog", "cat"])
    v = tok.vocab
    assert seqs == ((v["cat"],), (v[" cat"],), (v["big"], v[" dog"]), (v[" big"], v[" dog"]))


def test_one_token_forms_always_banned_longer_ones_only_after_their_prefix():
    seqs = ((7,), (1, 2), (3, 4, 5))
    assert banned_now(seqs, []) == [7]
    assert banned_now(seqs, [9, 1]) == [7, 2]
    assert banned_now(seqs, [3, 4]) == [7, 5]
    assert banned_now(seqs, [4]) == [7]  # a prefix longer than the output: not yet


def test_bad_words_are_output_dependent_and_not_speculated():
    assert SamplingParams(bad_words=["x"]).output_dependent_logits
    assert SamplingParams(bad_words=["x"]).needs_logits_processing
    assert not SamplingParams(logit_bias={1: 2.0}).output_dependent_logits
    assert SamplingParams(frequency_penalty=0.5).output_dependent_logits

"""``bad_words``: words a request's output must not contain, as token sequences to ban.

As in vLLM: each word is tokenized as written (leading spaces stripped) and with one leading
space (the form it takes after another word), the second kept only when it tokenizes
differently. A one-token sequence bans that token at every step; a longer one bans its last
token at a step whose output so far ends with the rest of it (the ban is checked against the
output, not the prompt). ``logits.LogitsPlan`` turns the bans of a step into one scatter.
"""

from __future__ import annotations

from typing import Sequence


def bad_word_sequences(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences to ban for ``words`` (validated by ``SamplingParams``), deduplicated."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = word.lstrip()
        if not bare:
            continue
        for text in (bare, " " + bare):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def banned_now(sequences: Sequence[tuple[int, ...]], tokens: Sequence[int],
               num_prompt: int = 0) -> list[int]:
    """The tokens the next step may not sample, given a request's ``tokens`` of which the first
    ``num_prompt`` are the prompt (only the output's tail is read, never copied whole)."""
    banned = []
    end = len(tokens)
    for seq in sequences:
        n = len(seq) - 1
        if n == 0 or (n <= end - num_prompt and tuple(tokens[end - n:]) == seq[:-1]):
            banned.append(seq[-1])
    return banned


__all__ = ["bad_word_sequences", "banned_now"]

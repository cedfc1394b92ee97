"""Limits checked on a request body's JSON before the schema (``protocol``) parses it.

Why: pydantic refuses a too-long list only after turning all of it into Python objects (and,
for a union, an error per entry per member): the soak's hostile bodies grew the HTTP frontend.
These checks read the body once in C through ``msgspec.Raw`` views and make no
object per entry.
"""

from __future__ import annotations

import re

import msgspec

from engine.params import MAX_BAD_WORDS

from .protocol import (MAX_INT, MAX_LOGIT_BIAS, MAX_PROMPTS, MAX_STOP, MAX_STOP_CHARS,
                       MAX_STOP_TOKEN_IDS, RequestError)


class _RawLists(msgspec.Struct):
    """The JSON of the short bounded lists, unparsed: ``msgspec.Raw`` is a view of the body,
    so reading this makes no Python object per entry."""

    stop: msgspec.Raw = msgspec.Raw()
    stop_token_ids: msgspec.Raw = msgspec.Raw()
    bad_words: msgspec.Raw = msgspec.Raw()
    logit_bias: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


def _batch_entries(raw: msgspec.Raw) -> int:
    """A lower bound on the number of prompts in a batch ``prompt`` (a list of token-id lists
    or of strings), counted in C without parsing; 0 for a single prompt. Token ids hold no
    brackets, so a list of lists has ``count("[") - 1`` entries; a list of strings at least
    half its unescaped quotes (an escaped backslash before a closing quote is counted as an
    escape, so the count can only come out low: a valid batch is never refused by it). Only
    a batch is copied out of the body; the kind is told from its first bytes."""
    view = memoryview(raw)
    head = bytes(view[:64])
    i = _SPACE.match(head).end()
    j = _SPACE.match(head, i + 1).end()
    if j >= len(head) and len(head) < len(view):  # whitespace past the head: read it all
        head = bytes(view)
        i = _SPACE.match(head).end()
        j = _SPACE.match(head, i + 1).end()
    first = head[j:j + 1]
    if head[i:i + 1] != b"[" or first not in (b"[", b'"'):
        return 0
    body = head if len(head) == len(view) else bytes(view)
    if first == b"[":
        return body.count(b"[", i) - 1
    return (body.count(b'"', i) - body.count(b'\\"', i)) // 2


_SPACE = re.compile(rb"\s*")


def _raw_bound(entries: int, entry_bytes: int) -> int:
    """The most JSON bytes ``entries`` entries of at most ``entry_bytes`` bytes can take, with
    up to 16 bytes of separators and whitespace around each (and 4 KiB around the whole)."""
    return entries * (entry_bytes + 16) + 4096


_CHAR_BYTES = 12  # one character of a JSON string at its longest: a \uXXXX\uXXXX surrogate pair
#: the most JSON bytes of each short bounded list (:class:`_RawLists`)
RAW_LIST_BYTES = {
    "stop": _raw_bound(MAX_STOP, MAX_STOP_CHARS * _CHAR_BYTES + 2),
    "stop_token_ids": _raw_bound(MAX_STOP_TOKEN_IDS, len(str(MAX_INT))),
    "bad_words": _raw_bound(MAX_BAD_WORDS, MAX_STOP_CHARS * _CHAR_BYTES + 2),
    "logit_bias": _raw_bound(MAX_LOGIT_BIAS, 32 * _CHAR_BYTES + 2 + 32 + 1),
}
_raw_lists = msgspec.json.Decoder(_RawLists)


def check_list_sizes(raw: bytes) -> None:
    """Refuse (400 naming the parameter) a body whose short bounded list is longer in bytes
    than :data:`RAW_LIST_BYTES` allows, before the schema parses it.

    Why: pydantic refuses a too-long list only after turning all of it into Python objects
    for the error's input value: a refused 200,000-entry ``stop_token_ids`` list (1.3 MB of
    JSON) became 200,000 ints (7.6 MB) and took 9-19 ms here; this check reads the body once
    in C (1 ms for 1.5 MB) and makes no object per entry. A body that is not a JSON object,
    or not JSON, is left to the schema (its own error)."""
    try:
        lists = _raw_lists.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return
    for name, bound in RAW_LIST_BYTES.items():
        size = len(getattr(lists, name))
        if size > bound:
            raise RequestError(f"{name}: {size} bytes of JSON is more than any valid value "
                               f"needs (at most {bound})", param=name)
    # a batch of prompts past MAX_PROMPTS: pydantic would build every entry (and an error per
    # entry, per member of the prompt union) before refusing it -- 300,000 one-token prompts
    # (1.5 MB) took the frontend to ~290 MB and 0.6-2.7 s (soak, helper soak12)
    n = _batch_entries(lists.prompt)
    if n > MAX_PROMPTS:
        raise RequestError(f"prompt: a batch of at least {n} prompts; at most {MAX_PROMPTS}",
                           param="prompt")

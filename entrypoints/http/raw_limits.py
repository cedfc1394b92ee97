"""Every list a request body may hold is bounded here, from the body's JSON, before the schema
(``protocol``) parses it.

Why: pydantic refuses a too-long list only after turning all of it into objects (its JSON tree,
then Python objects, and for a union an error per entry per member). Measured here: 2.7 M empty
chat messages (7.7 MiB) took a frontend +300-420 MB and 3.6 s to refuse, 2.7 M content parts in
one message +590 MB, 4 M ``allowed_token_ids`` +244 MB. msgspec's own ``Meta(max_length=...)``
does not help: it too builds the whole list before checking its length (+62 MB for 2.7 M empty
structs). So the checks read the body in C through ``msgspec.Raw`` views (no copy) and make no
object per entry past a list's limit:

* a list of anything (messages, content parts, tool calls, tools, functions, ``guided_choice``,
  ``stop``, ``bad_words``, a batch of prompts) is decoded into :func:`_counter`'s array-like struct
  of ``limit`` ``Raw`` fields, which msgspec refuses at the ``limit + 1``-th entry (0.3 ms for
  the 2.7 M messages, nothing allocated);
* a list of token ids is counted by its commas, ``logit_bias`` by its colons: a valid value has
  none inside its entries (an invalid one may be over-counted: it is refused either way);
* the free-form JSON pydantic turns into Python objects (tools, functions, ``tool_choice``,
  ``response_format``, ``structured_outputs``, ``guided_json``) by its bytes, all together
  (:data:`~protocol.MAX_SCHEMA_BYTES`);
* ``stop``, ``stop_token_ids``, ``bad_words`` and ``logit_bias`` also by their bytes
  (:data:`RAW_LIST_BYTES`).

A body that is not a JSON object, not JSON, or whose values have the wrong types is left to the
schema (its own error): these checks only count. Fields the schema ignores still cost pydantic
its JSON tree (about 30 bytes a value, freed when the parse ends; see docs/serving.md).
"""

from __future__ import annotations

import functools
from typing import Optional

import msgspec

from engine.params import MAX_BAD_WORDS

from .protocol import (MAX_ALLOWED, MAX_BATCH_TOKENS, MAX_CHOICE, MAX_INT, MAX_LOGIT_BIAS,
                       MAX_MESSAGES, MAX_PARTS, MAX_PROMPT_TOKENS, MAX_PROMPTS, MAX_SCHEMA_BYTES,
                       MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_TOOL_CALLS, MAX_TOOLS,
                       MAX_TOTAL_PARTS, RequestError)

_NONE = msgspec.Raw()  # an absent field (a JSON value is never empty)


class _Fields(msgspec.Struct):
    """The body's lists and free-form values, unparsed: views of the body."""

    messages: msgspec.Raw = _NONE
    prompt: msgspec.Raw = _NONE
    tokens: msgspec.Raw = _NONE
    stop: msgspec.Raw = _NONE
    stop_token_ids: msgspec.Raw = _NONE
    bad_words: msgspec.Raw = _NONE
    logit_bias: msgspec.Raw = _NONE
    allowed_token_ids: msgspec.Raw = _NONE
    guided_choice: msgspec.Raw = _NONE
    tools: msgspec.Raw = _NONE
    functions: msgspec.Raw = _NONE
    tool_choice: msgspec.Raw = _NONE
    response_format: msgspec.Raw = _NONE
    structured_outputs: msgspec.Raw = _NONE
    guided_json: msgspec.Raw = _NONE


class _Message(msgspec.Struct):
    content: msgspec.Raw = _NONE
    tool_calls: msgspec.Raw = _NONE


_fields = msgspec.json.Decoder(_Fields)
_message = msgspec.json.Decoder(_Message)
#: free-form JSON that pydantic makes Python objects of, bounded together by MAX_SCHEMA_BYTES
FREE_FORM = ("tools", "functions", "tool_choice", "response_format", "structured_outputs",
             "guided_json")


def _raw_bound(entries: int, entry_bytes: int) -> int:
    """The most JSON bytes ``entries`` entries of at most ``entry_bytes`` bytes can take, with
    up to 16 bytes of separators and whitespace around each (and 4 KiB around the whole)."""
    return entries * (entry_bytes + 16) + 4096


_CHAR_BYTES = 12  # one character of a JSON string at its longest: a \uXXXX\uXXXX surrogate pair
#: the most JSON bytes of each short bounded list
RAW_LIST_BYTES = {
    "stop": _raw_bound(MAX_STOP, MAX_STOP_CHARS * _CHAR_BYTES + 2),
    "stop_token_ids": _raw_bound(MAX_STOP_TOKEN_IDS, len(str(MAX_INT))),
    "bad_words": _raw_bound(MAX_BAD_WORDS, MAX_STOP_CHARS * _CHAR_BYTES + 2),
    "logit_bias": _raw_bound(MAX_LOGIT_BIAS, 32 * _CHAR_BYTES + 2 + 32 + 1),
}


@functools.lru_cache(maxsize=None)
def _counter(limit: int) -> msgspec.json.Decoder:
    """A decoder of a JSON array of at most ``limit`` entries, each kept as a view; msgspec
    refuses the ``limit + 1``-th entry when it reaches it (an array-like struct that forbids
    unknown fields), so a longer array costs nothing more. Made once per limit (12 ms and
    ~0.5 MB for 4,096)."""
    fields = [(f"e{i}", msgspec.Raw, _NONE) for i in range(limit)]
    return msgspec.json.Decoder(msgspec.defstruct(f"AtMost{limit}", fields, array_like=True,
                                                  forbid_unknown_fields=True, gc=False))


def _too_many(param: str, limit: int, n=None) -> RequestError:
    got = f"{n} entries" if n is not None else f"more than {limit} entries"
    return RequestError(f"{param}: {got}; at most {limit} are allowed", param=param)


def _first(raw: msgspec.Raw) -> bytes:
    return bytes(memoryview(raw)[:1])  # a Raw view starts at its value's first byte


def _may_exceed(raw: msgspec.Raw, limit: int) -> bool:
    """Whether ``raw`` is long enough to be an array of more than ``limit`` entries (``n``
    entries take at least ``2n + 1`` bytes)."""
    return len(raw) > 2 * limit + 2


def _entries(raw: msgspec.Raw, limit: int, param: str) -> tuple:
    """The entries of ``raw`` (views) if it is a JSON array, else (); RequestError naming
    ``param`` if it has more than ``limit``."""
    if _first(raw) != b"[":
        return ()
    try:
        got = msgspec.structs.astuple(_counter(limit).decode(raw))
    except msgspec.ValidationError:  # the only one possible: every entry is a Raw
        raise _too_many(param, limit) from None
    return got[:got.index(_NONE)] if _NONE in got else got


def _check_count(raw: msgspec.Raw, limit: int, param: str) -> None:
    if _may_exceed(raw, limit):
        _entries(raw, limit, param)


def _numbers(raw: msgspec.Raw) -> int:
    """The entries of a JSON array of numbers (1 for an empty one), from its commas."""
    return bytes(raw).count(b",") + 1


def _check_numbers(raw: msgspec.Raw, limit: int, param: str) -> None:
    if _may_exceed(raw, limit) and _first(raw) == b"[":
        n = _numbers(raw)
        if n > limit:
            raise _too_many(param, limit, n)


def _check_prompt(raw: msgspec.Raw) -> Optional[str]:
    """A batch (strings or token-id lists) of at most MAX_PROMPTS prompts, MAX_PROMPT_TOKENS
    ids a prompt and MAX_BATCH_TOKENS ids together; one prompt of at most MAX_PROMPT_TOKENS.
    Returns the kind of a long prompt (``protocol.CompletionRequest.for_prompt``), else None."""
    if not _may_exceed(raw, MAX_PROMPTS):
        return None
    if _first(raw) == b'"':
        return "text"
    if _first(raw) != b"[":
        return None
    view = memoryview(raw)
    first = bytes(view[1:257]).lstrip()[:1] or bytes(view[1:]).lstrip()[:1]
    if first not in (b"[", b'"'):  # one prompt of token ids
        _check_numbers(raw, MAX_PROMPT_TOKENS, "prompt")
        return "ids" if first.isdigit() else None
    prompts = _entries(raw, MAX_PROMPTS, "prompt")
    if first == b'"':
        return "texts"
    for p in prompts:
        _check_numbers(p, MAX_PROMPT_TOKENS, "prompt")
    total = _numbers(raw)  # a valid batch: its ids and the separators between its prompts
    if total > MAX_BATCH_TOKENS:
        raise RequestError(f"prompt: the prompts have {total} tokens; at most "
                           f"{MAX_BATCH_TOKENS} per request", param="prompt")
    return "id_lists"


def _check_messages(raw: msgspec.Raw) -> None:
    """At most MAX_MESSAGES messages, each with at most MAX_PARTS content parts and
    MAX_TOOL_CALLS tool calls, and MAX_TOTAL_PARTS parts together. A message that is not an
    object is left to the schema."""
    if not _may_exceed(raw, min(MAX_PARTS, MAX_TOOL_CALLS)):
        _check_count(raw, MAX_MESSAGES, "messages")  # no list inside can be over its limit
        return
    count_all = _may_exceed(raw, MAX_TOTAL_PARTS)
    parts = 0
    for i, entry in enumerate(_entries(raw, MAX_MESSAGES, "messages")):
        if not (count_all or _may_exceed(entry, min(MAX_PARTS, MAX_TOOL_CALLS))):
            continue
        try:
            message = _message.decode(entry)
        except msgspec.ValidationError:
            continue
        _check_count(message.tool_calls, MAX_TOOL_CALLS, f"messages.[{i}].tool_calls")
        if count_all:
            parts += len(_entries(message.content, MAX_PARTS, f"messages.[{i}].content"))
            if parts > MAX_TOTAL_PARTS:
                raise RequestError(f"messages: more than {MAX_TOTAL_PARTS} content parts in all; "
                                   f"at most {MAX_TOTAL_PARTS} are allowed", param="messages")
        else:
            _check_count(message.content, MAX_PARTS, f"messages.[{i}].content")


def check_list_sizes(raw: bytes) -> Optional[str]:
    """Refuse (400 naming the parameter and its limit) a body with a list longer than the
    schema allows, or more free-form JSON than :data:`~protocol.MAX_SCHEMA_BYTES`, before the
    schema parses it. One pass of msgspec over the body (23 ms for 7.7 MiB of empty messages)
    plus short ones over the lists it found. Returns the kind of a long ``prompt``
    (``"text"``, ``"ids"``, ``"texts"``, ``"id_lists"``), else None."""
    try:
        f = _fields.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    for name, bound in RAW_LIST_BYTES.items():
        size = len(getattr(f, name))
        if size > bound:
            raise RequestError(f"{name}: {size} bytes of JSON is more than any valid value "
                               f"needs (at most {bound})", param=name)
    free = 0
    for name in FREE_FORM:
        free += len(getattr(f, name))
        if free > MAX_SCHEMA_BYTES:
            raise RequestError(f"{name}: the tools and output constraints of a request take at "
                               f"most {MAX_SCHEMA_BYTES} bytes of JSON together", param=name)
    for name, limit in (("stop", MAX_STOP), ("bad_words", MAX_BAD_WORDS),
                        ("guided_choice", MAX_CHOICE), ("tools", MAX_TOOLS),
                        ("functions", MAX_TOOLS)):
        _check_count(getattr(f, name), limit, name)
    for name, limit in (("stop_token_ids", MAX_STOP_TOKEN_IDS), ("allowed_token_ids", MAX_ALLOWED),
                        ("tokens", MAX_PROMPT_TOKENS)):
        _check_numbers(getattr(f, name), limit, name)
    if _first(f.logit_bias) == b"{":
        n = bytes(f.logit_bias).count(b":")  # token-id keys hold no colon
        if n > MAX_LOGIT_BIAS:
            raise _too_many("logit_bias", MAX_LOGIT_BIAS, n)
    _check_messages(f.messages)
    return _check_prompt(f.prompt)

"""A request body's JSON checked against its schema's shape (``raw_shape``) before pydantic
parses it: every list within its bound, every value of a kind the schema allows there, the
free-form JSON within :data:`~protocol.MAX_SCHEMA_BYTES`. A refusal is a 400 naming the field.

Why: pydantic makes objects of everything before it refuses anything. A too-long list is
built whole first (its JSON tree, then Python objects, and for a union an error per entry per
member), and an error keeps its input made a Python object: measured here, 2.7 M empty chat
messages (7.7 MiB) took a frontend +300-420 MB and 3.6 s to refuse, 2.7 M content parts
+590 MB, and the same empty objects sent as ``max_tokens`` +391 MB (as a message's content,
two union members: +682 MB, 5 s). msgspec's own ``Meta(max_length=...)`` builds the whole list
before checking its length too (+62 MB for 2.7 M empty structs). So this reads the body in C
through ``msgspec.Raw`` views (no copy), and makes no object per entry past a list's bound:

* a list is decoded into :func:`_counter`'s array-like struct of ``limit`` ``Raw`` fields,
  which msgspec refuses at the ``limit + 1``-th entry (0.3 ms for the 2.7 M messages, nothing
  allocated); a list of numbers is counted by its commas (and holds nothing else);
* a value's kind is told from its first byte; a model's fields are read as views (unknown
  fields skipped unread), an object of a ``dict`` by its colons;
* free-form JSON (``Any``: tools, messages' tool calls, ``tool_choice``,
  ``response_format.json_schema``, ``structured_outputs``, ``guided_json``,
  ``chat_template_kwargs``' values), which pydantic makes Python objects of, by bytes.

What pydantic still builds is bounded by the body: its JSON tree of fields it ignores (about 30
bytes a value, freed when the parse ends) and the valid values themselves. A body that is not a
JSON object, or not JSON, is left to the schema (its own error).
"""

from __future__ import annotations

import functools
from typing import Optional

import msgspec

from .protocol import MAX_BATCH_TOKENS, MAX_SCHEMA_BYTES, MAX_TOTAL_PARTS, RequestError
from .raw_shape import ANY, ARRAY, KIND_OF, NUMBER, OBJECT, Shape, model_shape

#: a body this small costs pydantic a few MB at most whatever it holds (its JSON tree and the
#: errors' inputs: ~150 bytes a value), so it is left to the schema alone; the walk below costs
#: ~10 us a model object in Python, more than pydantic's parse of such a body on the event loop
SMALL_BODY = 64 * 1024
#: lists longer than this are of numbers only in the schema (counted by commas)
COUNTER_MAX = 4096
#: entries of all the lists at one place (indices left out) together
TOTALS = {"messages.content": MAX_TOTAL_PARTS}
#: a prompt's JSON past this many bytes is parsed by its kind's schema, not the union
LONG_PROMPT = 256
_NUMBER_BYTES = b"0123456789+-.eE, \t\r\n"
_OBJECT_VALUES = msgspec.json.Decoder(dict[str, msgspec.Raw])


@functools.lru_cache(maxsize=None)
def _counter(limit: int) -> msgspec.json.Decoder:
    """A decoder of a JSON array of at most ``limit`` entries, each kept as a view; msgspec
    refuses the ``limit + 1``-th entry when it reaches it (an array-like struct that forbids
    unknown fields), so a longer array costs nothing more. Made once per limit (12 ms and
    ~0.5 MB for 4,096)."""
    fields = [(f"e{i}", msgspec.Raw, None) for i in range(limit)]
    return msgspec.json.Decoder(msgspec.defstruct(f"AtMost{limit}", fields, array_like=True,
                                                  forbid_unknown_fields=True, gc=False))


def _entries(raw: msgspec.Raw, limit: int, path: str) -> tuple:
    """The entries (views) of the JSON array ``raw``; RequestError if more than ``limit``."""
    try:
        got = msgspec.structs.astuple(_counter(limit).decode(raw))
    except msgspec.ValidationError:  # the only one possible: every entry is a Raw
        raise _too_many(path, limit) from None
    return got[:got.index(None)] if None in got else got


def _too_many(path: str, limit: int, n=None) -> RequestError:
    got = f"{n} entries" if n is not None else f"more than {limit} entries"
    return RequestError(f"{path}: {got}; at most {limit} are allowed", param=path)


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _kinds(kinds) -> str:
    """``{"string", "array", "null"}`` -> ``"an array, a string or null"``."""
    named = [k if k == "null" else _a(k) for k in _ORDER if k in kinds]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"


_ORDER = ("object", "array", "string", "number", "bool", "null")


class _Walk:
    """One body's check: the free-form bytes and the totals seen so far."""

    def __init__(self) -> None:
        self.free = 0
        self.totals = dict.fromkeys(TOTALS, 0)

    def value(self, raw: msgspec.Raw, shape: Shape, path: str) -> None:
        if not len(raw):
            return  # absent
        if shape.free:
            self.free += len(raw)
            if self.free > MAX_SCHEMA_BYTES:
                raise RequestError(f"{path}: the free-form JSON of a request (tools, tool calls, "
                                   f"output constraints, chat template arguments) takes at most "
                                   f"{MAX_SCHEMA_BYTES} bytes together", param=path)
            return
        kind = KIND_OF.get(memoryview(raw)[0])
        if kind not in shape.kinds:
            raise RequestError(f"{path}: expected {_kinds(shape.kinds)}, got "
                               f"{_a(kind or 'invalid value')}", param=path)
        if kind == ARRAY and shape.entry is not None:
            self.array(raw, shape, path)
        elif kind == OBJECT and shape.fields is not None:
            got = shape.decoder.decode(raw)
            for name, field in shape.fields.items():
                self.value(getattr(got, name), field, f"{path}.{name}" if path else name)
        elif kind == OBJECT and shape.entry is not None:
            self.mapping(raw, shape, path)

    def array(self, raw: msgspec.Raw, shape: Shape, path: str) -> None:
        limit = shape.limit
        if shape.numbers_only or limit > COUNTER_MAX:
            body = bytes(raw)
            n = body.count(b",") + 1  # a list of numbers: exact (an empty one counts 1)
            if n > limit:
                raise _too_many(path, limit, n)
            if shape.numbers_only:
                if body.translate(None, _NUMBER_BYTES) != b"[]":
                    raise RequestError(f"{path}: expected a list of numbers", param=path)
                return
            # a union of lists (a short prompt: its kind is not known); its first entry's
            # kind, as pydantic would take it (the body is too short to cost more)
            first = body[1:257].lstrip()[:1] or body[1:].lstrip()[:1]
            kind = KIND_OF.get(first[0]) if first and first != b"]" else None
            if kind is not None and kind not in shape.entry.kinds:
                raise RequestError(f"{path}.[0]: expected {_kinds(shape.entry.kinds)}, got "
                                   f"{_a(kind)}", param=f"{path}.[0]")
            return
        entry = shape.entry
        walk = entry.kinds != ANY or entry.free or entry.entry is not None or entry.fields
        total = ".".join(p for p in path.split(".") if not p.startswith("["))
        if not walk and total not in self.totals and len(raw) <= 2 * limit + 2:
            return  # n entries take at least 2n + 1 bytes
        entries = _entries(raw, limit, path)
        if total in self.totals:
            self.totals[total] += len(entries)
            if self.totals[total] > TOTALS[total]:
                top = total.split(".")[0]
                raise RequestError(f"{top}: more than {TOTALS[total]} entries in {total} together; "
                                   f"at most {TOTALS[total]} are allowed", param=top)
        if walk:
            for i, e in enumerate(entries):
                self.value(e, entry, f"{path}.[{i}]")

    def mapping(self, raw: msgspec.Raw, shape: Shape, path: str) -> None:
        """An object of a ``dict`` (``logit_bias``): its members counted by their colons (a
        colon in a key over-counts: no token id has one), then its values' kinds."""
        body = bytes(raw)
        n = body.count(b":")
        if n > shape.limit:
            raise _too_many(path, shape.limit, n)
        for key, value in _OBJECT_VALUES.decode(body).items():
            self.value(value, shape.entry, f"{path}.{key[:64]}")


def prompt_kind(raw: msgspec.Raw) -> Optional[str]:
    """The kind of a completion's prompt, from its first bytes: ``"text"``, ``"ids"``,
    ``"texts"``, ``"id_lists"`` (``protocol.CompletionRequest.for_prompt``), or None."""
    view = memoryview(raw)
    if not len(view) or view[0] != ord("["):
        return "text" if len(view) and view[0] == ord('"') else None
    first = bytes(view[1:257]).lstrip()[:1] or bytes(view[1:]).lstrip()[:1]
    if first in (b'"', b"["):
        return "texts" if first == b'"' else "id_lists"
    return "ids" if first and KIND_OF.get(first[0]) == NUMBER else None


def check_raw(raw: bytes, model: type) -> type:
    """Refuse (400 naming the field) a body of ``model`` with a list past its bound, a value of
    a kind the schema does not allow there, or more free-form JSON than MAX_SCHEMA_BYTES;
    return the schema to parse it with (``model``, or one narrowed to a long prompt's kind:
    ``for_prompt``). One pass of msgspec over the body (23 ms for 7.7 MiB of empty messages),
    and short ones over the lists and models it holds."""
    shape = model_shape(model)
    try:
        top = shape.decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return model  # not a JSON object: the schema's error
    prompt = getattr(top, "prompt", None)
    if prompt is not None and len(prompt) > LONG_PROMPT:
        kind = prompt_kind(prompt)
        model = model.for_prompt(kind)
        shape = model_shape(model)
        if kind == "id_lists":
            total = bytes(prompt).count(b",") + 1  # a valid batch: ids + separators of prompts
            if total > MAX_BATCH_TOKENS:
                raise RequestError(f"prompt: the prompts have {total} tokens; at most "
                                   f"{MAX_BATCH_TOKENS} per request", param="prompt")
    walk = _Walk()
    for name, field in shape.fields.items():
        walk.value(getattr(top, name), field, name)
    return model

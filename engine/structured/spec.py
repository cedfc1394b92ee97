"""``StructuredOutputs``: the one output constraint a request may carry (``SamplingParams.structured``).

Exactly one of ``json_schema`` (a JSON Schema, as text; a dict given in Python is encoded to its
text when the struct is made), ``json_object`` (any JSON object), ``regex``, ``choice``
(the output is one of these strings) or ``grammar`` (EBNF / GBNF text). Pure data: this module
does not import the grammar engine, so frontends and IPC clients carry it without xgrammar.

Bounds (checked by :meth:`StructuredOutputs.validate`, and on the wire by the field types): schema
text at most :data:`MAX_SCHEMA_CHARS`, regex and grammar at most :data:`MAX_PATTERN_CHARS`, at most
:data:`MAX_CHOICES` choices of 1 to :data:`MAX_CHOICE_CHARS` characters each.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Optional, Union

import msgspec
from msgspec import Meta

from ..errors import BadRequestError

MAX_SCHEMA_CHARS = 64 * 1024
MAX_PATTERN_CHARS = 16 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
#: how deeply a schema given as a dict may nest before it is refused (msgspec's encoder recurses)
MAX_SCHEMA_DEPTH = 64

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

# NOTE: not sorted: a schema's property order is the order the grammar emits them in
_encode = msgspec.json.Encoder()


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of ``obj`` (stops counting past ``limit``); iterative, so a hostile dict
    cannot exhaust the interpreter's stack before it is refused."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend((v, d + 1) for v in o)
    return deepest


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True,
                        forbid_unknown_fields=True):
    """One output constraint. ``json_schema`` may be given as a dict: it is stored as its JSON
    text (keys in their order), so equal schemas share one compiled grammar."""

    json_schema: Optional[Annotated[str, Meta(max_length=MAX_SCHEMA_CHARS)]] = None
    json_object: bool = False
    regex: Optional[Annotated[str, Meta(max_length=MAX_PATTERN_CHARS)]] = None
    choice: Optional[Annotated[list[Annotated[str, Meta(max_length=MAX_CHOICE_CHARS)]],
                               Meta(max_length=MAX_CHOICES)]] = None
    grammar: Optional[Annotated[str, Meta(max_length=MAX_PATTERN_CHARS)]] = None

    def __post_init__(self) -> None:
        s: Union[str, dict, None] = self.json_schema
        if isinstance(s, (dict, bool)):  # a Python caller's schema object (True: any value)
            if isinstance(s, dict) and _depth(s, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
                raise BadRequestError(f"invalid structured output: json_schema nests deeper "
                                      f"than {MAX_SCHEMA_DEPTH} levels")
            try:
                self.json_schema = _encode.encode(s).decode()
            except (TypeError, ValueError, OverflowError) as exc:
                raise BadRequestError(f"invalid structured output: json_schema is not "
                                      f"JSON: {exc}") from None

    # -- checks -------------------------------------------------------------------------------
    def validate(self) -> "StructuredOutputs":
        """Raise :class:`BadRequestError` unless exactly one constraint is set, of the right type
        and inside its bounds; return self."""
        def bad(msg: str) -> BadRequestError:
            return BadRequestError(f"invalid structured output: {msg}")

        if type(self.json_object) is not bool:
            raise bad("json_object must be a boolean")
        given = [k for k in KINDS if self._given(k)]
        if len(given) != 1:
            raise bad(f"exactly one of {', '.join(KINDS)} must be set, got "
                      f"{', '.join(given) or 'none'}")
        for name, limit in (("json_schema", MAX_SCHEMA_CHARS), ("regex", MAX_PATTERN_CHARS),
                            ("grammar", MAX_PATTERN_CHARS)):
            v = getattr(self, name)
            if v is not None and (type(v) is not str or not (0 < len(v) <= limit)):
                raise bad(f"{name} must be a non-empty string of at most {limit} characters")
        c = self.choice
        if c is not None:
            if (not isinstance(c, list) or not (0 < len(c) <= MAX_CHOICES)
                    or any(type(s) is not str or not (0 < len(s) <= MAX_CHOICE_CHARS) for s in c)):
                raise bad(f"choice must be a list of 1 to {MAX_CHOICES} strings of 1 to "
                          f"{MAX_CHOICE_CHARS} characters")
        return self

    def _given(self, kind: str) -> bool:
        v = getattr(self, kind)
        return v is True if kind == "json_object" else v is not None

    # -- identity -----------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._given(k))

    @property
    def text(self) -> str:
        """The constraint's source text (choices as a JSON list)."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return _encode.encode(self.choice).decode()
        return getattr(self, kind)

    @property
    def key(self) -> str:
        """What compiled grammars are cached under: a hash of the kind and the text."""
        h = hashlib.sha256(self.kind.encode())
        h.update(b"\0")
        h.update(self.text.encode("utf-8", errors="surrogatepass"))
        return h.hexdigest()

    @property
    def size(self) -> int:
        return len(self.text)


__all__ = ["StructuredOutputs", "KINDS", "MAX_SCHEMA_CHARS", "MAX_PATTERN_CHARS", "MAX_CHOICES",
           "MAX_CHOICE_CHARS"]

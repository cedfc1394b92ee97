"""What the JSON of a request may hold where, read off the pydantic schema (``protocol``) once:
a :class:`Shape` per position -- the JSON kinds allowed there, a list's most entries (the
schema's ``max_length``), its entries' shape, a model's fields -- that ``raw_limits`` checks
the raw body against before pydantic parses it.

Why from the schema: the checks must refuse nothing the schema accepts, and follow it when it
changes; the schema already says every kind and every bound.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin

import annotated_types
import msgspec
from pydantic import BaseModel
from pydantic.fields import FieldInfo

OBJECT, ARRAY, STRING, NUMBER, BOOL, NULL = "object", "array", "string", "number", "bool", "null"
ANY = frozenset({OBJECT, ARRAY, STRING, NUMBER, BOOL, NULL})
#: a JSON value's kind from its first byte
KIND_OF = {ord("{"): OBJECT, ord("["): ARRAY, ord('"'): STRING, ord("t"): BOOL, ord("f"): BOOL,
           ord("n"): NULL, **{ord(c): NUMBER for c in "-0123456789"}}
ABSENT = msgspec.Raw()  # a field not in the body (a JSON value is never empty)


@dataclasses.dataclass(eq=False)
class Shape:
    """The JSON one position of a request may hold. ``free``: anything (``Any``: pydantic makes
    Python objects of it, so ``raw_limits`` bounds its bytes); ``limit``: an array's (or an
    object's, for a ``dict``) most entries; ``entry``: their shape; ``fields``: a model's
    fields (``decoder`` reads them as views of the body, skipping the unknown ones)."""

    kinds: frozenset = frozenset()
    free: bool = False
    limit: Optional[int] = None
    entry: Optional["Shape"] = None
    fields: Optional[dict[str, "Shape"]] = None
    decoder: Optional[msgspec.json.Decoder] = None

    @property
    def numbers_only(self) -> bool:
        """Entries that are numbers only: counted by their commas."""
        return self.entry is not None and self.entry.kinds == {NUMBER} and self.entry.entry is None


def _max_len(metadata) -> Optional[int]:
    for m in metadata:
        if isinstance(m, annotated_types.MaxLen):
            return m.max_length
        if isinstance(m, FieldInfo):
            found = _max_len(m.metadata)
            if found is not None:
                return found
    return None


def _merge(shapes: list[Shape]) -> Shape:
    """A union's shape: any member's kinds; entries of any member's (the largest limit)."""
    out = Shape(kinds=frozenset().union(*(s.kinds for s in shapes)))
    if any(s.free for s in shapes):
        return Shape(kinds=ANY, free=True)
    lists = [s for s in shapes if s.entry is not None]
    if lists:
        limits = [s.limit for s in lists]
        out.limit = None if None in limits else max(limits)
        out.entry = lists[0].entry if len(lists) == 1 else _merge([s.entry for s in lists])
    models = [s for s in shapes if s.fields is not None]
    if len(models) > 1:
        raise TypeError("a union of two models has no one shape")
    if models:
        out.fields, out.decoder = models[0].fields, models[0].decoder
    return out


def shape_of(annotation: Any, metadata: tuple = ()) -> Shape:
    """The shape of values of ``annotation`` (with the constraints in ``metadata``)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *meta = get_args(annotation)
        return shape_of(base, (*metadata, *meta))
    if annotation is Any:
        return Shape(kinds=ANY, free=True)
    if origin in (Union, types.UnionType):
        return _with_limit(_merge([shape_of(a) for a in get_args(annotation)]), metadata)
    if origin in (list, tuple, set, frozenset):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        return Shape(kinds=frozenset({ARRAY}), limit=_bound(annotation, metadata),
                     entry=shape_of(args[0]) if args else Shape(kinds=ANY, free=True))
    if origin is dict:
        return Shape(kinds=frozenset({OBJECT}), limit=_bound(annotation, metadata),
                     entry=shape_of(get_args(annotation)[1]))
    if origin is Literal:
        return _merge([shape_of(type(v)) for v in get_args(annotation)])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return model_shape(annotation)
    if annotation is type(None):
        return Shape(kinds=frozenset({NULL}))
    if annotation is bool:
        return Shape(kinds=frozenset({BOOL}))
    if annotation in (int, float):
        return Shape(kinds=frozenset({NUMBER}))
    if annotation is str:
        return Shape(kinds=frozenset({STRING}))
    raise TypeError(f"no JSON shape for {annotation!r}")


def _bound(annotation: Any, metadata: tuple) -> int:
    """A list's (or dict's) ``max_length``: every one in a request has one (house rule)."""
    limit = _max_len(metadata)
    if limit is None:
        raise TypeError(f"{annotation!r} in a request schema needs a max_length")
    return limit


def _with_limit(shape: Shape, metadata: tuple) -> Shape:
    limit = _max_len(metadata)
    if limit is not None:
        shape.limit = limit
    return shape


@functools.lru_cache(maxsize=None)
def model_shape(model: type[BaseModel]) -> Shape:
    """A model's shape: an object of its fields (by their JSON names), and of the lists the
    model ignores but names in its ``RAW_LISTS`` (name: most entries)."""
    fields = {}
    for name, info in model.model_fields.items():
        fields[info.alias or name] = shape_of(info.annotation, tuple(info.metadata))
    for name, limit in getattr(model, "RAW_LISTS", {}).items():  # ignored, but bounded
        fields[name] = Shape(kinds=ANY, limit=limit, entry=Shape(kinds=ANY))
    struct = msgspec.defstruct(f"{model.__name__}Raw", [(k, msgspec.Raw, ABSENT) for k in fields])
    return Shape(kinds=frozenset({OBJECT}), fields=fields, decoder=msgspec.json.Decoder(struct))


__all__ = ["Shape", "shape_of", "model_shape", "KIND_OF", "ABSENT", "ANY", "OBJECT", "ARRAY",
           "STRING", "NUMBER", "BOOL", "NULL"]

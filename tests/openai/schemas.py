"""A corpus of JSON schemas of the kinds applications send: nested objects, arrays
with bounds, enums, anyOf, string patterns and formats, required and optional fields, numbers with
ranges, $ref. Sizes are bounded (maxLength, maxItems, ranges) so that every output completes
within a small ``max_tokens`` on the CPU suite's small model."""

from __future__ import annotations

S = {"type": "string"}


def obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required}


def text(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


SCHEMAS: dict[str, dict] = {
    "person": obj({"name": text(16), "age": integer(0, 120)}),
    "address": obj({"street": text(24), "city": text(16),
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "order": obj({"order_id": integer(1, 9999), "items": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                      "qty": integer(1, 10)})}}),
    "status_enum": obj({"status": {"enum": ["active", "inactive", "pending"]}}),
    "any_of_scalar": obj({"value": {"anyOf": [integer(-100, 100), text(8)]}}),
    "flags": obj({"enabled": {"type": "boolean"}, "retries": integer(0, 5)}),
    "weather": obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                    "unit": {"enum": ["C", "F"]}}),
    "optional_fields": obj({"title": text(24), "subtitle": text(16),
                            "pages": integer(1, 999)}, required=["title"]),
    "date_format": obj({"event": text(16), "date": {"type": "string", "format": "date"}}),
    "email_pattern": obj({"user": text(12), "email": {
        "type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org|net)$"}}),
    "ipv4_format": obj({"host": {"type": "string", "format": "ipv4"}, "port": integer(1, 65535)}),
    "tags": obj({"tags": {"type": "array", "minItems": 2, "maxItems": 4,
                          "items": {"enum": ["red", "green", "blue", "black"]}}}),
    "nested_user": obj({"user": obj({"id": integer(1, 1000), "profile": obj(
        {"nick": text(12), "verified": {"type": "boolean"}})})}),
    "int_enum": obj({"level": {"enum": [1, 2, 3]}, "label": text(10)}),
    "scores": obj({"scores": {"type": "array", "minItems": 1, "maxItems": 3,
                              "items": integer(0, 100)}}),
    "product": obj({"name": text(16), "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    "currency": {"enum": ["USD", "EUR", "JPY"]}, "in_stock": {"type": "boolean"}}),
    "refs": {"$defs": {"point": obj({"x": integer(-10, 10), "y": integer(-10, 10)})},
             **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    "top_array": {"type": "array", "items": integer(0, 9), "minItems": 1, "maxItems": 4},
    "pattern_code": obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                         "valid": {"type": "boolean"}}),
    "shape_union": obj({"shape": {"anyOf": [
        obj({"kind": {"const": "circle"}, "radius": integer(1, 10)}),
        obj({"kind": {"const": "square"}, "side": integer(1, 10)})]}}),
    "ratio": obj({"count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 500},
                  "ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    "nullable": obj({"note": {"anyOf": [text(10), {"type": "null"}]},
                     "priority": integer(1, 3)}),
    "uuid_format": obj({"id": {"type": "string", "format": "uuid"}}),
}

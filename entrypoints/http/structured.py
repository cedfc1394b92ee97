"""Output constraints and forced tool calls, as OpenAI and vLLM clients send them, turned into
the engine's one :class:`engine.params.StructuredOutputs`; and tool calls shaped back out.

Accepted (at most one of them per request; two are a 400 naming both):

* ``response_format``: ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}}`` (``"text"``: no constraint);
* vLLM's ``structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object"}`` and
  the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``;
* chat ``tools`` with ``tool_choice``:

  - a named function (``{"type": "function", "function": {"name": N}}``), or ``"required"``
    with one tool: the output is that function's ``parameters`` schema, and is returned as the
    call's ``arguments`` text;
  - ``"required"`` with several tools: the output is one JSON object ``{"name": N, "arguments":
    {...}}`` constrained by an ``anyOf`` with one branch per tool (``name`` a ``const``,
    ``arguments`` that tool's parameters); the server splits it into the call's name and its
    ``arguments`` text. One call per choice (no parallel calls).
  - ``"none"``: the tools are ignored. ``"auto"`` (the default when tools are given) is refused:
    deciding between text and a call needs a tool-call format in the model's chat template,
    and the default model's declares none.

  A forced call is answered as ``message.tool_calls`` (``id``, ``type: "function"``,
  ``function: {name, arguments}``, ``content: null``) with ``finish_reason: "tool_calls"`` when
  the grammar completed. Streamed: for a known name the first chunk carries the call's id and
  name and the argument text follows as it is generated; for ``"required"`` with several tools
  the call is sent whole in one chunk when the output is complete.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from engine.errors import BadRequestError
from engine.params import StructuredOutputs

from .protocol import RequestError

MAX_TOOLS = 128


class ToolMode:
    """How a choice's output becomes a tool call: ``name`` is the forced function's (None: the
    output names it, "required" with several tools)."""

    def __init__(self, name: Optional[str]) -> None:
        self.name = name


def _constraint(param: str, **kw) -> StructuredOutputs:
    try:
        return StructuredOutputs(**kw).validate()
    except BadRequestError as exc:
        raise RequestError(str(exc), param=param) from None


def _schema(param: str, schema: Any) -> StructuredOutputs:
    if isinstance(schema, str):
        return _constraint(param, json_schema=schema)
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{param} must be a JSON Schema (an object, or its text)", param=param)
    return _constraint(param, json_schema=schema)


def _from_response_format(rf) -> Optional[StructuredOutputs]:
    t = rf.type
    if t == "text":
        return None
    if t == "json_object":
        return _constraint("response_format", json_object=True)
    if t == "json_schema":
        js = rf.json_schema
        if not isinstance(js, dict) or "schema" not in js and "schema_" not in js:
            raise RequestError("response_format json_schema needs json_schema.schema",
                               param="response_format.json_schema")
        return _schema("response_format.json_schema.schema", js.get("schema", js.get("schema_")))
    raise RequestError(f"response_format type {t!r} is not supported (text, json_object, "
                       f"json_schema)", param="response_format")


def _from_vllm(so: dict, prefix: str) -> list[tuple[str, StructuredOutputs]]:
    found = []
    names = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json_object"}
    for key, kind in names.items():
        v = so.get(key)
        if v is None or (kind == "json_object" and v is False):
            continue
        param = f"{prefix}{key}"
        if kind == "json":
            found.append((param, _schema(param, v)))
        elif kind == "json_object":
            found.append((param, _constraint(param, json_object=v)))
        else:
            found.append((param, _constraint(param, **{kind: v})))
    return found


def constraint_of(body) -> Optional[StructuredOutputs]:
    """The request's one output constraint (or None); a 400 for two, or a bad one."""
    found: list[tuple[str, StructuredOutputs]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        c = _from_response_format(rf)
        if c is not None:
            found.append(("response_format", c))
    so = body.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError("structured_outputs must be an object", param="structured_outputs")
        for unsupported in ("structural_tag",):
            if so.get(unsupported) is not None:
                raise RequestError(f"structured_outputs.{unsupported} is not supported",
                                   param=f"structured_outputs.{unsupported}")
        found += _from_vllm(so, "structured_outputs.")
    found += _from_vllm({"json": body.guided_json, "regex": body.guided_regex,
                         "choice": body.guided_choice, "grammar": body.guided_grammar}, "guided_")
    if len(found) > 1:
        raise RequestError("at most one output constraint per request, got "
                           + " and ".join(p for p, _ in found), param=found[1][0])
    return found[0][1] if found else None


def _tool_functions(tools: list) -> list[dict]:
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise RequestError("each tool must be {\"type\": \"function\", \"function\": {...}}",
                               param=f"tools.[{i}]")
        name = f.get("name")
        if not isinstance(name, str) or not (0 < len(name) <= 64):
            raise RequestError("a tool's function needs a name of 1 to 64 characters",
                               param=f"tools.[{i}].function.name")
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise RequestError("a function's parameters must be a JSON Schema object",
                               param=f"tools.[{i}].function.parameters")
        out.append({"name": name, "parameters": params or {"type": "object"}})
    return out


def tool_plan(tools: Optional[list], tool_choice: Any) -> tuple[Optional[StructuredOutputs],
                                                                Optional[ToolMode]]:
    """(constraint, tool mode) of chat ``tools`` + ``tool_choice``; (None, None) without tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice needs tools", param="tool_choice")
        return None, None
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"at most {MAX_TOOLS} tools", param="tools")
    fns = _tool_functions(tools)
    if tool_choice == "none":
        return None, None
    if tool_choice is None or tool_choice == "auto":
        raise RequestError(
            "tool_choice 'auto' is not supported: this model's chat template declares no "
            "tool-call format to parse; use tool_choice 'required' or name a function "
            "({\"type\": \"function\", \"function\": {\"name\": ...}})", param="tool_choice")
    if tool_choice == "required":
        if len(fns) == 1:
            return _schema("tools.[0].function.parameters", fns[0]["parameters"]), \
                ToolMode(fns[0]["name"])
        branches = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                      "arguments": f["parameters"]},
                     "required": ["name", "arguments"], "additionalProperties": False}
                    for f in fns]
        return _schema("tools", {"anyOf": branches}), ToolMode(None)
    if isinstance(tool_choice, dict):
        f = tool_choice.get("function")
        name = f.get("name") if isinstance(f, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise RequestError("tool_choice must be 'none', 'required' or {\"type\": "
                               "\"function\", \"function\": {\"name\": ...}}", param="tool_choice")
        for i, fn in enumerate(fns):
            if fn["name"] == name:
                return _schema(f"tools.[{i}].function.parameters", fn["parameters"]), ToolMode(name)
        raise RequestError(f"tool_choice names {name!r}, which is not one of the tools",
                           param="tool_choice")
    raise RequestError("tool_choice must be 'none', 'auto', 'required' or a named function",
                       param="tool_choice")


def attach(body, chat: bool) -> None:
    """Read ``body``'s output constraint (and, for chat, its forced tool call) after its
    ``check``: what its ``sampling_params`` and the response then use."""
    constraint = constraint_of(body)
    tools = None
    if chat:
        forced, tools = tool_plan(body.tools, body.tool_choice)
        if forced is not None:
            if constraint is not None:
                raise RequestError("a forced tool call and an output constraint cannot be "
                                   "combined", param="tool_choice")
            constraint = forced
    body._constraint = constraint
    body._tools = tools


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def split_call(mode: ToolMode, text: str) -> Optional[tuple[str, str]]:
    """(name, arguments text) of a finished output; None if it is not a complete call (the
    output was cut short)."""
    if mode.name is not None:
        try:
            json.loads(text)
        except ValueError:
            return None
        return mode.name, text
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    return obj["name"], json.dumps(obj["arguments"], ensure_ascii=False, separators=(",", ":"))


__all__ = ["ToolMode", "attach", "constraint_of", "tool_plan", "split_call", "new_call_id"]

"""raw_limits.check_raw: a body's JSON is checked against its schema's shape before pydantic
turns it into objects. At its limit a list passes both the count and the schema; one entry past
it the count refuses it with a 400 naming the field and the limit (and the schema, where it
bounds the list too, agrees); a value of a kind the schema does not allow is refused naming its
place; a flood of either costs no object per entry."""

import gc
import json
import tracemalloc

import pytest
from pydantic import ValidationError

from engine.params import MAX_BAD_WORDS
from entrypoints.http import protocol as P
from entrypoints.http.raw_limits import COUNTER_MAX, check_raw
from entrypoints.http.raw_shape import ARRAY, model_shape
from entrypoints.http.tokens import DetokenizeRequest, TokenizeRequest

USER = {"role": "user", "content": "x"}
PART = {"type": "text", "text": "x"}
CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _parts(total: int) -> list:
    """Messages with ``total`` content parts in all (4 a message)."""
    return [{"role": "user", "content": [PART] * min(4, total - i)} for i in range(0, total, 4)]


# (schema, param the 400 names, limit, body with n entries, whether the schema bounds it too)
LISTS = [
    (P.ChatCompletionRequest, "messages", P.MAX_MESSAGES, lambda n: {"messages": [USER] * n}, True),
    (TokenizeRequest, "messages", P.MAX_MESSAGES, lambda n: {"messages": [USER] * n}, True),
    (P.ChatCompletionRequest, "messages.[1].content", P.MAX_PARTS,
     lambda n: {"messages": [USER, {"role": "user", "content": [PART] * n}]}, True),
    (P.ChatCompletionRequest, "messages", P.MAX_TOTAL_PARTS,
     lambda n: {"messages": _parts(n)}, False),
    (P.ChatCompletionRequest, "messages.[1].tool_calls", P.MAX_TOOL_CALLS,
     lambda n: {"messages": [USER, {"role": "assistant", "tool_calls": [CALL] * n}]}, False),
    (P.ChatCompletionRequest, "tools", P.MAX_TOOLS,
     lambda n: {"messages": [USER], "tools": [TOOL] * n}, True),
    (P.ChatCompletionRequest, "functions", P.MAX_TOOLS,
     lambda n: {"messages": [USER], "functions": [TOOL["function"]] * n}, True),
    (P.ChatCompletionRequest, "guided_choice", P.MAX_CHOICE,
     lambda n: {"messages": [USER], "guided_choice": ["c"] * n}, True),
    (P.CompletionRequest, "stop", P.MAX_STOP, lambda n: {"prompt": "x", "stop": ["s"] * n}, True),
    (P.CompletionRequest, "stop_token_ids", P.MAX_STOP_TOKEN_IDS,
     lambda n: {"prompt": "x", "stop_token_ids": [1] * n}, True),
    (P.CompletionRequest, "bad_words", MAX_BAD_WORDS,
     lambda n: {"prompt": "x", "bad_words": ["w"] * n}, True),
    (P.CompletionRequest, "logit_bias", P.MAX_LOGIT_BIAS,
     lambda n: {"prompt": "x", "logit_bias": {str(i): 1 for i in range(n)}}, True),
    (P.CompletionRequest, "allowed_token_ids", P.MAX_ALLOWED,
     lambda n: {"prompt": "x", "allowed_token_ids": [1] * n}, True),
    (P.CompletionRequest, "prompt", P.MAX_PROMPTS, lambda n: {"prompt": ["p"] * n}, True),
    (P.CompletionRequest, "prompt", P.MAX_PROMPTS, lambda n: {"prompt": [[1, 2]] * n}, True),
    (P.CompletionRequest, "prompt", P.MAX_PROMPT_TOKENS, lambda n: {"prompt": [1] * n}, True),
    (DetokenizeRequest, "tokens", P.MAX_PROMPT_TOKENS, lambda n: {"tokens": [1] * n}, True),
]
IDS = [f"{schema.__name__}.{param}.{limit}" for schema, param, limit, *_ in LISTS]


def _parse(schema, body: bytes):
    """As the app parses: the raw check, then the schema (narrowed to a long prompt's kind)."""
    return check_raw(body, schema).model_validate_json(body)


@pytest.mark.parametrize("schema, param, limit, make, in_schema", LISTS, ids=IDS)
def test_at_the_limit_passes_and_one_past_is_refused_naming_the_field(schema, param, limit, make,
                                                                      in_schema):
    _parse(schema, json.dumps(make(limit)).encode())
    over = json.dumps(make(limit + 1)).encode()
    with pytest.raises(P.RequestError) as info:
        check_raw(over, schema)
    assert info.value.param == param and info.value.status == 400
    assert str(info.value).startswith(f"{param}: ") and str(limit) in str(info.value)
    if in_schema:  # the schema draws the same line
        with pytest.raises(ValidationError):
            schema.model_validate_json(over)


def _refused(body: bytes, schema=P.ChatCompletionRequest):
    """The refusal of ``body`` and the traced allocation peak while checking it."""
    try:
        check_raw(json.dumps({"messages": [USER] * 300, "tools": [TOOL] * 129}).encode(), schema)
    except P.RequestError:  # the counters are made once
        pass
    gc.collect()
    tracemalloc.start()
    try:
        with pytest.raises(P.RequestError) as info:
            check_raw(body, schema)
        return info, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


EMPTY = b",".join([b"{}"] * 2_700_000)  # 7.7 MiB
ONES = b",".join([b"1"] * 4_000_000)  # 7.6 MiB
C, D = P.CompletionRequest, DetokenizeRequest
FLOODS = [
    ("messages", b'{"messages": [%s]}' % EMPTY, P.ChatCompletionRequest),
    ("messages", b'{"messages": [%s]}' % EMPTY, TokenizeRequest),
    ("messages.[0].content", b'{"messages": [{"role": "user", "content": [%s]}]}' % EMPTY, None),
    ("messages.[2].tool_calls", b'{"messages": [{}, {}, {"tool_calls": [%s]}]}' % EMPTY, None),
    ("messages", b'{"messages": [%s]}' % b",".join([b'{"content": [{}, {}, {}]}'] * 300_000), None),
    ("tools", b'{"tools": [%s]}' % EMPTY, None),
    ("tools.[0]", b'{"tools": [{"function": {"parameters": [%s]}}]}' % EMPTY, None),
    ("guided_json", b'{"guided_json": [%s]}' % EMPTY, None),
    ("guided_choice", b'{"guided_choice": [%s]}' % b",".join([b'""'] * 2_700_000), None),
    ("allowed_token_ids", b'{"allowed_token_ids": [%s]}' % ONES, None),
    ("tokens", b'{"tokens": [%s]}' % ONES, D),
    ("prompt", b'{"prompt": [%s]}' % ONES, C),
    # a value of the wrong kind: pydantic's error keeps it, made Python objects (+391 MB)
    ("max_tokens", b'{"max_tokens": [%s]}' % EMPTY, None),
    ("messages", b'{"messages": {"x": [%s]}}' % EMPTY, None),
    ("messages.[0].role", b'{"messages": [{"role": [%s]}]}' % EMPTY, None),
    ("messages.[0].content", b'{"messages": [{"content": {"x": [%s]}}]}' % EMPTY, None),
    ("messages.[0].content.[0].text", b'{"messages": [{"content": [{"text": [%s]}]}]}' % EMPTY, None),
    ("stream_options.include_usage", b'{"stream_options": {"include_usage": [%s]}}' % EMPTY, None),
    ("stop_token_ids", b'{"stop_token_ids": [1, [%s]]}' % EMPTY, None),
    ("prompt.[1]", b'{"prompt": ["a", [%s]]}' % EMPTY, C),
    ("prompt", b'{"prompt": [1, [%s]]}' % EMPTY, C),
    ("prompt.[1]", b'{"prompt": [[1], {"x": [%s]}]}' % EMPTY, C),
    ("tokens", b'{"tokens": [1, {"x": [%s]}]}' % EMPTY, D),
]


@pytest.mark.parametrize("param, body, schema", FLOODS,
                         ids=[f"{p}-{i}" for i, (p, *_) in enumerate(FLOODS)])
def test_a_flood_is_refused_without_an_object_per_entry(param, body, schema):
    info, peak = _refused(body, schema or P.ChatCompletionRequest)
    assert info.value.param == param, info.value
    # at most a copy of the body (token ids are counted on one), never an object per entry:
    # pydantic alone took 300-680 MB for these (2.7 M messages: +420 MB and 3.6 s)
    assert peak < len(body) + (1 << 20), peak


def test_the_free_form_json_is_bounded_in_bytes_together():
    def body(pad: int) -> dict:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"description": "d" * pad}}}
        return {"messages": [USER], "tools": [tool], "tool_choice": "required"}

    short = body(0)
    size = len(json.dumps(short["tools"][0])) + len(json.dumps(short["tool_choice"]))  # each tool
    at_limit = body(P.MAX_SCHEMA_BYTES - size)
    _parse(P.ChatCompletionRequest, json.dumps(at_limit).encode())
    over = body(P.MAX_SCHEMA_BYTES - size + 1)
    with pytest.raises(P.RequestError) as info:
        check_raw(json.dumps(over).encode(), P.ChatCompletionRequest)
    assert info.value.param == "tool_choice" and str(P.MAX_SCHEMA_BYTES) in str(info.value)


def test_a_batch_is_bounded_in_tokens_together():
    per = P.MAX_BATCH_TOKENS // P.MAX_PROMPTS
    batch = [[1] * per] * P.MAX_PROMPTS
    check_raw(json.dumps({"prompt": batch}).encode(), P.CompletionRequest)
    with pytest.raises(P.RequestError) as info:
        check_raw(json.dumps({"prompt": batch[:-1] + [[1] * (per + 1)]}).encode(), P.CompletionRequest)
    assert info.value.param == "prompt" and str(P.MAX_BATCH_TOKENS) in str(info.value)


@pytest.mark.parametrize("prompt", [
    "t" * 1000, [7] * 1000, ["ab"] * 100, [[1, 2] * 200] * 3, [[1]] * 100 + [[]]])
def test_a_long_prompt_parses_as_through_the_union(prompt):
    body = json.dumps({"prompt": prompt}).encode()
    narrowed = _parse(P.CompletionRequest, body)
    assert type(narrowed) is not P.CompletionRequest or prompt[-1] == []
    union = P.CompletionRequest.model_validate_json(body)
    assert narrowed.model_dump() == union.model_dump()
    assert _outcome(narrowed.check) == _outcome(union.check)


def _outcome(fn):
    try:
        return fn()
    except P.RequestError as exc:
        return exc.param, str(exc)


@pytest.mark.parametrize("prompt, param", [
    ([7] * 300 + ["x"], "prompt"), ([[1]] * 100 + [["x"]], "prompt.[100]"),
    (["a"] * 100 + [3], "prompt.[100]"), ([[1]] * 100 + [[1, {}]], "prompt.[100]")])
def test_a_long_prompt_of_mixed_kinds_is_a_400_naming_the_prompt(prompt, param):
    body = json.dumps({"prompt": prompt}).encode()
    with pytest.raises(P.RequestError) as info:
        check_raw(body, P.CompletionRequest)
    assert info.value.param == param
    with pytest.raises(ValidationError):
        P.CompletionRequest.model_validate_json(body)


def _biggest_valid() -> dict:
    wide = "\U0001F600" * P.MAX_STOP_CHARS  # written as 12-byte surrogate escapes by json.dumps
    return {"prompt": "x", "stop": [wide] * P.MAX_STOP, "bad_words": [wide] * P.MAX_BAD_WORDS,
            "stop_token_ids": [P.MAX_INT] * P.MAX_STOP_TOKEN_IDS,
            "logit_bias": {f"{i:032d}": -99.99999999999999 for i in range(P.MAX_LOGIT_BIAS)},
            "allowed_token_ids": [P.MAX_INT] * P.MAX_ALLOWED, "guided_choice": ["c"] * P.MAX_CHOICE}


def test_the_largest_valid_lists_pass_even_indented():
    body = _biggest_valid()
    _parse(P.CompletionRequest, json.dumps(body, indent=8).encode())
    chat = {"messages": [{"role": "user", "content": [PART] * 2}] * P.MAX_MESSAGES,
            "tools": [TOOL] * P.MAX_TOOLS, "response_format": {"type": "json_schema",
                                                              "json_schema": {"schema": {}}}}
    _parse(P.ChatCompletionRequest, json.dumps(chat, indent=8).encode())


@pytest.mark.parametrize("name, value", [
    ("stop_token_ids", list(range(200_000))), ("stop", ["y" * 100] * 2_000),
    ("bad_words", ["ab"] * 200_000), ("logit_bias", {str(i): 1 for i in range(20_000)})])
def test_too_long_is_refused_without_an_object_per_entry(name, value):
    body = json.dumps({"model": "m", "prompt": "x", name: value}).encode()
    info, peak = _refused(body, P.CompletionRequest)
    assert info.value.param == name and info.value.status == 400
    assert peak < len(body) + 256 * 1024, peak  # pydantic alone: 7.6 MB for the 200,000 ids


@pytest.mark.parametrize("raw", [b"[1, 2]", b"{", b"", b"[" * 100_000, b'{"a": ' * 5000])
def test_what_is_not_a_json_object_is_left_to_the_schema(raw):
    assert check_raw(raw, P.CompletionRequest) is P.CompletionRequest


@pytest.mark.parametrize("schema, body, param", [
    (C, {"prompt": "x", "stop": 5}, "stop"), (C, {"prompt": {"a": 1}}, "prompt"),
    (C, {"prompt": [True]}, "prompt.[0]"), (C, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (C, {"prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias.5"),
    (C, {"prompt": "x", "stop_token_ids": [1, "2"]}, "stop_token_ids"),
    (C, {"prompt": "x", "allowed_token_ids": [1, [2]]}, "allowed_token_ids"),
    (P.ChatCompletionRequest, {"messages": 5}, "messages"),
    (P.ChatCompletionRequest, {"messages": [5]}, "messages.[0]"),
    (P.ChatCompletionRequest, {"messages": [{"role": "u", "content": 7}]}, "messages.[0].content"),
    (P.ChatCompletionRequest, {"messages": [USER], "tools": "x"}, "tools"),
    (P.ChatCompletionRequest, {"messages": [USER], "response_format": []}, "response_format"),
    (TokenizeRequest, {"prompt": ["x"]}, "prompt"),
])
def test_a_value_of_the_wrong_kind_is_refused_naming_its_place(schema, body, param):
    raw = json.dumps(body).encode()
    with pytest.raises(P.RequestError) as info:
        check_raw(raw, schema)
    assert info.value.param == param, info.value
    with pytest.raises(ValidationError):  # the schema refuses it too
        schema.model_validate_json(raw)


def _lists(shape, path="", seen=None):
    """(path, shape) of every list the shape holds."""
    seen = set() if seen is None else seen
    if id(shape) in seen:
        return
    seen.add(id(shape))
    if ARRAY in shape.kinds and not shape.free:
        yield path, shape
    for name, field in (shape.fields or {}).items():
        yield from _lists(field, f"{path}.{name}", seen)
    if shape.entry is not None:
        yield from _lists(shape.entry, f"{path}[]", seen)


@pytest.mark.parametrize("schema", [C, P.ChatCompletionRequest, TokenizeRequest, D])
def test_every_list_of_every_schema_has_a_bound(schema):
    lists = list(_lists(model_shape(schema)))
    assert lists
    for path, shape in lists:
        if shape.entry is not None:  # an array, not a free-form value
            assert shape.limit is not None, path
            # a longer list is counted by its commas: of numbers, or the prompt's union
            assert shape.limit <= COUNTER_MAX or shape.numbers_only or path == ".prompt", path


@pytest.mark.parametrize("prompt", [[[5]] * 300_000, ["a"] * 300_000, ['\\"'] * 300_000])
def test_a_huge_batch_of_prompts_is_refused_before_the_schema(prompt):
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    info, peak = _refused(body, P.CompletionRequest)
    assert info.value.param == "prompt" and "at most 128" in str(info.value)
    assert peak < 64 * 1024 + len(body), peak  # pydantic alone: ~290 MB for [[5]] * 300,000


@pytest.mark.parametrize("prompt", [
    [[5, 6, 7]] * P.MAX_PROMPTS, ['a [ " \\ ] "quoted"'] * P.MAX_PROMPTS, "one [ prompt", [1, 2, 3]])
def test_valid_prompts_pass_the_batch_count(prompt):
    body = json.dumps({"model": "m", "prompt": prompt}, indent=4).encode()
    _parse(P.CompletionRequest, body)


def test_a_schema_with_an_unbounded_list_has_no_shape():
    class Loose(P._Body):
        xs: list[int] = []

    with pytest.raises(TypeError, match="max_length"):
        model_shape(Loose)

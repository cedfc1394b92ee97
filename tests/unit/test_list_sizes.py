"""raw_limits.check_list_sizes: a too-long short list is refused from its JSON's size, before
pydantic turns every entry into a Python object (the soak's frontend memory)."""

import json
import tracemalloc

import pytest

from entrypoints.http import protocol as P
from entrypoints.http.raw_limits import check_list_sizes


def _biggest_valid() -> dict:
    wide = "\U0001F600" * P.MAX_STOP_CHARS  # written as 12-byte surrogate escapes by json.dumps
    return {"prompt": "x", "stop": [wide] * P.MAX_STOP, "bad_words": [wide] * P.MAX_BAD_WORDS,
            "stop_token_ids": [P.MAX_INT] * P.MAX_STOP_TOKEN_IDS,
            "logit_bias": {f"{i:032d}": -99.99999999999999 for i in range(P.MAX_LOGIT_BIAS)}}


def _refused(body: bytes):
    """The refusal of ``body`` and the traced allocation peak while checking it."""
    tracemalloc.start()
    try:
        with pytest.raises(P.RequestError) as info:
            check_list_sizes(body)
        return info, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_largest_valid_lists_pass_even_indented():
    body = _biggest_valid()
    check_list_sizes(json.dumps(body, indent=8).encode())
    P.CompletionRequest.model_validate_json(json.dumps(body))  # and the schema takes them


@pytest.mark.parametrize("name, value", [
    ("stop_token_ids", list(range(200_000))), ("stop", ["y" * 100] * 2_000),
    ("bad_words", ["ab"] * 200_000), ("logit_bias", {str(i): 1 for i in range(20_000)})])
def test_too_long_is_refused_without_an_object_per_entry(name, value):
    body = json.dumps({"model": "m", "prompt": "x", name: value}).encode()
    info, peak = _refused(body)
    assert info.value.param == name and info.value.status == 400
    assert peak < 64 * 1024, peak  # pydantic alone: 7.6 MB for the 200,000 ids


@pytest.mark.parametrize("raw", [b"[1, 2]", b"{", b"", b'{"stop": 5}', b"[" * 100_000])
def test_anything_else_is_left_to_the_schema(raw):
    check_list_sizes(raw)


@pytest.mark.parametrize("prompt", [[[5]] * 300_000, ["a"] * 300_000, ['\\"'] * 300_000])
def test_a_huge_batch_of_prompts_is_refused_before_the_schema(prompt):
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    info, peak = _refused(body)
    assert info.value.param == "prompt" and "at most 128" in str(info.value)
    assert peak < 64 * 1024 + len(body), peak  # pydantic alone: ~290 MB for [[5]] * 300,000


@pytest.mark.parametrize("prompt", [
    [[5, 6, 7]] * P.MAX_PROMPTS, ['a [ " \\ ] "quoted"'] * P.MAX_PROMPTS, "one [ prompt", [1, 2, 3]])
def test_valid_prompts_pass_the_batch_count(prompt):
    body = json.dumps({"model": "m", "prompt": prompt}, indent=4).encode()
    check_list_sizes(body)
    P.CompletionRequest.model_validate_json(body)

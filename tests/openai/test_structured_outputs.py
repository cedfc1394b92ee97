"""Structured outputs on the default model, one engine for the module: a corpus of
JSON schemas (greedy and three seeds, each output parsed and validated with ``jsonschema``),
regex, choice and EBNF outputs; through the real ``openai`` client ``response_format``
json_schema, ``chat.completions.parse`` with a pydantic model, forced tool calls (named and
required, streamed and not); bad constraints of every kind refused with an OpenAI-shaped 400
while the engine serves on; aborts and a drain give every constrained request one terminal
output."""

from __future__ import annotations

import concurrent.futures
import json
import re
import sys
from pathlib import Path

import anyio
import httpx
import jsonschema
import openai
import pydantic
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_helpers import served  # noqa: E402
from schemas import SCHEMAS  # noqa: E402

from engine import AsyncEngine, EngineConfig, SamplingParams, StructuredOutputs  # noqa: E402
from engine.errors import BadRequestError  # noqa: E402

CONFIG = EngineConfig(model="default", dtype="float32", max_num_seqs=128, max_num_batched_tokens=2048)
SEEDS = (1, 2, 3)
FORMATS = jsonschema.FormatChecker()


@pytest.fixture(scope="module")
def server():
    """The app over the default model's AsyncEngine, on a loop of its own (a blocking portal)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with anyio.from_thread.start_blocking_portal() as portal:
        with portal.wrap_async_context_manager(served(CONFIG)) as s:
            s.portal = portal
            yield s
    torch.set_num_threads(threads)


async def _collect(eng, prompt: str, params: SamplingParams) -> tuple[str, list]:
    text, outs = "", []
    async for o in eng.generate(prompt, params):
        text += o.text
        outs.append(o)
    return text, outs


def _run_all(server, jobs: list[tuple[str, SamplingParams]]) -> list[tuple[str, list]]:
    """Every job at once in the shared engine (one batch): [(text, outputs)]."""
    async def main():
        res: list = [None] * len(jobs)

        async def one(k):
            res[k] = await _collect(server.engine, *jobs[k])

        async with anyio.create_task_group() as tg:
            for k in range(len(jobs)):
                tg.start_soon(one, k)
        return res

    return server.portal.call(main)


def _variants(c: StructuredOutputs, max_tokens: int) -> list[SamplingParams]:
    """Greedy, then three seeds sampled."""
    return [SamplingParams(max_tokens=max_tokens, structured=c)] + [
        SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, top_k=50, seed=s,
                       structured=c) for s in SEEDS]


def test_schema_corpus_greedy_and_sampled_outputs_validate(server):
    assert len(SCHEMAS) >= 20
    jobs, names = [], []
    for name, schema in SCHEMAS.items():
        prompt = f"Reply with one JSON value for a {name.replace('_', ' ')} record.\n"
        for p in _variants(StructuredOutputs(json_schema=schema), 96):
            jobs.append((prompt, p))
            names.append(name)
    results = _run_all(server, jobs)
    bad = []
    for name, (params, (text, outs)) in zip(names, zip((p for _, p in jobs), results)):
        last = outs[-1]
        assert sum(o.finished for o in outs) == 1
        try:
            assert last.finish_reason == "stop", (last.finish_reason, last.reason)
            jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=FORMATS)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            bad.append((name, params.seed, text, repr(exc)[:200]))
    assert not bad, bad


REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z ]{1,20}\.",
           r"[A-Z][a-z]{2,8} [0-9]{1,2}, 20[0-9]{2}", r"#[0-9a-f]{6}"]
CHOICES = ["positive", "negative", "neutral"]
#: a small arithmetic grammar (EBNF), bounded so that its sentences end in a few tokens
EBNF = """root ::= expr
expr ::= term (("+" | "-" | "*") term){0,3}
term ::= num | "(" num ("+" | "-") num ")"
num ::= [0-9] | [1-9] [0-9]
"""


def _parse_expr(s: str) -> bool:
    """Recursive descent over :data:`EBNF`'s language (written here to check the outputs
    independently of the grammar engine)."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        m = re.match(r"[1-9][0-9]|[0-9]", s[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    def term() -> bool:
        nonlocal pos
        if s[pos:pos + 1] == "(":
            pos += 1
            if not (num() and s[pos:pos + 1] in ("+", "-")):
                return False
            pos += 1
            if not num() or s[pos:pos + 1] != ")":
                return False
            pos += 1
            return True
        return num()

    if not term():
        return False
    for _ in range(3):
        if s[pos:pos + 1] in ("+", "-", "*"):
            pos += 1
            if not term():
                return False
    return pos == len(s)


def test_regex_choice_and_grammar_outputs(server):
    jobs, checks = [], []
    for rx in REGEXES:
        for p in _variants(StructuredOutputs(regex=rx), 40):
            jobs.append(("Write an example.\n", p))
            checks.append(lambda t, rx=rx: re.fullmatch(rx, t) is not None)
    for p in _variants(StructuredOutputs(choice=CHOICES), 8):
        jobs.append(("The movie was wonderful. Sentiment:", p))
        checks.append(lambda t: t in CHOICES)
    for p in _variants(StructuredOutputs(grammar=EBNF), 40):
        jobs.append(("An arithmetic expression:", p))
        checks.append(_parse_expr)
    deferred = server.engine.core.deferred_steps
    results = _run_all(server, jobs)
    # a constrained batch is never overlapped: each mask needs the token before it taken
    assert server.engine.core.deferred_steps == deferred
    bad = [(p.structured, p.seed, t, outs[-1].finish_reason)
           for (_, p), (t, outs), ok in zip(jobs, results, checks)
           if not (outs[-1].finish_reason == "stop" and ok(t))]
    assert not bad, bad


def test_logprobs_under_a_constraint_are_the_raw_distributions(server):
    """Logprobs stay those of the model's raw distribution (the mask is applied to a copy):
    a constrained greedy token may not be the raw top-1, and its logprob is finite."""
    params = SamplingParams(max_tokens=6, logprobs=True, top_logprobs=3,
                            structured=StructuredOutputs(regex="[0-9]{6}"))
    (text, outs), = _run_all(server, [("The capital of France is", params)])
    lps = [e for o in outs for e in (o.token_logprobs or [])]
    assert re.fullmatch("[0-9]{6}", text) and len(lps) == 6
    assert all(e.logprob is not None and e.logprob > -1e9 and len(e.top_ids) == 3 for e in lps)
    assert any(e.top_ids[0] != e.token_id for e in lps)  # the raw top-1 is not a digit


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(server):
    plain = SamplingParams(max_tokens=8)
    (alone, _), = _run_all(server, [("The capital of France is", plain)])
    mixed = _run_all(server, [("The capital of France is", plain),
                              ("x", SamplingParams(max_tokens=8, structured=StructuredOutputs(
                                  json_schema=SCHEMAS["person"])))])
    assert mixed[0][0] == alone


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


MESSAGES = [{"role": "user", "content": "Give me a person as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": SCHEMAS["weather"] | {"properties": {
        "city": text, **SCHEMAS["weather"]["properties"]}} if (text := {"type": "string",
                                                                           "maxLength": 12}) else {}}}
WEATHER["function"]["parameters"]["required"] = ["city", "temperature", "unit"]
TIME = {"type": "function", "function": {"name": "get_time", "parameters": SCHEMAS["date_format"]}}


def _concurrently(*calls):
    """The calls' results, in order; run on threads at once so they share engine steps."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_openai_client_response_format_and_parse(server):
    oc = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    chat = oc.chat.completions
    kw = dict(model="default", messages=MESSAGES, max_tokens=48, temperature=0)
    schema_fmt = {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMAS["person"], "strict": True}}
    r_schema, r_object, parsed, r_choice, r_regex, r_json, r_ebnf = _concurrently(
        lambda: chat.create(**kw, response_format=schema_fmt),
        lambda: chat.create(**kw, response_format={"type": "json_object"}),
        lambda: chat.parse(**kw, response_format=Person),
        # vLLM's extensions, on both routes
        lambda: oc.completions.create(model="default", prompt="Sentiment of 'great!':",
                                      max_tokens=8, temperature=0,
                                      extra_body={"structured_outputs": {"choice": CHOICES}}),
        lambda: oc.completions.create(model="default", prompt="A phone number:", max_tokens=16,
                                      temperature=0, extra_body={"guided_regex": REGEXES[0]}),
        lambda: chat.create(**kw, extra_body={"guided_json": SCHEMAS["flags"]}),
        lambda: chat.create(**kw, extra_body={"guided_grammar": EBNF}))
    jsonschema.validate(json.loads(r_schema.choices[0].message.content), SCHEMAS["person"])
    assert r_schema.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r_object.choices[0].message.content), dict)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120
    assert r_choice.choices[0].text in CHOICES
    assert re.fullmatch(REGEXES[0], r_regex.choices[0].text)
    jsonschema.validate(json.loads(r_json.choices[0].message.content), SCHEMAS["flags"])
    assert _parse_expr(r_ebnf.choices[0].message.content)


def _args_ok(call, tool) -> None:
    assert call.type == "function" and call.id and call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"],
                        format_checker=FORMATS)


def _streamed_calls(stream) -> tuple[dict, str]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            assert not ch.delta.content
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                c["id"] = tc.id or c["id"]
                if tc.function is not None:
                    c["name"] = tc.function.name or c["name"]
                    c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return calls, finish


def test_openai_client_forced_tool_calls(server):
    """Named, "required" with one tool and with two; each streamed and not (all at once)."""
    oc = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    cases = {"named": ([TIME, WEATHER], {"type": "function", "function": {"name": "get_weather"}}),
             "required_one": ([WEATHER], "required"), "required_two": ([TIME, WEATHER], "required")}

    def kw(case):
        tools, tc = cases[case]
        return dict(model="default", messages=msgs, tools=tools, tool_choice=tc, max_tokens=64,
                    temperature=0)

    calls = [lambda c=c: oc.chat.completions.create(**kw(c)) for c in cases]
    calls += [lambda c=c: _streamed_calls(oc.chat.completions.create(**kw(c), stream=True))
              for c in cases]
    results = _concurrently(*calls)
    for k, case in enumerate(cases):
        tools = cases[case][0]
        ch = results[k].choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None, case
        (call,) = ch.message.tool_calls
        tool = {t["function"]["name"]: t for t in tools}[call.function.name]
        if case != "required_two":
            assert tool is WEATHER
        _args_ok(call, tool)
        streamed, finish = results[len(cases) + k]
        assert finish == "tool_calls" and list(streamed) == [0], case
        c = streamed[0]
        assert c["id"].startswith("call_") and c["name"] == call.function.name
        assert json.loads(c["arguments"]) == json.loads(call.function.arguments)  # greedy


def _post(server, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        return c.post(path, json=body)


CHAT = {"model": "default", "messages": MESSAGES, "max_tokens": 8}
BAD = {
    "schema_not_compiling": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "does not compile"),
    "schema_missing": ("chat", {"response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "x"}}}, "schema"),
    "schema_too_large": ("chat", {"guided_json": {"enum": ["x" * 1000] * 70}}, "json_schema"),
    "schema_too_deep": ("chat", {"guided_json": json.loads('{"items":' * 100 + "{}" + "}" * 100)},
                        "nests deeper"),
    "regex_not_compiling": ("cmpl", {"structured_outputs": {"regex": "(ab"}}, "regex"),
    "regex_too_long": ("cmpl", {"guided_regex": "a" * (16 * 1024 + 1)}, "guided_regex"),
    "grammar_not_compiling": ("cmpl", {"guided_grammar": "root ::= undefined_rule"},
                              "does not compile"),
    "choice_empty": ("cmpl", {"guided_choice": []}, "choice"),
    "choice_too_many": ("cmpl", {"structured_outputs": {"choice": ["a"] * 257}}, "choice"),
    "two_constraints": ("chat", {"guided_regex": "a", "response_format": {"type": "json_object"}},
                        "at most one"),
    "response_format_kind": ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
    "tool_choice_auto": ("chat", {"tools": [WEATHER], "tool_choice": "auto"}, "auto"),
    "tools_without_choice": ("chat", {"tools": [WEATHER]}, "auto"),
    "tool_unknown": ("chat", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "not one of the tools"),
    "tool_bad_parameters": ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objectx"}}}], "tool_choice": "required"},
        "does not compile"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_constraints_are_a_400_and_the_engine_serves_on(server, case):
    route, extra, needle = BAD[case]
    base = CHAT if route == "chat" else {"model": "default", "prompt": "hi", "max_tokens": 8}
    r = _post(server, "/v1/chat/completions" if route == "chat" else "/v1/completions",
              {**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert needle in err["message"] or needle == err["param"], err
    ok = _post(server, "/v1/completions", {"model": "default", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_aborted_constrained_requests_end_once(server):
    """Requests waiting for their grammar and running ones, aborted: one terminal output each."""
    async def main():
        eng = server.engine
        schema = {**SCHEMAS["product"], "title": "abort-test"}  # not cached yet: it compiles
        streams = [eng.generate("x", SamplingParams(max_tokens=64, structured=StructuredOutputs(
            json_schema=schema if k % 2 else SCHEMAS["person"]))) for k in range(6)]
        for s in streams:
            await eng.abort(s.request_id, "test abort")
        ends = []
        for s in streams:
            outs = [o async for o in s]
            assert sum(o.finished for o in outs) == 1 and outs[-1].finished
            ends.append(outs[-1].finish_reason)
        return ends

    assert set(server.portal.call(main)) <= {"abort", "stop", "length"}


def test_dead_end_ends_the_request_not_the_engine(server):
    """A matcher that refuses the sampled token (forced here with an allow-list the grammar
    excludes) ends that request with finish_reason "error"; the engine serves on."""
    tok = server.engine.tokenizer
    x = tok.encode("x", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=4, allowed_token_ids=[x],
                            structured=StructuredOutputs(regex="[0-9]+"))
    (text, outs), (ok, _) = _run_all(server, [("n:", params),
                                              ("hi", SamplingParams(max_tokens=2))])
    assert outs[-1].finish_reason == "error" and "grammar" in outs[-1].reason
    assert text == "" and ok


def test_drain_gives_every_constrained_request_one_terminal_output():
    """On random weights (the mask alone keeps the output valid): a drain with requests
    compiling and running ends each exactly once."""
    async def main():
        cfg = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=256)
        async with AsyncEngine.open(cfg) as eng:
            streams = [eng.generate("ab", SamplingParams(
                max_tokens=200, ignore_eos=False, structured=StructuredOutputs(
                    json_schema={**SCHEMAS["tags"], "description": str(k % 3)})))
                for k in range(6)]
            streams.append(eng.generate("ab", SamplingParams(max_tokens=200)))
            ends: dict[str, list] = {s.request_id: [] for s in streams}

            async def read(s):
                async for o in s:
                    ends[s.request_id].append(o.finished)

            async with anyio.create_task_group() as tg:
                for s in streams:
                    tg.start_soon(read, s)
                await anyio.sleep(0.05)
                await eng.drain(0)
        return ends

    ends = anyio.run(main)
    assert all(sum(v) == 1 and v[-1] for v in ends.values()), ends
    with pytest.raises(BadRequestError):
        SamplingParams(structured=StructuredOutputs()).validate()


def test_constraints_over_the_ipc_client():
    """A frontend on an IPC client (as the HTTP processes run): the constraint crosses the wire,
    a bad one comes back as a 400."""
    async def main():
        cfg = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=128)
        async with served(cfg, via="client") as s:
            async with s.http() as c:
                ok = await c.post("/v1/completions", json={
                    "model": "random:tiny-llama", "prompt": "ab", "max_tokens": 16,
                    "guided_regex": "[0-9]{3}x"})
                bad = await c.post("/v1/completions", json={
                    "model": "random:tiny-llama", "prompt": "ab", "max_tokens": 4,
                    "structured_outputs": {"regex": "[0-9"}})
        return ok, bad

    ok, bad = anyio.run(main)
    assert ok.status_code == 200 and re.fullmatch("[0-9]{3}x", ok.json()["choices"][0]["text"])
    assert bad.status_code == 400 and "does not compile" in bad.json()["error"]["message"]

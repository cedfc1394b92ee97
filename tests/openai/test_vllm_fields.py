"""The request fields vLLM's clients send, each implemented as vLLM implements it or refused with
a 400 naming it -- never accepted and ignored: beam search (refused), chat ``echo`` /
``add_generation_prompt`` / ``continue_final_message`` / ``chat_template_kwargs`` / ``tools`` /
``documents`` / a message's ``name`` (what the chat template is rendered with), ``return_token_ids``,
``truncate_prompt_tokens`` with ``truncation_side``, ``max_tokens`` past the context, every bad
``logit_bias`` key, negative seeds, ``stream_options`` usage, ``prompt_logprobs: null`` and
``usage.prompt_tokens_details.cached_tokens``.

On the byte-level ``random:tiny-llama`` in process (its token ids are the prompt's bytes), with a
chat template of the test's own where the template matters, through the engine itself and
through the IPC client (which renders the template itself); the default model's tokenizer
(special tokens, vocabulary strings, its chat template) through a real ``enginecore serve
--http`` process."""

from __future__ import annotations

from contextlib import asynccontextmanager
import json
import sys
from pathlib import Path

import anyio
import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))
from http_helpers import TINY, ServeProcess, served  # noqa: E402

from engine import AsyncEngine  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
USER = [{"role": "user", "content": "hi"}]

#: renders everything a vLLM client can hand the template
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}"
    "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} x={{ c.function.arguments.x }}]"
    "{% endfor %}</{{ m.role }}>{% endfor %}"
    "{% if tools %}[tools:{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
    "{% if documents %}[docs:{% for d in documents %}{{ d.title }};{% endfor %}]{% endif %}"
    "{% if mood is defined %}[mood:{{ mood }}]{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def events(text: str) -> list[dict]:
    """The JSON events of an SSE body (``[DONE]`` left out)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


@asynccontextmanager
async def tiny(via: str = "engine", template=None):
    """TINY served, with ``template`` as its chat template (set before an IPC client connects:
    it gets the template in its handshake); ``s.prompts``: every prompt the frontend submitted."""
    async with AsyncEngine.open(TINY) as eng:
        eng.tokenizer.chat_template = template
        async with served(engine=eng, via=via) as s:
            s.prompts = []
            submit = s.frontend.generate

            def spy(prompt, params, *args, **kw):
                s.prompts.append(prompt)
                return submit(prompt, params, *args, **kw)

            s.frontend.generate = spy
            async with s.http() as c:
                s.c = c
                yield s


async def post(s, path: str, body: dict, status: int = 200) -> dict:
    r = await s.c.post(path, json=body)
    assert r.status_code == status, r.text[:400]
    return r.json()


async def refused(s, path: str, body: dict, param: str) -> str:
    err = (await post(s, path, body, 400))["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err["message"]


def chat(messages=USER, **kw) -> dict:
    return {"messages": messages, "max_tokens": 2, "temperature": 0, **kw}


# --------------------------------------------------------------------------- beam search

@pytest.mark.asyncio
async def test_beam_search_is_refused_naming_the_field():
    async with tiny() as s:
        for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                           ("/v1/chat/completions", chat())):
            msg = await refused(s, path, {**body, "use_beam_search": True}, "use_beam_search")
            assert "beam search" in msg
            await refused(s, path, {**body, "length_penalty": 0.5}, "length_penalty")
            await post(s, path, {**body, "use_beam_search": False, "length_penalty": 1.0})
        assert len(s.prompts) == 2  # nothing refused reached the engine


# --------------------------------------------------------------------------- the chat template

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time"}}]


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["engine", "client"])
async def test_tools_and_message_names_reach_the_template(via):
    msgs = [{"role": "system", "content": "be brief", "name": "rules"},
            {"role": "user", "content": "weather?", "name": "ann"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"x\": 7}"}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    async with tiny(via, TEMPLATE) as s:
        await post(s, "/v1/chat/completions", chat(msgs, tools=TOOLS, tool_choice="none"))
        assert s.prompts[-1] == (
            "<system name=rules>be brief</system><user name=ann>weather?</user>"
            "<assistant>[call get_weather x=7]</assistant><tool id=c1>sunny</tool>"
            "[tools:get_weather;get_time;]<assistant>")
        # a forced call: the model sees the tool it is to call
        await post(s, "/v1/chat/completions", chat(
            USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
        assert s.prompts[-1] == "<user>hi</user>[tools:get_weather;get_time;]<assistant>"
        n = len(s.prompts)
        bad_call = [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]
        await refused(s, "/v1/chat/completions", chat(bad_call),
                      "messages.[0].tool_calls.[0].function.arguments")
        assert len(s.prompts) == n


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["engine", "client"])
async def test_chat_template_kwargs_and_documents_reach_the_template(via):
    async with tiny(via, TEMPLATE) as s:
        await post(s, "/v1/chat/completions", chat(
            documents=[{"title": "A", "text": "a"}], chat_template_kwargs={"mood": "calm"}))
        assert s.prompts[-1] == "<user>hi</user>[docs:A;][mood:calm]<assistant>"
        # /tokenize renders the same way
        r = await post(s, "/tokenize", {"messages": USER, "chat_template_kwargs": {"mood": "x"}})
        assert bytes(r["tokens"]).decode() == "<user>hi</user>[mood:x]<assistant>"
        n = len(s.prompts)
        await refused(s, "/v1/chat/completions", chat(chat_template_kwargs={"messages": []}),
                      "chat_template_kwargs.messages")
        await refused(s, "/v1/chat/completions", chat(chat_template="{{ 1 }}"), "chat_template")
        assert len(s.prompts) == n


def test_the_renderer_matches_transformers():
    """continue_final_message, tools, documents and template arguments rendered as
    transformers' ``apply_chat_template`` renders them (the default model's template, and one
    that reads them all); vocabulary strings as its ``convert_ids_to_tokens``."""
    from transformers import AutoTokenizer

    from engine.loader.gguf_loader import default_model_path, load_gguf
    from engine.loader.tokenizer import render_chat_template

    path = default_model_path()
    ours, hf = load_gguf(path)[2], AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for final in ("The capital of France is", "The capital of France is ", "  Sure  ", "x\n"):
        msgs = [{"role": "user", "content": "Capital?"}, {"role": "assistant", "content": final}]
        assert ours.apply_chat_template(msgs, False, continue_final_message=True) == \
            hf.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    msgs = [{"role": "user", "content": "hi", "name": "ann"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_time", "arguments": {"x": 1}}}]}]
    docs = [{"title": "A", "text": "a"}]
    assert render_chat_template(TEMPLATE, msgs, None, None, tools=TOOLS, documents=docs,
                                template_kwargs={"mood": "calm"}) == \
        hf.apply_chat_template(msgs, chat_template=TEMPLATE, tools=TOOLS, documents=docs,
                               mood="calm", tokenize=False, add_generation_prompt=True)
    ids = ours.encode("hello world, héllo 世界")
    assert ours.token_strings(ids) == hf.convert_ids_to_tokens(ids)


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["engine", "client"])
async def test_add_generation_prompt_and_continue_final_message(via):
    prefill = [*USER, {"role": "assistant", "content": "The answer is "}]
    async with tiny(via, TEMPLATE) as s:
        await post(s, "/v1/chat/completions", chat(add_generation_prompt=False))
        assert s.prompts[-1] == "<user>hi</user>"
        await post(s, "/v1/chat/completions", chat(prefill, add_generation_prompt=False,
                                                   continue_final_message=True))
        # the last message left open (its closing tag dropped); its trailing space kept
        assert s.prompts[-1] == "<user>hi</user><assistant>The answer is "
        await refused(s, "/v1/chat/completions", chat(prefill, continue_final_message=True),
                      "continue_final_message")  # with the generation prompt (the default)
    async with tiny(via) as s:  # no template: "role: content" lines
        await post(s, "/v1/chat/completions", chat(prefill, add_generation_prompt=False,
                                                   continue_final_message=True))
        assert s.prompts[-1] == "user: hi\nassistant: The answer is "


@pytest.mark.asyncio
async def test_chat_echo_repeats_the_last_message_of_the_answers_role():
    prefill = [*USER, {"role": "assistant", "content": "Sure: "}]
    async with tiny() as s:
        kw = dict(add_generation_prompt=False, continue_final_message=True, echo=True,
                  max_tokens=3)
        plain = await post(s, "/v1/chat/completions", chat(prefill, **{**kw, "echo": False}))
        r = await post(s, "/v1/chat/completions", chat(prefill, **kw))
        generated = plain["choices"][0]["message"]["content"]
        assert r["choices"][0]["message"] == {"role": "assistant", "content": "Sure: " + generated}
        body = await s.c.post("/v1/chat/completions", json=chat(prefill, **kw, stream=True))
        got = events(body.text)
        assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert got[1]["choices"][0]["delta"] == {"content": "Sure: "}
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in got) == \
            "Sure: " + generated
        # the answer's role is the last message's without a generation prompt; a user's last
        # message is not the assistant's: nothing to echo after a generation prompt
        plain = await post(s, "/v1/chat/completions", chat())
        r = await post(s, "/v1/chat/completions", chat(echo=True))
        assert r["choices"][0]["message"] == plain["choices"][0]["message"]
        plain = await post(s, "/v1/chat/completions", chat(add_generation_prompt=False))
        r = await post(s, "/v1/chat/completions", chat(echo=True, add_generation_prompt=False))
        assert r["choices"][0]["message"] == {
            "role": "user", "content": "hi" + plain["choices"][0]["message"]["content"]}


# --------------------------------------------------------------------------- token ids

@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["engine", "client"])
async def test_return_token_ids(via):
    async with tiny(via) as s:
        base = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = await post(s, "/v1/completions", {**base, "return_token_ids": True})
        ch = r["choices"][0]
        assert ch["prompt_token_ids"] == list(b"hello") and len(ch["token_ids"]) == 4
        detok = await post(s, "/detokenize", {"tokens": ch["token_ids"]})
        assert detok["prompt"] == ch["text"]
        plain = await post(s, "/v1/completions", base)
        assert "token_ids" not in plain["choices"][0]
        body = await s.c.post("/v1/completions", json={**base, "return_token_ids": True,
                                                       "stream": True})
        got = [e["choices"][0] for e in events(body.text)]
        assert got[0]["prompt_token_ids"] == list(b"hello")
        assert all("prompt_token_ids" not in c for c in got[1:])
        assert [t for c in got for t in c["token_ids"]] == ch["token_ids"]

        r = await post(s, "/v1/chat/completions", chat(max_tokens=4, ignore_eos=True,
                                                       return_token_ids=True))
        prompt = s.prompts[-1]
        assert r["prompt_token_ids"] == list(prompt.encode())
        assert len(r["choices"][0]["token_ids"]) == 4
        body = await s.c.post("/v1/chat/completions", json=chat(
            max_tokens=4, ignore_eos=True, return_token_ids=True, stream=True))
        got = events(body.text)
        assert got[0]["prompt_token_ids"] == list(prompt.encode())  # on the role chunk
        assert [t for e in got[1:] for t in e["choices"][0]["token_ids"]] == \
            r["choices"][0]["token_ids"]


@pytest.mark.asyncio
async def test_truncation_side():
    ids = list(b"abcdefghij")
    async with tiny() as s:
        async def echoed(**kw) -> str:
            r = await post(s, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True,
                                                  "truncate_prompt_tokens": 3, **kw})
            assert r["usage"]["prompt_tokens"] == 3
            return r["choices"][0]["text"][:3]

        assert await echoed() == "hij"  # default: the last k, as vLLM
        assert await echoed(truncation_side="left") == "hij"
        assert await echoed(truncation_side="right") == "abc"
        r = await post(s, "/v1/completions", {"prompt": "abcdefghij", "max_tokens": 1,
                                              "truncate_prompt_tokens": 3, "return_token_ids": True,
                                              "truncation_side": "right"})
        assert r["choices"][0]["prompt_token_ids"] == list(b"abc")
        r = await post(s, "/v1/chat/completions", chat(
            [{"role": "user", "content": "abcdefghij"}], truncate_prompt_tokens=4,
            truncation_side="right"))
        assert r["usage"]["prompt_tokens"] == 4
        limit = s.engine.max_model_len
        r = await post(s, "/v1/completions", {"prompt": ids, "max_tokens": 1,
                                              "truncate_prompt_tokens": -1})
        assert r["usage"]["prompt_tokens"] == len(ids)  # -1: as much as the context holds
        for k in (0, -2, limit + 1):
            await refused(s, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": k},
                          "truncate_prompt_tokens")
        await refused(s, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 3,
                                             "truncation_side": "middle"}, "truncation_side")


# --------------------------------------------------------------------------- usage

@pytest.mark.asyncio
async def test_stream_usage_as_vllm_sends_it():
    async with tiny() as s:
        async def stream(opts) -> list[dict]:
            r = await s.c.post("/v1/chat/completions", json=chat(
                max_tokens=3, ignore_eos=True, stream=True, stream_options=opts))
            return events(r.text)

        # continuous usage needs include_usage too
        got = await stream({"continuous_usage_stats": True})
        assert all("usage" not in e for e in got)
        # include_usage alone: only the last chunk, no "usage": null on the others
        got = await stream({"include_usage": True})
        assert all("usage" not in e for e in got[:-1])
        assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 3
        # both: every chunk, the role chunk included (its prompt tokens, nothing completed)
        got = await stream({"include_usage": True, "continuous_usage_stats": True})
        assert all(e["usage"]["prompt_tokens"] > 0 for e in got)
        assert got[0]["usage"]["completion_tokens"] == 0
        assert [e["usage"]["completion_tokens"] for e in got][-1] == 3


@pytest.mark.asyncio
async def test_prompt_logprobs_null_and_cached_tokens():
    long = "the quick brown fox jumps over the lazy dog " * 4
    async with tiny() as s:
        r = await post(s, "/v1/completions", {"prompt": long, "max_tokens": 1})
        assert r["choices"][0]["prompt_logprobs"] is None  # present, null: not asked for
        assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        r = await post(s, "/v1/completions", {"prompt": long, "max_tokens": 1})
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and cached % 16 == 0 and cached < r["usage"]["prompt_tokens"]
        r = await post(s, "/v1/chat/completions", chat())
        assert "prompt_logprobs" in r and r["prompt_logprobs"] is None
        assert "cached_tokens" in r["usage"]["prompt_tokens_details"]
        body = await s.c.post("/v1/completions", json={
            "prompt": long, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}})
        assert events(body.text)[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


# --------------------------------------------------------------------------- limits and values

@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["engine", "client"])
async def test_max_tokens_past_the_context_is_a_400(via):
    async with tiny(via) as s:
        limit = s.engine.max_model_len
        msg = await refused(s, "/v1/completions", {"prompt": "hi", "max_tokens": limit},
                            "max_tokens")  # a text prompt: the engine counts its tokens
        assert str(limit) in msg
        await refused(s, "/v1/completions", {"prompt": [5] * 10, "max_tokens": limit - 9},
                      "max_tokens")
        await post(s, "/v1/completions", {"prompt": [5] * 10, "max_tokens": limit - 10})
        await refused(s, "/v1/chat/completions", chat(max_tokens=limit), "max_tokens")
        await refused(s, "/v1/chat/completions",
                      {**chat(max_completion_tokens=limit), "max_tokens": None},
                      "max_completion_tokens")
        # no max_tokens: the rest of the context ("user: " ... "\nassistant: ": 18 more bytes)
        long = [{"role": "user", "content": "a" * (limit - 25)}]
        r = await post(s, "/v1/chat/completions", {"messages": long, "temperature": 0,
                                                   "ignore_eos": True})
        assert r["usage"]["prompt_tokens"] == limit - 7
        assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "length"


@pytest.mark.asyncio
async def test_every_bad_logit_bias_key_is_named():
    async with tiny() as s:
        msg = await refused(s, "/v1/completions", {
            "prompt": "hi", "logit_bias": {"x": 1, "5": 2, "-3": 1, "99999": 1}}, "logit_bias")
        assert "'x'" in msg and "'-3'" in msg and "'99999'" in msg and "'5'" not in msg


@pytest.mark.asyncio
async def test_negative_seeds_are_taken():
    async with tiny() as s:
        async def text(seed) -> str:
            r = await post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "seed": seed,
                                                  "temperature": 1.0, "ignore_eos": True})
            return r["choices"][0]["text"]

        a = await text(-1)
        assert a == await text(-1)  # the same generator every time
        assert a == await text(2**63 - 1)  # its residue
        assert await text(-(2**63)) == await text(0)
        await refused(s, "/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed")


# --------------------------------------------------------------------------- the default model

@pytest.fixture(scope="module")
def smol():
    """``enginecore serve --http`` with the default model: its frontend renders chat templates
    and asks the engine's tokenizer over IPC."""
    proc = ServeProcess(model="default")
    try:
        anyio.run(proc.wait_ready, 1, 300.0)
        with httpx.Client(base_url=proc.base_url, timeout=120) as c:
            yield c
    finally:
        proc.cleanup()


def test_echo_of_token_ids_keeps_special_tokens_in_text_tokens_and_offsets(smol):
    from engine.loader.gguf_loader import default_model_path, load_gguf

    tok = load_gguf(default_model_path())[2]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    # (the generated token is special here: kept in the text too)
    r = smol.post("/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 0,
                                           "max_tokens": 1, "temperature": 0,
                                           "skip_special_tokens": False})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"].startswith("<|im_start|>user\nhi<|im_end|>\n")
    joined = "".join(lp["tokens"])
    assert ch["text"] == joined and len(lp["tokens"]) == len(ids) + 1
    offsets = [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets and max(offsets) < len(ch["text"])


def test_tokenize_token_strs_are_vocabulary_tokens(smol):
    r = smol.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert r.json()["token_strs"] == ["hello", "Ġworld"]


def test_continue_final_message_with_the_models_template(smol):
    msgs = [{"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    r = smol.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False,
                                     "continue_final_message": True})
    assert r.status_code == 200, r.text
    text = smol.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.endswith("assistant\nThe capital of France is")  # no end of turn after it
    r = smol.post("/v1/chat/completions", json={
        "messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
        "echo": True, "max_tokens": 3, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"].startswith("The capital of France is ")
    assert body["prompt_token_ids"][-1] != 2  # not <|im_end|>

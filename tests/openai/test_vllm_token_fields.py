"""More request fields vLLM's clients send, as vLLM implements them: ``add_special_tokens``
(completions true, chat false by default: a chat template writes the special tokens itself),
``return_tokens_as_token_ids`` (logprobs name tokens ``token_id:N``), ``priority`` (no priority
scheduling here: only 0, as vLLM without its priority policy) and
``spaces_between_special_tokens`` (the detokenizer has no such option: false refused where it
would matter, with special tokens kept in the text).

On the byte-level ``random:tiny-llama`` in process (its ids are the prompt's bytes; BOS is 256),
with its tokenizer told to add BOS where the test needs special tokens to add, through the
engine itself and through the IPC client."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_fields import USER, chat, events, post, refused, tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
BOS = 256
CHAT, CMPL = "/v1/chat/completions", "/v1/completions"


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["engine", "client"])
async def test_add_special_tokens(via):
    async with tiny(via) as s:
        s.engine.tokenizer.add_bos = True  # the tokenizer now has a special token to add
        base = {"max_tokens": 1, "temperature": 0, "return_token_ids": True}
        # completions: true by default (the engine adds BOS to a text prompt)
        r = await post(s, CMPL, {**base, "prompt": "hi"})
        assert r["choices"][0]["prompt_token_ids"] == [BOS, *b"hi"]
        r = await post(s, CMPL, {**base, "prompt": "hi", "add_special_tokens": False})
        assert r["choices"][0]["prompt_token_ids"] == list(b"hi")
        assert s.prompts[-1] == list(b"hi")  # submitted as ids, without BOS
        # chat: false by default -- the rendered prompt as the template wrote it
        r = await post(s, CHAT, chat(**base))
        rendered = "user: hi\nassistant: "
        assert r["prompt_token_ids"] == list(rendered.encode())
        r = await post(s, CHAT, chat(**base, add_special_tokens=True))
        assert r["prompt_token_ids"] == [BOS, *rendered.encode()]
        assert s.prompts[-1] == rendered
        # /tokenize counts as those routes do
        got = await post(s, "/tokenize", {"messages": USER})
        assert got["tokens"] == list(rendered.encode())
        assert (await post(s, "/tokenize", {"prompt": "hi"}))["tokens"] == [BOS, *b"hi"]
        got = await post(s, "/tokenize", {"messages": USER, "add_special_tokens": True})
        assert got["tokens"][0] == BOS
        await refused(s, CHAT, chat(add_special_tokens="yes"), "add_special_tokens")

    async with tiny(via) as s:  # a tokenizer with nothing to add: the text goes as it is
        await post(s, CMPL, {"prompt": "hi", "max_tokens": 1, "add_special_tokens": False})
        await post(s, CHAT, chat())
        assert s.prompts == ["hi", "user: hi\nassistant: "]


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["engine", "client"])
async def test_return_tokens_as_token_ids(via):
    async with tiny(via) as s:
        base = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "logprobs": 2, "return_token_ids": True}
        plain = (await post(s, CMPL, base))["choices"][0]
        r = (await post(s, CMPL, {**base, "return_tokens_as_token_ids": True}))["choices"][0]
        ids = r["token_ids"]
        assert ids == plain["token_ids"] and r["text"] == plain["text"]
        lp = r["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in ids]
        assert lp["token_logprobs"] == plain["logprobs"]["token_logprobs"]
        for top, plain_top, t in zip(lp["top_logprobs"], plain["logprobs"]["top_logprobs"], ids):
            # (ids past 255 have no text here: as text their keys collide, as ids they do not)
            assert f"token_id:{t}" in top and len(top) >= len(plain_top)
            assert all(k.startswith("token_id:") for k in top)
            assert set(plain_top.values()) <= set(top.values())
        # offsets still point into the text
        assert lp["text_offset"] == plain["logprobs"]["text_offset"]
        body = await s.c.post(CMPL, json={**base, "return_tokens_as_token_ids": True,
                                          "stream": True})
        streamed = [t for e in events(body.text) for c in e["choices"]
                    for t in (c["logprobs"] or {}).get("tokens", [])]
        assert streamed == lp["tokens"]

        q = chat(max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=2,
                 return_token_ids=True)
        plain = (await post(s, CHAT, q))["choices"][0]
        r = (await post(s, CHAT, {**q, "return_tokens_as_token_ids": True}))["choices"][0]
        content = r["logprobs"]["content"]
        assert [c["token"] for c in content] == [f"token_id:{t}" for t in r["token_ids"]]
        assert [c["bytes"] for c in content] == [c["bytes"] for c in plain["logprobs"]["content"]]
        assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
        body = await s.c.post(CHAT, json={**q, "return_tokens_as_token_ids": True, "stream": True})
        streamed = [c["token"] for e in events(body.text) for ch in e["choices"]
                    for c in ((ch.get("logprobs") or {}).get("content") or [])]
        assert streamed == [c["token"] for c in content]


@pytest.mark.asyncio
async def test_priority_only_zero():
    async with tiny() as s:
        for path, body in ((CMPL, {"prompt": "hi", "max_tokens": 1}), (CHAT, chat())):
            await post(s, path, {**body, "priority": 0})
            for p in (1, -5, 2**40):
                msg = await refused(s, path, {**body, "priority": p}, "priority")
                assert "priority" in msg
            await refused(s, path, {**body, "priority": 1.5}, "priority")
        assert len(s.prompts) == 2  # nothing refused reached the engine


@pytest.mark.asyncio
async def test_spaces_between_special_tokens():
    async with tiny() as s:
        for path, body in ((CMPL, {"prompt": "hi", "max_tokens": 1}), (CHAT, chat())):
            await post(s, path, {**body, "spaces_between_special_tokens": True})
            # special tokens skipped (the default): nothing to space, as vLLM ignores it then
            await post(s, path, {**body, "spaces_between_special_tokens": False})
            await post(s, path, {**body, "spaces_between_special_tokens": True,
                                 "skip_special_tokens": False})
            await refused(s, path, {**body, "spaces_between_special_tokens": False,
                                    "skip_special_tokens": False}, "spaces_between_special_tokens")
        assert len(s.prompts) == 6

"""OpenAI API conformance through the real ``openai`` package, streamed and not, on the default
model: logprobs (completions and chat) and prompt logprobs checked against a log-softmax of the
model's own logits (``logits_reference``), echo and scoring-only requests, batch prompts as
lm-evaluation-harness sends them, ``n`` with seeds, ``stream_options``, ``logit_bias``; and
hostile values of every new field refused with a 400 before any work is queued."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))
from http_helpers import TINY, served  # noqa: E402

from engine import EngineConfig  # noqa: E402
from entrypoints.http.limits import HttpLimits  # noqa: E402
from logits_reference import Reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")
PROMPT = "The capital of France is"
TOL = 2e-4


@pytest.fixture(scope="module")
def ref():
    r = Reference()
    yield r
    r.close()


def _stream_logprobs(chunks, index=0):
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for ch in c.choices:
            if ch.index == index and ch.logprobs is not None:
                for k in out:
                    out[k] += getattr(ch.logprobs, k)
    return out


def _greedy(ref, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(ref.logits(seq)[-1].argmax()))
    return seq[len(ids):]


def test_openai_client_on_the_default_model(ref):
    tok = ref.tokenizer
    ids = tok.encode(PROMPT)

    async def main():
        async with served(EngineConfig(model="default", dtype="float32")) as s:
            oc = s.openai()
            res = {}
            res["cmpl"] = await oc.completions.create(model="default", prompt=PROMPT, max_tokens=4,
                                                      temperature=0, logprobs=3)
            res["cmpl_stream"] = [c async for c in await oc.completions.create(
                model="default", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})]
            # lm-evaluation-harness loglikelihood: a batch of token-id lists, echo, logprobs 1
            res["lm_eval"] = await oc.completions.create(
                model="default", prompt=[ids, ids[:3]], echo=True, logprobs=1, max_tokens=1,
                temperature=0, seed=1234)
            res["score"] = await oc.completions.create(model="default", prompt=PROMPT, echo=True,
                                                       max_tokens=0, logprobs=0)
            res["plp"] = await oc.completions.create(model="default", prompt=ids, max_tokens=1,
                                                     temperature=0, extra_body={"prompt_logprobs": 2})
            msgs = [{"role": "user", "content": "Name a colour."}]
            res["chat"] = await oc.chat.completions.create(model="default", messages=msgs,
                                                           max_tokens=3, temperature=0,
                                                           logprobs=True, top_logprobs=2)
            res["chat_stream"] = [c async for c in await oc.chat.completions.create(
                model="default", messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                top_logprobs=2, stream=True)]
            res["chat_prompt"] = await s.engine.apply_chat_template(msgs)
            kw = dict(model="default", prompt=["Once upon", "A"], max_tokens=3, n=3, seed=7,
                      temperature=1.0)
            res["n"] = await oc.completions.create(**kw)
            res["n_stream"] = [c async for c in await oc.completions.create(**kw, stream=True)]
            res["chat_n"] = await oc.chat.completions.create(model="default", messages=msgs, n=2,
                                                             max_tokens=2, seed=3, temperature=1.0)
            # n > 1: the first choice's prefill is shared through the prefix cache
            long = " ".join(f"word{i}" for i in range(40))
            before = s.engine.statistics().prefix_cache_hits
            res["shared"] = await oc.completions.create(model="default", prompt=long, n=3,
                                                        max_tokens=2, temperature=0)
            res["shared_hits"] = s.engine.statistics().prefix_cache_hits - before
            res["bias"] = await oc.completions.create(model="default", prompt=PROMPT, max_tokens=3,
                                                      temperature=0, logit_bias={"30": 100})
            res["stop_kept"] = await oc.completions.create(
                model="default", prompt=PROMPT, max_tokens=8, temperature=0, stop=["."],
                extra_body={"include_stop_str_in_output": True})
            res["special"] = [await oc.completions.create(
                model="default", prompt=PROMPT, max_tokens=2, temperature=0,
                logit_bias={"2": 100}, extra_body={"ignore_eos": True, "skip_special_tokens": skip})
                for skip in (True, False)]
            await oc.close()
        return res

    res = anyio.run(main)

    # completions logprobs: tokens, sampled logprobs, top 3 (+ the sampled one), offsets
    c = res["cmpl"].choices[0]
    gen = _greedy(ref, ids, 4)
    lp = c.logprobs
    lsm = ref.logprobs(ids + gen)
    assert lp.tokens == [tok.token_bytes(t).decode("utf-8", "replace") for t in gen]
    assert "".join(lp.tokens) == c.text and len(lp.tokens) == 4
    offs, at = [], 0
    for t in lp.tokens:
        offs.append(at)
        at += len(t)
    assert lp.text_offset == offs
    for m, (t, x, top) in enumerate(zip(gen, lp.token_logprobs, lp.top_logprobs)):
        row = lsm[len(ids) - 1 + m]
        assert x == pytest.approx(row[t].item(), abs=TOL) and t == int(row.argmax())
        want = {tok.token_bytes(i).decode(): v.item() for v, i in zip(*row.topk(3))}
        assert top == pytest.approx(want, abs=TOL)
    # streamed: the same text and logprobs; usage on every chunk, then a usage-only chunk
    chunks = res["cmpl_stream"]
    assert "".join(ch.text for cc in chunks for ch in cc.choices) == c.text
    assert _stream_logprobs(chunks)["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=TOL)
    assert _stream_logprobs(chunks)["text_offset"] == lp.text_offset
    assert all(cc.usage is not None for cc in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert [cc.usage.completion_tokens for cc in chunks[:-1]] == [1, 2, 3, 4]

    # lm-eval: one choice per prompt in order, prompt logprobs (first None), usage summed
    r = res["lm_eval"]
    assert [ch.index for ch in r.choices] == [0, 1]
    for ch, p in zip(r.choices, [ids, ids[:3]]):
        tl = ch.logprobs.token_logprobs
        assert tl[0] is None and len(tl) == len(p) + 1 and ch.logprobs.top_logprobs[0] is None
        assert tl[1:len(p)] == pytest.approx([lsm[j - 1, p[j]].item() for j in range(1, len(p))], abs=TOL)
        assert ch.text.startswith(tok.decode(p))
        for j in range(1, len(p)):  # the greedy token is the top-1 entry
            top = ch.logprobs.top_logprobs[j]
            best = int(lsm[j - 1].argmax())
            assert max(top, key=top.get) == tok.token_bytes(best).decode("utf-8", "replace")
    assert r.usage.prompt_tokens == len(ids) + 3 and r.usage.completion_tokens == 2

    # scoring only: the prompt echoed, no token generated
    r = res["score"]
    assert r.choices[0].text == PROMPT and r.usage.completion_tokens == 0
    assert r.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        [lsm[j - 1, ids[j]].item() for j in range(1, len(ids))], abs=TOL)

    # vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}}, first None
    plp = res["plp"].choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for j in range(1, len(ids)):
        assert plp[j][str(ids[j])]["logprob"] == pytest.approx(lsm[j - 1, ids[j]].item(), abs=TOL)
        for i in lsm[j - 1].topk(2).indices.tolist():
            assert str(i) in plp[j]

    # chat: content[] with token, logprob, bytes, top_logprobs; streamed the same
    chat_ids = tok.encode(res["chat_prompt"])
    content = res["chat"].choices[0].logprobs.content
    clsm = ref.logprobs(chat_ids + _greedy(ref, chat_ids, 3))
    for m, e in enumerate(content):
        row = clsm[len(chat_ids) - 1 + m]
        assert e.logprob == pytest.approx(row.max().item(), abs=TOL)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(row.topk(2).values.tolist(), abs=TOL)
    streamed = [e for cc in res["chat_stream"] for ch in cc.choices if ch.logprobs
                for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOL)

    # n with a seed: indices prompt-major; repeatable: the streamed run has the same choices
    a = res["n"]
    assert [ch.index for ch in a.choices] == list(range(6))
    by_index = {}
    for cc in res["n_stream"]:
        for ch in cc.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + ch.text
    assert by_index == {ch.index: ch.text for ch in a.choices}
    assert a.usage.completion_tokens == 18 and a.usage.prompt_tokens == len(tok.encode("Once upon")) + 1
    assert [ch.index for ch in res["chat_n"].choices] == [0, 1]
    n_long = res["shared"].usage.prompt_tokens
    assert res["shared_hits"] >= 2 * (n_long // 16) * 16 > 0
    assert len({ch.text for ch in res["shared"].choices}) == 1  # greedy: all the same
    assert res["stop_kept"].choices[0].text == " Paris."
    assert res["stop_kept"].choices[0].finish_reason == "stop"
    assert [r.choices[0].text for r in res["special"]] == ["", "<|im_end|><|im_end|>"]
    # logit_bias +100 on "." makes it the only choice
    assert res["bias"].choices[0].text == "..."


HOSTILE = [
    ("/v1/completions", {"logprobs": 10**9}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 10**9}, "prompt_logprobs"),
    ("/v1/completions", {"n": 10**6}, "n"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(10**6)}}, "logit_bias"),
    ("/v1/completions", {"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ("/v1/completions", {"stop_token_ids": [5000]}, "stop_token_ids"),
    ("/v1/completions", {"min_p": 2}, "min_p"),
    ("/v1/completions", {"bad_words": ["x"] * 10**5}, "bad_words"),
    ("/v1/completions", {"bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": [[1] * 10**6] * 10}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2]] * 129}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2]] * 100, "n": 3}, "n"),
    ("/v1/chat/completions", {"top_logprobs": 10**9, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"n": 10**6}, "n"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.asyncio
async def test_hostile_values_get_a_400_before_any_work_is_queued():
    limits = HttpLimits(max_body_bytes=64 * 2**20)
    async with served(TINY, limits=limits) as s, s.http() as c:
        for path, extra, param in HOSTILE:
            body = {"model": TINY.model, "max_tokens": 2, **extra}
            body.setdefault("prompt" if "chat" not in path else "messages",
                            "hi" if "chat" not in path else [{"role": "user", "content": "hi"}])
            if "chat" in path:
                body.pop("prompt", None)
            r = await c.post(path, content=msgspec.json.encode(body),
                             headers={"content-type": "application/json"})
            assert r.status_code == 400, (param, r.text[:300])
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"].split(".")[0] == param, err
        st = s.engine.statistics()
        assert st.prompt_tokens == 0 and st.steps == 0  # nothing reached the engine
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "bad_words": ["a", "b c"]})
        assert r.status_code == 200, r.text
        # best_of: the n candidates of highest summed logprob, in order; usage counts all
        r = await c.post("/v1/completions", json={
            "prompt": ["hi", "yo"], "max_tokens": 4, "n": 2, "best_of": 5, "seed": 1,
            "temperature": 1.0, "logprobs": 0, "ignore_eos": True})
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
        sums = [sum(ch["logprobs"]["token_logprobs"]) for ch in body["choices"]]
        assert sums[0] >= sums[1] and sums[2] >= sums[3]
        assert body["usage"]["completion_tokens"] == 2 * 5 * 4


@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["engine", "client"])
async def test_tokenize_detokenize_version_models(via):
    async with served(TINY, via=via) as s, s.http() as c:
        r = await c.post("/tokenize", json={"prompt": "hello", "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == list(b"hello") and body["count"] == 5
        assert body["token_strs"] == list("hello") and body["max_model_len"] > 0
        r = await c.post("/detokenize", json={"tokens": body["tokens"]})
        assert r.status_code == 200 and r.json() == {"prompt": "hello"}
        r = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["count"] > 2
        # the count is what a generation request's usage counts
        g = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
        assert g.json()["usage"]["prompt_tokens"] == 5
        g = await c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 1,
                                                  "truncate_prompt_tokens": 3})
        assert g.json()["usage"]["prompt_tokens"] == 3  # the last 3 tokens only
        g = await c.post("/v1/completions", json={"prompt": [5] * 600, "max_tokens": 1,
                                                  "truncate_prompt_tokens": 10})
        assert g.status_code == 200 and g.json()["usage"]["prompt_tokens"] == 10
        r = await c.post("/detokenize", json={"tokens": [10**6]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = await c.post("/tokenize", json={})
        assert r.status_code == 400
        # logprobs show token ids through the engine's byte table (asked for over IPC once)
        g = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "logprobs": 2})
        lp = g.json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 3 and all(len(t) <= 2 + 1 for t in lp["top_logprobs"])
        g = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2})
        content = g.json()["choices"][0]["logprobs"]["content"]
        table = await s.engine.token_bytes()
        assert len(content) == 3
        for e in [e for x in content for e in (x, *x["top_logprobs"])]:
            assert bytes(e["bytes"]) in table and e["token"] == bytes(e["bytes"]).decode("utf-8", "replace")
        r = await c.get("/version")
        assert r.status_code == 200 and r.json()["version"]
        r = await c.get("/v1/models")
        assert r.json()["data"][0]["max_model_len"] == s.engine.max_model_len

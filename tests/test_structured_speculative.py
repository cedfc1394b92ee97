"""Structured outputs with speculative decoding (engine/structured/bitmask.py): each draft
position's row is masked with the matcher's state after the drafts before it, the matcher is
rolled back, and a draft the grammar refuses is rejected by verification. Greedy outputs are
token-identical to the non-speculative path (n-gram drafts that fit the grammar and drafts that
do not; a draft model), and every output is in the constraint's language."""

from __future__ import annotations

import json
import re

import anyio
import pytest

from engine import AsyncEngine, EngineConfig, SamplingParams, StructuredOutputs

MODEL = "random:tiny-llama"  # byte tokenizer: a byte is a token
REGEX = r"(ab|cd){2,12}x"
SCHEMA = {"type": "object", "properties": {
    "t": {"type": "array", "minItems": 2, "maxItems": 6, "items": {"enum": ["ab", "cd"]}},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["t", "n"]}


def _work() -> list[tuple[list[int], SamplingParams]]:
    rx = StructuredOutputs(regex=REGEX)
    js = StructuredOutputs(json_schema=SCHEMA)
    prompts = [list(b"abababababababab"),  # n-gram drafts the grammar takes
               list(b"cdcdabcdcdabcdcdab"),
               list(b"zzzzzzzzzzzzzzzzzz"),  # drafts it refuses
               list(b'{"t":["ab","cd"],"n":1}{"t":["ab","cd"],"n":1}{"t":["ab"')]
    work = []
    for p in prompts:
        for c in (rx, js):
            work.append((p, SamplingParams(max_tokens=48, structured=c)))
    return work


async def _run(cfg: EngineConfig, work):
    out = {}
    async with AsyncEngine.open(cfg, check_integrity=True) as eng:
        async def one(i, prompt, params):
            toks, text, last = [], "", None
            async for o in eng.generate(prompt, params):
                toks += o.token_ids
                text += o.text
                last = o
            out[i] = (toks, text, last.finish_reason)

        async with anyio.create_task_group() as tg:
            for i, (p, sp) in enumerate(work):
                tg.start_soon(one, i, p, sp)
        stats = eng.statistics()
    return out, stats


@pytest.mark.parametrize("spec", [dict(speculator="ngram", num_speculative_tokens=4),
                                  dict(speculator="draft", draft_model=MODEL)],
                         ids=["ngram", "draft-self"])
def test_constrained_greedy_is_token_identical_with_speculation(spec):
    work = _work()
    base, _ = anyio.run(_run, EngineConfig(model=MODEL, device="cpu"), work)
    got, stats = anyio.run(_run, EngineConfig(model=MODEL, device="cpu", **spec), work)
    assert got == base
    for (_, params), (toks, text, finish) in zip(work, (got[i] for i in range(len(work)))):
        assert finish == "stop", (params.structured, text)
        if params.structured.regex:
            assert re.fullmatch(REGEX, text), text
        else:
            assert set(json.loads(text)) == {"t", "n"}
    assert stats.spec_proposed > 0 and stats.spec_accepted > 0

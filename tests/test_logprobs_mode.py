"""``SamplingParams(logprobs_mode="processed")``: the logprobs of the distribution sampled
from (penalties, biases, temperature, top-k) -- they sum to one over what top-k keeps, the rest
is -inf -- while "raw" stays the model's own distribution; both modes in one batch."""

from __future__ import annotations

import math

import anyio
import pytest

from engine import AsyncEngine, BadRequestError, EngineConfig, SamplingParams

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("torch_one_thread")]

PROMPT = list(range(30, 60))


async def entries(eng, params: SamplingParams) -> list:
    out = []
    async for o in eng.generate(PROMPT, params):
        out += list(o.token_logprobs or [])
    return out


async def test_processed_logprobs_are_of_the_sampled_distribution() -> None:
    cfg = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=64)
    common = dict(max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=5, seed=7,
                  temperature=0.7, top_k=3)
    async with AsyncEngine.open(cfg) as eng:
        res: dict[str, list] = {}

        async def run(mode: str) -> None:
            res[mode] = await entries(eng, SamplingParams(logprobs_mode=mode, **common))

        async with anyio.create_task_group() as tg:  # one batch, both modes
            tg.start_soon(run, "raw")
            tg.start_soon(run, "processed")
        raw, processed = res["raw"], res["processed"]
        assert len(raw) == len(processed) == 8
        assert [e.token_id for e in raw] == [e.token_id for e in processed]  # same seed
        for r, p in zip(raw, processed):
            kept = p.top_logprobs[:3]
            assert math.fsum(math.exp(x) for x in kept) == pytest.approx(1.0, abs=1e-4)
            assert all(x == -math.inf for x in p.top_logprobs[3:])
            assert p.token_id in p.top_ids[:3] and p.logprob > r.logprob
            assert all(math.isfinite(x) for x in r.top_logprobs)
            assert math.fsum(math.exp(x) for x in r.top_logprobs[:3]) < 1.0
            # temperature 0.7 on the kept tokens: log-softmax of raw / 0.7 over the top 3
            scaled = [x / 0.7 for x in r.top_logprobs[:3]]
            norm = max(scaled) + math.log(math.fsum(math.exp(s - max(scaled)) for s in scaled))
            assert kept == pytest.approx([s - norm for s in scaled], abs=1e-4)


async def test_processed_greedy_logprobs_include_the_bias() -> None:
    cfg = EngineConfig(model="random:tiny-llama", device="cpu", num_kv_blocks=64)
    async with AsyncEngine.open(cfg) as eng:
        plain = await entries(eng, SamplingParams(max_tokens=1, logprobs=True, top_logprobs=2))
        favourite = plain[0].top_ids[1]  # the runner-up, pushed to the top by a bias
        biased = dict(max_tokens=1, logprobs=True, top_logprobs=2, logit_bias={favourite: 30.0})
        raw = await entries(eng, SamplingParams(**biased))
        processed = await entries(eng, SamplingParams(logprobs_mode="processed", **biased))
        assert raw[0].token_id == processed[0].token_id == favourite
        assert raw[0].logprob == pytest.approx(plain[0].top_logprobs[1], abs=1e-5)
        assert processed[0].logprob > -1e-3  # the bias made it nearly certain


async def test_logprobs_mode_is_checked() -> None:
    with pytest.raises(BadRequestError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="sampled").validate()

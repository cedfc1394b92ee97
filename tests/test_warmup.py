"""The warm-up at load (engine/core/warmup.py) leaves nothing behind: no request, no KV block,
no prefix-cache entry or counter, no step counted, no generator; seeded and unseeded outputs
are those of an engine without it. On CPU the default is off; here it is turned on, with the
full (CUDA) set of requests, so every sampler path runs."""

from __future__ import annotations

import logging

import anyio
import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.core import warmup
from engine.memory.owner import Resource as R

MODEL = "random:tiny-llama"
PARAMS = [SamplingParams(max_tokens=6, temperature=0.9, top_k=40, seed=11, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True),  # unseeded: global RNG
          SamplingParams(max_tokens=4, logprobs=True, top_logprobs=2, ignore_eos=True)]


def _open_and_run(warm: bool, **kw) -> dict:
    async def main():
        cfg = EngineConfig(model=MODEL, device="cpu", warmup=warm, **kw)
        async with AsyncEngine.open(cfg) as eng:
            runner, core = eng.runner, eng.core
            seen = dict(requests=len(core.requests), free=runner.block_manager.num_free,
                        cache=runner.block_manager.statistics(), steps=runner.steps,
                        generators=len(runner.resource(R.MODEL_STATE).generators),
                        core_steps=core._steps,
                        spec=(runner.speculator.stats() if runner.speculator else None))
            outs = []
            for i, p in enumerate(PARAMS):
                toks, lps = [], []
                async for o in eng.generate([5 + i, 9, 14, 3, 7, 21, 8], p):
                    toks += o.token_ids
                    lps += o.logprobs or []
                outs.append((toks, lps))
            seen["outputs"] = outs
            return seen
    torch.manual_seed(1234)  # unseeded sampling draws from the default generator
    return anyio.run(main)


@pytest.fixture
def full_set(monkeypatch):
    """Every request the CUDA warm-up runs, here on CPU."""
    orig = warmup._variants
    monkeypatch.setattr(warmup, "_variants", lambda _device: orig("cuda"))


@pytest.mark.parametrize("kw", [{}, {"enable_prefix_caching": True, "speculator": "ngram"}],
                         ids=["plain", "prefix+ngram"])
def test_warmup_leaves_nothing_and_changes_no_output(full_set, caplog, kw):
    off = _open_and_run(False, **kw)
    with caplog.at_level(logging.INFO, logger="enginecore.warmup"):
        on = _open_and_run(True, **kw)
    ran = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up:")]
    assert ran and int(ran[0].split()[1]) >= 3, ran  # it did run steps
    assert on["requests"] == 0 and on["generators"] == 0 and on["steps"] == 0
    assert on["core_steps"] == 0
    assert on["free"] == off["free"]  # no block held beyond the baseline
    assert on["cache"] == off["cache"]  # the prefix cache: no entry, no query counted
    assert on["spec"] == off["spec"]
    assert on["outputs"] == off["outputs"]  # seeded, unseeded, logprobs: identical


def test_warmup_default_is_cuda_only():
    assert EngineConfig(device="cpu").warms_up() is False
    assert EngineConfig(device="cuda").warms_up() is True
    assert EngineConfig(device="cpu", warmup=True).warms_up() is True
    assert EngineConfig(device="cuda", warmup=False).warms_up() is False


def test_warmup_off_runs_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="enginecore"):
        _open_and_run(False)
    assert not any(r.getMessage().startswith("warm-up:") for r in caplog.records)
    assert any("ready in" in r.getMessage() and "warm-up off" in r.getMessage()
               for r in caplog.records)

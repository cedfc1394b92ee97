"""The one-pass sampler reading the grammar masks as it draws (``TokenBitmask.grammar_rows``,
``ModelRunner.sample_step``): an engine whose constrained steps take that path gives exactly the
tokens of one that writes -inf into the logits first (``TokenBitmask.mask``) -- greedy and
unseeded sampled rows, regex and JSON grammars, unconstrained requests beside them, overlapped
(late-sampled steps) and synchronous -- and a step that needs the masked logits themselves
(logprobs) still masks them. Run on the CPU under Triton's
interpreter, where both kernels run (tiny-llama: a 512-token vocabulary); the decoder's fused
kernels stay off there (the same logits in both runs, at a quarter of the time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytest.importorskip("xgrammar")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import json, sys
import anyio
import torch
from engine import StructuredOutputs
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.params import SamplingParams
from engine.runner.model_runner import ModelRunner
from engine.structured import bitmask as bm
from engine.structured.grammars import GrammarService
from engine.ops.triton import fused_ops, prefill_attention

# The decoder's own kernels (fused norms, rotary, attention) stay on the torch path: under the
# interpreter they cost ~3/4 of this script's time, and both runs compare the same logits
# anyway (tests/test_fused_ops.py checks those kernels). The two kernels this test is about,
# the one-pass sampler and the mask kernel, still run in the interpreter.
fused_ops.usable = lambda *a, **k: False
prefill_attention.usable = lambda *a, **k: False

REGEX = StructuredOutputs(regex=r"(ab|cd){2,9}x")
SCHEMA = StructuredOutputs(json_schema={"type": "object", "properties": {
    "t": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"enum": ["ab", "cd"]}},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["t", "n"]})
calls = {"fused": 0, "masked": 0}
grammar_rows, mask = bm.TokenBitmask.grammar_rows, bm.TokenBitmask.mask


def counted_rows(self, filling):
    calls["fused"] += 1
    return grammar_rows(self, filling)


def counted_mask(self, logits, filling, copy=True):
    calls["masked"] += bool(filling.rows())
    return mask(self, logits, filling, copy)


bm.TokenBitmask.grammar_rows, bm.TokenBitmask.mask = counted_rows, counted_mask


FUSABLE = bm.TokenBitmask.fusable
GRAMMARS = {}


def run(fuse, overlap, extra):
    # off: every constrained step masks the logits first (as a batch that cannot be fused)
    bm.TokenBitmask.fusable = FUSABLE if fuse else property(lambda self: False)
    torch.manual_seed(1234)  # the unseeded rows' noise: the same steps' seeds in both runs
    r = ModelRunner(EngineConfig(model="random:tiny-llama", device="cpu", dtype="float32",
                                 overlap_scheduling=overlap, max_num_seqs=32, seed=5))
    r.load()
    core = EngineCore(r, check_integrity=True)
    if not GRAMMARS:  # compiled once (a compile pool's worker process costs ~3 s to start)
        svc = GrammarService(lambda: core.tokenizer, lambda: r.model_config.vocab_size)

        async def compile_all():
            return {c.key: await svc.compiled(c) for c in (REGEX, SCHEMA)}

        GRAMMARS.update(anyio.run(compile_all))
        svc.close()
    grammars = GRAMMARS
    for i in range(12):
        prompt = [(i * 13 + j * 7) % 200 + 32 for j in range(4 + i % 9)]
        c = (REGEX, SCHEMA, None)[i % 3]
        kw = dict(temperature=0.9 if i % 2 else 0.0)
        if extra == "logprobs" and i == 4:
            kw["logprobs"] = 2
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6 + (i * 5) % 16,
                         structured=c, **kw), grammars[c.key] if c is not None else None)
    out = {}
    while core.has_work():
        for o in core.step():
            rec = out.setdefault(o.request_id, [[], None])
            rec[0].extend(o.token_ids)
            if o.finished:
                rec[1] = o.finish_reason
    r.shutdown()
    return out


res = {}
for overlap, extra in ((True, ""), (True, "logprobs"), (False, "")):
    if True:
        calls.update(fused=0, masked=0)
        on = run(True, overlap, extra)
        fused_on = dict(calls)
        calls.update(fused=0, masked=0)
        off = run(False, overlap, extra)
        res[f"{overlap}-{extra}"] = {"same": on == off, "on": fused_on, "off": dict(calls),
                                     "stops": sum(f == "stop" for _, f in on.values()),
                                     "n": len(on)}
print(json.dumps(res))
'''


def test_sampler_reading_masks_gives_the_masked_logits_tokens():
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                       timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for key, r in res.items():
        assert r["same"], key
        assert r["n"] == 12 and r["stops"] >= 3, (key, r)
        # off: every constrained step masks the logits; on: the sampler reads the masks,
        # except in a step whose batch asks for logprobs or holds a seeded row
        assert r["off"]["fused"] == 0 and r["off"]["masked"] > 0, (key, r)
        assert r["on"]["fused"] > 0, (key, r)
        if key.endswith("-"):
            assert r["on"]["masked"] == 0, (key, r)
        else:
            assert r["on"]["masked"] > 0, (key, r)

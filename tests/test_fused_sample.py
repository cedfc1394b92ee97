"""The one-pass sampler (engine/ops/triton/fused_sample.py) run by Triton's CPU interpreter: it draws from
softmax(logits / T), takes the first maximum where T <= 0, never picks a refused (-inf) token,
repeats with its seed, and ``engine.sample.sampler.sample`` uses it only for the plain case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = r'''
import json, torch
from engine.ops.triton import fused_sample
from engine.sample.sampler import SamplingBatch, sample, one_pass as _one_pass
torch.manual_seed(0)
out = {}
p = torch.tensor([0.1, 0.2, 0.3, 0.4])
rows = 400
logits = p.log()[None, :].repeat(rows, 1).float()
for t in (1.0, 0.5):
    toks = fused_sample.sample(logits, torch.full((rows,), t), 12345)
    q = p ** (1 / t); q = q / q.sum()
    out[f"freq_{t}"] = (torch.bincount(toks, minlength=4).float() / rows).tolist()
    out[f"want_{t}"] = q.tolist()
# a vocabulary split over several programs: ties, a row of -inf, greedy among sampled rows
l = torch.randn(6, 5000)
l[:, 100] = l[:, 4000] = 9.0
l[3] = float("-inf")
temp = torch.tensor([0.0, 0.8, 0.0, 0.0, 0.8, 0.0])
got = fused_sample.sample(l, temp, 5)
out["splits"] = fused_sample.splits_for(6, 5000)
out["greedy_rows"] = [got[i].item() for i in (0, 2, 3, 5)]
out["greedy_want"] = [l.argmax(-1)[i].item() for i in (0, 2, 3, 5)]
# refused tokens are never drawn; same seed, same tokens; another seed, others
m = torch.zeros(32, 300)
m[:, ::2] = float("-inf")
a = fused_sample.sample(m, torch.ones(32), 9)
out["refused_drawn"] = int((a % 2 == 0).sum())
out["same_seed"] = torch.equal(a, fused_sample.sample(m, torch.ones(32), 9))
out["other_seed_differs"] = not torch.equal(a, fused_sample.sample(m, torch.ones(32), 10))
# engine.sample.sampler.sample: the one pass for temperature alone, the torch path otherwise
def batch(**kw):
    base = dict(temperature=torch.ones(2), top_k=torch.zeros(2, dtype=torch.long), top_p=torch.ones(2),
                generators=[None, None], all_greedy=False, need_logprobs=False,
                any_top_k=False, any_top_p=False, noise_seed=3)
    base.update(kw)
    return SamplingBatch(**base)
x = torch.randn(2, 50)
out["plain"] = _one_pass(x, batch())
out["no_seed"] = _one_pass(x, batch(noise_seed=None))
out["top_k"] = _one_pass(x, batch(any_top_k=True))
out["seeded_row"] = _one_pass(x, batch(generators=[None, torch.Generator().manual_seed(1)]))
out["min_p"] = _one_pass(x, batch(min_p=torch.zeros(2)))
# grammar rows are for the one-pass sampler alone (the runner masks the logits otherwise)
from engine.ops.triton.fused_sample import GrammarRows
rows = GrammarRows(torch.full((2, 2), -1, dtype=torch.int32), None)
for bad in (batch(any_top_k=True), batch(generators=[None, torch.Generator().manual_seed(1)]),
            batch(need_logprobs=True)):
    try:
        sample(x, bad, rows)
        out.setdefault("grammar_refused", []).append(False)
    except ValueError:
        out.setdefault("grammar_refused", []).append(True)
out["grammar_ok"] = torch.equal(sample(x, batch(), rows)[0], fused_sample.sample(x, torch.ones(2), 3))
out["sampled_same_as_kernel"] = torch.equal(sample(x, batch())[0], fused_sample.sample(x, torch.ones(2), 3))
# greedy=True (no noise drawn) gives what zero temperatures give, split (6 rows) or one program
# a row writing the tokens itself (130 rows), with ties, a row of -inf and grammar masks
out["greedy_splits"] = [fused_sample.splits_for(6, 5000, True), fused_sample.splits_for(130, 2100, True),
                        fused_sample.splits_for(130, 2100)]
g = torch.randn(130, 2100)
g[:, 7] = g[:, 2060] = 9.0  # a tie across the two blocks
g[5] = float("-inf")
words = torch.randint(-2**31, 2**31 - 1, (130, 157), dtype=torch.int64).to(torch.int32)  # 157 words: 5000 ids
words[:, 0] |= 1 << 7  # id 7 allowed everywhere: the tie's first column
words[3] = 0  # a row that allows nothing: its first column, as a row of -inf
flags = (torch.arange(130) % 3 == 0).to(torch.int8)
allow = ((words.to(torch.int64)[:, torch.arange(2100) // 32] >> (torch.arange(2100) % 32)) & 1).bool()
masked = g.clone()
masked[~allow] = float("-inf")
flagged = g.clone()
flagged[~allow & flags.bool()[:, None]] = float("-inf")
same = []
for lg in (l, g):
    zero = torch.zeros(lg.shape[0])
    for k, m in enumerate((None, GrammarRows(words[: lg.shape[0]], None), GrammarRows(words[: lg.shape[0]], flags[: lg.shape[0]]))):
        a = fused_sample.sample(lg, zero, 4, m, greedy=True)
        if lg is l:  # zero temperatures, the vocabulary split over 3 programs
            b = fused_sample.sample(lg, zero, 4, m)
        else:  # (the split kernel at zero temperature, masked, is the 6 rows' above: the
            # 130 rows' one program a row against the masked argmax itself, the first maximum)
            b = (g, masked, flagged)[k].argmax(-1)
        same.append(bool(torch.equal(a, b)) and a.dtype == torch.long and a.shape == (lg.shape[0],))
out["greedy_same"] = same
got = fused_sample.sample(g, torch.zeros(130), 4, GrammarRows(words, None), greedy=True)
out["greedy_masked_argmax"] = [got[i].item() == (masked[i].argmax().item() if i != 5 else 0) for i in range(130)].count(False)
# the sampler passes greedy for an all-greedy batch with grammar rows
out["sampler_greedy"] = torch.equal(sample(g, batch(temperature=torch.zeros(130), generators=[None] * 130,
                                               all_greedy=True), GrammarRows(words, None))[0], got)
# 200 sampled rows: one program a row at any temperature too (refused ids never drawn)
big = torch.zeros(200, 300)
big[:, ::2] = float("-inf")
d = fused_sample.sample(big, torch.ones(200), 11)
out["one_sampled"] = [fused_sample.splits_for(200, 300), int((d % 2 == 0).sum()), str(d.dtype)]
print(json.dumps(out))
'''


def test_one_pass_sampler_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("ENGINECORE_FUSED", None)
    p = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env,
                       timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    for t in ("1.0", "0.5"):  # 400 draws: each frequency within 0.1 (4 sigma) of its probability
        assert max(abs(a - b) for a, b in zip(r[f"freq_{t}"], r[f"want_{t}"])) < 0.1, r
    assert r["splits"] == 3
    assert r["greedy_rows"] == r["greedy_want"] == [100, 100, 0, 100]  # first max; -inf row: 0
    assert r["refused_drawn"] == 0 and r["same_seed"] and r["other_seed_differs"]
    assert r["plain"] and not (r["no_seed"] or r["top_k"] or r["seeded_row"] or r["min_p"])
    assert r["sampled_same_as_kernel"]
    # all-allowing grammar rows draw what no rows draw; a batch the one pass does not draw
    # (top-k, a seeded row, logprobs) refuses them
    assert r["grammar_ok"] and r["grammar_refused"] == [True, True, True]
    assert r["greedy_splits"] == [3, 1, 2]
    assert r["greedy_same"] == [True] * 6
    assert r["greedy_masked_argmax"] == 0 and r["sampler_greedy"]
    assert r["one_sampled"] == [1, 0, "torch.int64"]

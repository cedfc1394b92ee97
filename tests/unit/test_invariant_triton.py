"""Deterministic mode's CUDA kernels (engine/ops/triton/invariant.py), run in Triton's CPU
interpreter: the GEMM against ``F.linear`` and the paged attention against the torch reference
(engine/ops/cpu/invariant_attention.py), and for both: a row's bits are the same alone and amid
other rows of other lengths and tables. (On the GPU the same properties are checked in bf16 through
the whole model: tests/gpu/test_gpu_deterministic.py.)"""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECK = r'''
import torch
import torch.nn.functional as F
from engine.ops.triton import invariant as inv, invariant_gemm as ig
from engine.ops.cpu.invariant_attention import attention_torch

assert inv.usable(torch.device("cpu"))
g = torch.Generator().manual_seed(0)
# the GEMM: K not a multiple of the tile, N not either; rows alone and in batches of 3 and 70
w = torch.randn(72, 80, generator=g)
x = torch.randn(70, 80, generator=g)
y = inv.linear(x, w)
assert y.shape == (70, 72) and y.dtype == x.dtype
torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)
for r in (0, 5, 69):
    assert torch.equal(inv.linear(x[r:r + 1], w)[0], y[r]), r
    assert torch.equal(inv.linear(x[max(0, r - 2): r + 1], w)[-1], y[r]), r
b = torch.randn(72, generator=g)
torch.testing.assert_close(inv.linear(x[:4].view(2, 2, 80), w, b), F.linear(x[:4], w, b).view(2, 2, 72),
                           rtol=1e-5, atol=1e-5)
assert inv.linear(x[:0], w).shape == (0, 72)
# K in slices (the o/down projections): one launch gives the slices' products, rounded to x's
# dtype, added in order -- the bits of one GEMM per slice added left to right; alone = amid
# (float16 for the rounding: the interpreter's bfloat16 dot is not usable, numpy has no bfloat16)
for dt in (torch.float32, torch.float16):
    xs, ws = x[:, :64].to(dt), w[:, :64].to(dt)
    parts = inv.partial_products(xs, ws, 4)
    assert parts.shape == (4, 70, 72) and parts.dtype == torch.float32
    for i in range(4):
        assert torch.equal(parts[i], inv.linear(xs[:, 16 * i:16 * (i + 1)].contiguous(),
                                                ws[:, 16 * i:16 * (i + 1)]).float()), (dt, i)
    ref = parts[0] + parts[1] + parts[2] + parts[3]
    summed = inv.linear(xs, ws, parts=4)
    assert summed.dtype == dt and torch.equal(summed, ref.to(dt)), dt
    assert torch.equal(inv.linear(xs[7:8], ws, parts=4)[0], summed[7]), dt
    # a slice a program and a second launch adding them: the bits of one program looping over
    # the slices, rounded (o/down) or not (the K_SPLIT slices), at every row count
    for rounded in (True, False):
        one = inv.linear(xs, ws, parts=4, rounded=rounded, split=False)
        assert torch.equal(inv.linear(xs, ws, parts=4, rounded=rounded, split=True), one), (dt, rounded)
        for rows in ((3, 4), (0, 70), (69, 70)):
            got = inv.linear(xs[rows[0]:rows[1]], ws, parts=4, rounded=rounded)  # by tile count
            assert torch.equal(got, one[rows[0]:rows[1]]), (dt, rounded, rows)
        # the one-loop kernel (prompt-sized launches, not yet on: invariant_gemm.FLAT_ROWS):
        # the same bits
        y = torch.empty(70, 72, dtype=dt)
        ig._gemm_flat_kernel[(2 * 2,)](xs, ws, y, 70, 72, 16, xs.stride(0), ws.stride(0),
                                       y.stride(0), 0, IEEE=dt == torch.float32, PARTS=4,
                                       ROUND=rounded, GROUP_M=8, BM=64, BN=64, BK=16)
        assert torch.equal(y, one), (dt, rounded)
    if dt == torch.float16:  # the rounding is not a no-op
        assert not torch.equal(inv.linear(xs, ws, parts=4, rounded=False), summed)

# the attention: 4 query heads on 2 KV heads, blocks of 4 keys, rows of 1 .. 37 keys
from engine.ops.triton import prefill_attention


def dec(q, cache, tables, lens, scale, **kw):  # every row a decode query
    return inv.attention(q, cache, scale, (torch.arange(len(lens)), tables, lens), **kw)


heads, kv_heads, dim, bs, blocks = 4, 2, 16, 4, 40
cache = torch.randn(2, blocks, bs, kv_heads, dim, generator=g)
lens = torch.tensor([1, 5, 16, 17, 37])
tables = torch.stack([torch.randperm(blocks, generator=g)[:10] for _ in lens])
q = torch.randn(len(lens), heads, dim, generator=g)
out = dec(q, cache, tables, lens, 0.25)
ref = attention_torch(q, cache, tables, lens, 0.25)
torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
for r in range(len(lens)):  # alone, with a table of its own width
    w_r = -(-int(lens[r]) // bs)
    alone = dec(q[r:r + 1], cache, tables[r:r + 1, :w_r], lens[r:r + 1], 0.25)
    assert torch.equal(alone[0], out[r]), r
# a prompt's queries as paged prompt chunks (the prefill kernel's metadata): causal, row j sees
# j + 1 keys; in chunks of 5, 2, 29 and 1 queries (each after the ones before: context), or one
# chunk of 37 (two query tiles of 32); each row's bits are those it gets alone as a decode row
n_q = 37
blk = tables[4].tolist()
ptab = tables[4:5].expand(n_q, -1)
plens = torch.arange(1, n_q + 1)
pq = torch.randn(n_q, heads, dim, generator=g)
tile = inv.query_tile(heads // kv_heads)
assert tile == inv.ROWS // 2
chunked = prefill_attention.build([(0, 5, 5, blk), (5, 2, 7, blk), (7, 29, 36, blk), (36, 1, 37, blk)],
                                  bs, pq.device)
whole = prefill_attention.build([(0, n_q, n_q, blk)], bs, pq.device)
tiled = inv.attention(pq, cache, 0.25, chunks=chunked)
torch.testing.assert_close(tiled, attention_torch(pq, cache, ptab, plens, 0.25), rtol=1e-5, atol=1e-5)
assert torch.equal(inv.attention(pq, cache, 0.25, chunks=whole), tiled)
for r in range(n_q):
    alone = dec(pq[r:r + 1], cache, ptab[r:r + 1], plens[r:r + 1], 0.25)
    assert torch.equal(alone[0], tiled[r]), r
# decode rows and prompt chunks in one step (rows 0-4 decode, 5.. a chunk): each as alone; a
# graph's padded decode row (the scratch block, 1 key) writing into the chunk's first row is
# overwritten by the chunks' launch
mq = torch.cat([q, pq])
pad_tables = torch.cat([tables, torch.full((1, tables.shape[1]), blocks - 1)])
rows = (torch.tensor([0, 1, 2, 3, 4, 5]), pad_tables, torch.cat([lens, torch.tensor([1])]))
mixed = inv.attention(mq, cache, 0.25, rows,
                      prefill_attention.build([(5, n_q, n_q, blk)], bs, pq.device))
assert torch.equal(mixed[:5], out) and torch.equal(mixed[5:], tiled)
# key segments (small here: chunks of 8 keys, segments of 16, so rows of up to 37 keys have 1-3),
# each from an empty state, merged in order: one program going through them, or a program a
# segment (any number of programs) and a second launch merging -- the same bits; alone = amid =
# in a prompt chunk
for dt in (torch.float32, torch.float16):
    qd, cd = q.to(dt), cache.to(dt)
    seg = dec(qd, cd, tables, lens, 0.25, keys=8, segment=16)
    torch.testing.assert_close(seg.float(), ref, rtol=1e-5 if dt == torch.float32 else 2e-2,
                               atol=1e-5 if dt == torch.float32 else 2e-2)
    assert torch.equal(dec(qd, cd, tables, lens, 0.25, keys=8, segment=16, split=True), seg), dt
    r = 4  # the longest row (3 segments), alone
    alone = dec(qd[r:r + 1], cd, tables[r:r + 1], lens[r:r + 1], 0.25, keys=8, segment=16, split=True)
    assert torch.equal(alone[0], seg[r]), dt
tiled = inv.attention(pq, cache, 0.25, chunks=chunked, keys=8, segment=16)
assert torch.equal(tiled, dec(pq, cache, ptab, plens, 0.25, keys=8, segment=16, split=True))
# GQA 3 (padded to 4 heads a program) and float16 (the interpreter's bfloat16 dot is not usable)
q3 = torch.randn(2, 6, dim, generator=g).half()
got = dec(q3, cache.half(), tables[:2], lens[:2], 0.5)
torch.testing.assert_close(got.float(), attention_torch(q3, cache.half(), tables[:2], lens[:2], 0.5).float(),
                           rtol=2e-2, atol=2e-2)
print("ok")
'''


def _interpret(script: str) -> None:
    """Run ``script`` in a fresh interpreter with Triton's CPU interpreter on; it prints "ok"."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "ok"




ENGINE = r'''
import msgspec
from engine import EngineConfig, SamplingParams
from engine.memory.owner import Resource
from engine.testing import check_batch_invariance, load, mixed_jobs

cfg = EngineConfig(model="random:tiny-qwen3", device="cpu", dtype="float32", deterministic=True,
                   max_num_batched_tokens=128)
runner, core = load(cfg)
model = runner._owner[Resource.WEIGHTS]
# the CUDA forward: Triton kernels, paged prompt chunks, q/k/v and gate/up fused, q/k norm + rotary fused
assert model.triton_forward and "Triton" in model.attention_name
assert model.model.layers[0].self_attn.qkv_proj is not None
assert model.model.layers[0].mlp.gate_up_proj is not None
runner.shutdown()
# amid 3 others (one sharing its first half: a cached prefix), prefilled beside their decodes
# in chunks of at most 8 tokens (small: the interpreter runs each program in Python)
cfg = msgspec.structs.replace(cfg, max_num_batched_tokens=8)
prompt = list(range(5, 25))
rep = check_batch_invariance(cfg, prompt, SamplingParams(max_tokens=3, logprobs=True, top_logprobs=2),
                             other_jobs=mixed_jobs(3, 512, prefix=prompt[:10], max_prompt=12,
                                                   max_tokens=3, first_step=1))
assert rep.identical, rep.first_difference
print("ok")
'''


def test_the_kernels_and_the_cuda_forward_in_the_interpreter():
    """The kernels against their references (``CHECK``), then deterministic mode's CUDA forward
    (fused linears, q/k norm + rotary + K/V write in one kernel, paged prompt chunks, the o/down slices in
    one GEMM) on a tiny Qwen3: a request alone = amid others (chunked, beside their decodes, a
    shared prefix cached). One interpreter process for both (its start is seconds)."""
    _interpret(CHECK.replace('print("ok")', "") + ENGINE)

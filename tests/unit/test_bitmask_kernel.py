"""``TokenBitmask._mask_packed`` (the device path: the host rows copied packed, the ids past
them refused by a fill, xgrammar's Triton kernel launched directly) gives exactly what
xgrammar's public ``apply_token_bitmask_inplace`` gives with full-width, zero-padded rows --
run on the CPU under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytest.importorskip("xgrammar")

CHECK = r'''
import random, torch
from engine.structured.bitmask import TokenBitmask, Filling
from xgrammar import apply_token_bitmask_inplace

rnd = random.Random(0)
cases = 0
for vocab, gv, extra, dtype in [(160, 96, 3, torch.float32), (130, 130, 0, torch.float32),
                                (4200, 4128, 5, torch.bfloat16), (64, 32, 0, torch.float32)]:
    for _ in range(3):
        bits = TokenBitmask(8, vocab, torch.device("cpu"), grammar_vocab=gv)
        host = bits.host
        host.copy_(torch.randint(-2**31, 2**31 - 1, host.shape, dtype=torch.int64)
                   .to(torch.int32))
        host[0].zero_()  # a row that allows nothing
        total = rnd.randint(2, 8)
        n = rnd.randint(1, total)
        rows = (list(range(n)) if rnd.random() < 0.5
                else sorted(rnd.sample(range(total), n)))
        logits = torch.randn(total, vocab + extra).to(dtype)
        before = logits.clone()
        for copy in (True, False):
            src = logits.clone()
            got = bits.mask(src, Filling(None, rows), copy=copy)
            assert bits._direct[0] is not None
            assert (got is src) == (not copy)
            if copy:
                assert torch.equal(src, before)
            full = torch.zeros(total, -(-vocab // 32), dtype=torch.int32)
            full[:, : host.shape[1]] = host[:total]
            ref = before.clone()
            apply_token_bitmask_inplace(ref, full, vocab_size=vocab, indices=rows)
            assert torch.equal(got, ref), (vocab, gv, rows, copy)
            cases += 1
print("cases", cases)
'''


def test_packed_kernel_path_equals_xgrammars_function():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "24"


NON_CONTIGUOUS = r'''
import torch
from engine.structured.bitmask import TokenBitmask, Filling
from xgrammar import apply_token_bitmask_inplace

vocab, gv = 160, 96  # host rows 3 words, device rows 5: the packed rows overrun row 0's width
bits = TokenBitmask(4, vocab, torch.device("cpu"), grammar_vocab=gv)
host = bits.host
host.copy_(torch.randint(-2**31, 2**31 - 1, host.shape, dtype=torch.int64,
                         generator=torch.Generator().manual_seed(1)).to(torch.int32))
full = torch.zeros(4, 5, dtype=torch.int32)
full[:, : host.shape[1]] = host
bad = 0
for rows in ([0, 1, 2, 3], [1, 3], [0, 1, 2, 3]):
    bits.mask(torch.randn(4, vocab), Filling(None, rows), copy=False)  # contiguous first
    for copy in (True, False):
        src = torch.randn(vocab, 4).t()  # the same logits, each row's ids strided
        before = src.clone()
        ref = src.contiguous()
        apply_token_bitmask_inplace(ref, full, vocab_size=vocab,
                                    indices=None if len(rows) == 4 else rows)
        got = bits.mask(src, Filling(None, rows), copy=copy)
        bad += not torch.equal(got, ref)
        bad += (got is src) == copy
        bad += copy and not torch.equal(src, before)
print("bad", bad)
'''


@pytest.mark.parametrize("kernel", ["packed", "public"])
def test_logits_with_strided_rows_are_masked_as_dense_ones(kernel):
    """Logits whose rows are not contiguous (``stride(-1) != 1``): masked exactly as a dense
    copy is -- xgrammar's kernels (its Triton one, its C++ CPU one) index a row's ids as
    contiguous, and once the packed path has run the device buffer's rows hold packed words
    past the host width. The caller's logits are left alone with ``copy``."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if kernel == "packed":  # on CPU, xgrammar's Triton kernel under Triton's interpreter
        env.update(TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", NON_CONTIGUOUS], capture_output=True, text=True,
                         env=env, timeout=300, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "0"


def test_row_count_does_not_compile_the_kernel_again():
    """The count of constrained rows changes as requests end: the kernel launched is not
    specialized on it (Triton would compile a variant for 1, for multiples of 16 and for the
    rest -- in the middle of serving), and it is the same body as xgrammar's."""
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import \
        apply_token_bitmask_inplace_kernel as kernel

    from engine.structured.kernels import unspecialized as _unspecialized

    ours = _unspecialized(kernel)
    assert ours is _unspecialized(kernel)  # one JIT function (and its compiled cache) a process
    assert ours.fn is kernel.fn
    assert [p.name for p in ours.params if p.do_not_specialize] == ["num_rows"]
    assert not [p.name for p in kernel.params if p.do_not_specialize]


FUSED = r'''
import random, torch
from engine.ops.triton import fused_sample
from engine.structured.bitmask import TokenBitmask, Filling

rnd = random.Random(1)
cases = 0
for vocab, gv, extra in [(300, 260, 4), (4200, 4128, 0), (96, 96, 0)]:
    for trial in range(4):
        bits = TokenBitmask(8, vocab + extra, torch.device("cpu"), grammar_vocab=gv)
        host = bits.host
        # sparse masks (a grammar's): each word allows a few ids
        host.copy_(torch.randint(-2**31, 2**31 - 1, host.shape, dtype=torch.int64).to(torch.int32)
                   & torch.randint(-2**31, 2**31 - 1, host.shape, dtype=torch.int64).to(torch.int32))
        host[1].zero_()  # a row that allows nothing
        total = rnd.randint(2, 8)
        n = rnd.randint(1, total)
        rows = list(range(n)) if trial % 2 == 0 else sorted(rnd.sample(range(total), n))
        logits = torch.randn(total, vocab + extra) * 3
        temp = torch.tensor([0.0 if rnd.random() < 0.3 else 0.7 for _ in range(total)])
        before = logits.clone()
        grammar = bits.grammar_rows(Filling(None, rows))
        assert (grammar.flags is None) == (rows == list(range(n)))
        got = fused_sample.sample(logits, temp, 77 + trial, grammar)
        assert torch.equal(logits, before)  # read, not written
        ref = bits.mask(before.clone(), Filling(None, rows), copy=False)
        want = fused_sample.sample(ref, temp, 77 + trial)
        assert torch.equal(got, want), (vocab, rows, got, want)
        for r in rows:  # a drawn id is one its mask allows (a row allowing nothing: any)
            t = int(got[r])
            if host[r].any():
                assert t < 32 * host.shape[1] and (int(host[r, t >> 5]) >> (t & 31)) & 1, (r, t)
        cases += 1
print("cases", cases)
'''


def test_sampler_reads_the_masks_as_masking_the_logits_would():
    """``fused_sample.sample`` with ``TokenBitmask.grammar_rows`` draws exactly the tokens it
    draws from logits masked by ``TokenBitmask.mask`` (same seed; rows 0..n-1 and a subset;
    greedy and sampled rows; ids past the grammar's refused), and leaves the logits as they
    are -- under Triton's interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", FUSED], capture_output=True, text=True, env=env,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cases 12" in out.stdout


AFTER_FUSED = r'''
import sys, torch
from engine.ops.triton import fused_sample
from engine.structured.bitmask import TokenBitmask, Filling
from engine.envs import Switches
# nodirect: the ``triton`` kill switch off (xgrammar's public function masks the rows)
switches = Switches(triton=sys.argv[1] != "nodirect")
bits = TokenBitmask(4, 128, torch.device("cpu"), grammar_vocab=40, switches=switches)
# host rows 2 words, dev 4
h = bits.host
h[0] = torch.tensor([1 << 3, 0], dtype=torch.int32)  # row 0 allows id 3 alone
h[1] = -1
print("fusable", bits.fusable)
if bits.fusable:  # a fused step (no logprobs in its batch) packs rows into the device buffer
    g = bits.grammar_rows(Filling(None, [0, 1]))
    assert fused_sample.sample(torch.zeros(2, 128), torch.zeros(2), 1, g).tolist()[0] == 3
logits = torch.zeros(1, 128)
logits[0, 100] = 5.0  # id 100: past the grammar's 40 ids
out = bits.mask(logits, Filling(None, [0]), copy=True)  # the next step asks for logprobs
print("allowed", (out[0] > float("-inf")).nonzero().flatten().tolist())
'''


@pytest.mark.parametrize("mode", ["direct", "no-interpreter", "nodirect"])
def test_a_step_masked_after_a_fused_one_refuses_the_ids_past_the_grammar(mode):
    """The sampler reads the masks only where the device rows are packed (xgrammar's
    kernel launched directly): xgrammar's public function masks full-width rows whose words past
    the grammar's must stay zero, and packed rows left there would let a later step that cannot
    be fused (logprobs, a seeded row) draw ids past the grammar's vocabulary."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    if mode == "no-interpreter":  # on CPU without the interpreter: no Triton kernel can run
        env.pop("TRITON_INTERPRET")
    out = subprocess.run([sys.executable, "-c", AFTER_FUSED, mode], capture_output=True,
                         text=True, env=env, timeout=300, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"fusable {mode == 'direct'}" in out.stdout, out.stdout
    assert "allowed [3]" in out.stdout, out.stdout


def test_device_words_views_are_made_once_and_released_with_the_buffers():
    """``_device_words`` keeps its [n, words] views by row count (one torch call a step, not
    five); the copy is of the host rows as they are now, another host tensor gets views of its
    own, and close() drops the views: they would keep the released buffers' storage alive."""
    import torch

    from engine.memory.owner import storage_bytes
    from engine.structured.bitmask import TokenBitmask

    bits = TokenBitmask(4, 96, torch.device("cpu"), grammar_vocab=64)
    host = bits.host
    host.copy_(torch.arange(host.numel(), dtype=torch.int32).view_as(host))
    a = bits._device_words(3, host)
    host[0, 0] = -5  # a refill between two steps
    b = bits._device_words(3, host)
    assert a is b and torch.equal(b, host[:3]) and int(b[0, 0]) == -5
    other = host.clone() + 7
    assert torch.equal(bits._device_words(3, other), other[:3])
    assert torch.equal(bits._device_words(2, host), host[:2])
    bits.close()
    assert bits._views == {}
    assert sum(storage_bytes(bits).values()) == 0

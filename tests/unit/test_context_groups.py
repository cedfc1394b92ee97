"""Prefill chunks that continue earlier context are batched into padded groups
(engine.model.attention.context_groups): the result equals the per-sequence computation."""

from __future__ import annotations

import random

import pytest
import torch

from engine.model.attention import (AttentionMetadata, PrefillSeq, context_groups, paged_attention,
                                    write_kv)

BS, NB, HKV, H, D = 4, 512, 2, 4, 8


def _case(specs, seed=0):
    """Chunks (n queries, context_len) over shuffled blocks; this step's K/V written."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cache = torch.randn(2, NB, BS, HKV, D)
    free = list(range(NB))
    rng.shuffle(free)
    chunks, row = [], 0
    for n, ctx in specs:
        blocks = [free.pop() for _ in range(-(-ctx // BS))]
        chunks.append((row, n, ctx, blocks))
        row += n
    q, k, v = torch.randn(row, H, D), torch.randn(row, HKV, D), torch.randn(row, HKV, D)
    slots = torch.tensor([b[p // BS] * BS + p % BS for _, n, ctx, b in chunks
                          for p in range(ctx - n, ctx)])
    write_kv(cache, k, v, slots)
    return cache, chunks, q, k, v, slots


@pytest.mark.parametrize("specs", [
    [(3, 10), (1, 5), (7, 7), (20, 30), (2, 2), (5, 9)],  # mixed, one with no earlier context
    [(1, 1)],
    [(64, 200), (1, 3), (1, 70), (2, 41)],  # a long chunk: groups split, padding bounded
    [(16, 16 + 4 * i) for i in range(12)],
])
def test_batched_groups_equal_per_sequence_attention(specs):
    cache, chunks, q, k, v, slots = _case(specs)
    per_seq = [PrefillSeq(r, r + n, ctx, torch.tensor(b)) for r, n, ctx, b in chunks]
    ref = paged_attention(q, k, v, cache, AttentionMetadata(slots, per_seq, None, None, None), 0.3)
    meta = AttentionMetadata(slots, [], None, None, None)
    meta.context_groups = context_groups(chunks, BS, torch.device("cpu"))
    got = paged_attention(q, k, v, cache, meta, 0.3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # every real query row appears exactly once across the groups
    rows = torch.cat([g.rows for g in meta.context_groups]).tolist()
    assert sorted(rows) == list(range(q.shape[0]))


def test_padding_stays_bounded():
    """Sorted by length, no group pads its queries past twice its real ones (plus slack)."""
    specs = [(500, 900)] + [(3, 10 + i) for i in range(30)]
    _, chunks, *_ = _case(specs)
    groups = context_groups(chunks, BS, torch.device("cpu"))
    assert len(groups) >= 2
    for g in groups:
        b, n = g.q_rows.shape
        assert b * n <= 2 * len(g.valid) + 64

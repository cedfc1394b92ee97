"""A step's host-side inputs (engine/forward/step_inputs.py, engine/ops/host_arrays.py, the paged prefill's
tile lists, the prefix cache's block hashes) equal the per-token / per-block definitions they
replace: positions, KV slots, padded block tables, chained hashes."""

from __future__ import annotations

from array import array
import hashlib
import random

from hypothesis import given, settings, strategies as st
import pytest
import torch

from engine.forward.model_state import ModelState
from engine.forward.step_inputs import _extend_slots, eager_rows, packed_forward
from engine.kv.block_hash import chain_hashes
from engine.ops.host_arrays import int32_tensor, long_tensor, padded_rows
from engine.ops.triton import prefill_attention


def _slot(blocks, p, bs):
    return blocks[p // bs] * bs + p % bs


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 4, 16]), st.integers(0, 70), st.integers(0, 70), st.randoms())
def test_slots_are_the_per_token_formula(bs, start, m, rnd):
    blocks = rnd.sample(range(1000), -(-(start + m) // bs) + 1)
    got: list[int] = []
    _extend_slots(got, blocks, start, start + m, bs)
    assert got == [_slot(blocks, p, bs) for p in range(start, start + m)]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=12), max_size=6),
       st.integers(0, 14))
def test_padded_rows(rows, width):
    want = torch.tensor([r[:width] + [0] * (width - len(r[:width])) for r in rows],
                        dtype=torch.long).reshape(len(rows), width)
    got = padded_rows(rows, width)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert torch.equal(long_tensor([r[0] for r in rows if r]),
                       torch.tensor([r[0] for r in rows if r], dtype=torch.long))
    assert int32_tensor([5, -1]).dtype == torch.int32


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12), min_size=1,
                max_size=6), st.integers(0, 14), st.randoms())
def test_padded_rows_from_arrays(rows, width, rnd):
    """Rows given as int32 arrays (host_arrays.block_table), some as lists: the lists' result."""
    import numpy as np

    mixed = [np.array(r, dtype=np.int32) if (i == 0 or rnd.random() < 0.7) else r
             for i, r in enumerate(rows)]
    for dtype in (np.int64, np.int32):
        assert torch.equal(padded_rows(mixed, width, dtype), padded_rows(rows, width, dtype))


def test_block_table_follows_appends_and_other_changes():
    from engine.ops.host_arrays import block_table
    from engine.params import SamplingParams
    from engine.request import Request

    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    assert block_table(r).tolist() == []
    r.block_ids = [7, 3]
    r.block_epoch += 1  # a new list (BlockManager.admit)
    assert block_table(r).tolist() == [7, 3]
    first = r.block_mirror[2]
    for n in range(40):  # appends (BlockManager.grow), past the mirror's room
        r.block_ids += [100 + n]
        assert block_table(r).tolist() == r.block_ids
        assert block_table(r) is block_table(r)  # unchanged: the same view, no copy
    assert r.block_mirror[2] is not first
    del r.block_ids[5:]  # a rollback (BlockManager.advance) then other blocks appended
    r.block_epoch += 1
    r.block_ids += [55, 56]
    assert block_table(r).tolist() == r.block_ids == [7, 3, 100, 101, 102, 55, 56]
    r.block_ids = []  # freed (BlockManager.free)
    r.block_epoch += 1
    assert block_table(r).tolist() == []


def _chain_reference(parent, token_ids, bs):
    out = []
    for i in range(0, len(token_ids) - bs + 1, bs):
        parent = hashlib.blake2b(parent + array("i", token_ids[i:i + bs]).tobytes(),
                                 digest_size=16).digest()
        out.append(parent)
    return out


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=100), st.sampled_from([1, 4, 16]))
def test_chain_hashes_are_blake2b_over_parent_and_int32_tokens(tokens, bs):
    root = b"r" * 16
    assert chain_hashes(root, tokens, bs) == _chain_reference(root, tokens, bs)


def test_prefill_tiles_and_tables():
    rng = random.Random(0)
    bs = 16
    chunks, row = [], 0
    for n, ctx in [(1, 1), (64, 64), (65, 1000), (130, 131), (7, 300)]:
        blocks = rng.sample(range(5000), -(-ctx // bs) + rng.randint(0, 2))
        chunks.append((row, n, ctx, blocks))
        row += n
    got = prefill_attention.build(chunks, bs, torch.device("cpu"))
    tiles = [(j, m0) for j, (_, n, _, _) in enumerate(chunks)
             for m0 in range(0, n, prefill_attention.BLOCK_M)]
    assert got.tile_chunk.tolist() == [j for j, _ in tiles]
    assert got.tile_m0.tolist() == [m for _, m in tiles]
    assert got.q_start.tolist() == [c[0] for c in chunks]
    assert got.q_len.tolist() == [c[1] for c in chunks]
    assert got.ctx_len.tolist() == [c[2] for c in chunks]
    width = max(-(-c[2] // bs) for c in chunks)
    for c, r in zip(chunks, got.block_table.tolist()):
        b = c[3][: -(-c[2] // bs)]
        assert r == b + [0] * (width - len(b))
    assert all(t.dtype == torch.int32 for t in (got.tile_chunk, got.q_len, got.block_table))


@pytest.mark.parametrize("num_chunks", range(1, 10))
def test_prefill_arrays_start_16_byte_aligned(num_chunks):
    """Triton specializes on each pointer's 16-byte alignment: every array of the batch must
    start aligned whatever the counts of chunks and tiles, or a new count class compiles a new
    kernel variant mid-run (~1 s inside a timed H200 run)."""
    bs = 16
    for extra in range(4):  # tile counts of every class mod 4
        chunks, row = [], 0
        for j in range(num_chunks):
            n = 1 + (j == 0) * extra * prefill_attention.BLOCK_M
            chunks.append((row, n, 40 + n, list(range(10))))
            row += n
        got = prefill_attention.build(chunks, bs, torch.device("cpu"))
        assert got.tile_chunk.shape[0] == num_chunks + extra
        for name in ("tile_chunk", "tile_m0", "q_start", "q_len", "ctx_len", "block_table"):
            t = getattr(got, name)
            assert t.data_ptr() % 16 == 0, (name, num_chunks, extra)
        assert got.q_len.tolist() == [c[1] for c in chunks]
        assert got.ctx_len.tolist() == [c[2] for c in chunks]
        assert got.tile_m0.tolist()[:1 + extra] == [m * prefill_attention.BLOCK_M for m in range(1 + extra)]


class _Capture:
    config = None  # no paged prefill: the torch paths' metadata

    def __call__(self, input_ids, positions, kv, meta):
        self.seen = (input_ids.clone(), positions.clone(), meta)
        return torch.zeros(input_ids.shape[0], 4)


def test_packed_forward_inputs():
    bs = 4
    state = ModelState(max_tokens=256, max_seqs=8, max_blocks_per_seq=64,
                       device=torch.device("cpu"))
    rng = random.Random(1)
    # (tokens, start, blocks, as decode rows): decodes, a fresh prompt, a chunk after context
    seqs = []
    for m, start, as_decode in [(1, 37, True), (1, 5, True), (40, 0, False), (9, 23, False),
                                (3, 10, True)]:
        blocks = rng.sample(range(200), -(-(start + m) // bs) + 1)
        seqs.append(([rng.randint(0, 99) for _ in range(m)], start, blocks, as_decode))
    model = _Capture()
    packed_forward(model, torch.zeros(1), state, None, torch.device("cpu"), bs, seqs)
    ids, pos, meta = model.seen
    assert ids.tolist() == [t for s in seqs for t in s[0]]
    assert pos.tolist() == [p for t, s, _, _ in seqs for p in range(s, s + len(t))]
    assert meta.slot_mapping.tolist() == [_slot(b, p, bs) for t, s, b, _ in seqs
                                          for p in range(s, s + len(t))]
    dec = [(b, s + j + 1) for t, s, b, d in seqs if d for j in range(len(t))]
    width = max(len(b) for b, _ in dec)
    assert meta.decode_block_tables.tolist() == [b + [0] * (width - len(b)) for b, _ in dec]
    assert meta.decode_context_lens.tolist() == [n for _, n in dec]
    assert meta.decode_rows.tolist() == [0, 1, 51, 52, 53]


class _PagedCapture(_Capture):
    config = type("Cfg", (), {"head_dim": 16})()  # the paged prefill path (usable() patched)


class _Graphs:
    scratch_slot, scratch_block = 9999, 624

    @staticmethod
    def bucket(n):
        return None

    @staticmethod
    def mixed_rows(t, n_chunks, n_decode):  # prompt steps not graphed (the default)
        return None


def test_eager_rows_are_few_sizes_and_cover():
    sizes = {eager_rows(t) for t in range(1, 8193)}
    assert len(sizes) <= 40
    for t in range(1, 8193):
        r = eager_rows(t)
        assert t <= r and (r - t < 64 or r - t < t / 8), t


@pytest.mark.parametrize("pad", [True, False])
def test_eager_prefill_rows_padded_to_a_few_sizes(monkeypatch, pad):
    """With CUDA graphs (their scratch slot), an eager step with prefill chunks runs at
    ``eager_rows(t)`` rows (cuBLAS picks kernels per row count on the host): padded rows write
    K/V to the scratch slot only, no chunk or decode row names them, and the caller gets ``t``
    rows back."""
    monkeypatch.setattr(prefill_attention, "usable", lambda *a: True)
    bs = 4
    state = ModelState(max_tokens=256, max_seqs=8, max_blocks_per_seq=64,
                       device=torch.device("cpu"))
    seqs = [([5], 9, [3, 4, 7], True), ([1] * 70, 0, list(range(20, 40)), False),
            ([2] * 9, 23, list(range(50, 60)), False)]
    t = 80
    model = _PagedCapture()
    out = packed_forward(model, torch.zeros(1), state, _Graphs() if pad else None,
                         torch.device("cpu"), bs, seqs)
    ids, pos, meta = model.seen
    rows = eager_rows(t) if pad else t
    assert rows == (128 if pad else 80)
    assert out.shape[0] == t and ids.shape[0] == rows and pos.shape[0] == rows
    assert meta.slot_mapping.shape[0] == rows
    assert meta.slot_mapping[t:].tolist() == [_Graphs.scratch_slot] * (rows - t)
    assert ids[:t].tolist() == [x for s in seqs for x in s[0]]
    assert meta.decode_rows.tolist() == [0]
    pb = meta.prefill_batch
    assert pb.q_start.tolist() == [1, 71] and pb.q_len.tolist() == [70, 9]


class _GraphsCapture:
    """A ``CudaGraphs`` stand-in on the CPU: decode steps replay bucket ``bucket`` (padded rows
    attend to the scratch block), steps with prompt chunks the real ``MixedInputs`` views; each
    "replay" keeps the decode block tables it would read."""
    scratch_slot, scratch_block = 9999, 624

    def __init__(self, bucket, mixed=None):
        self._bucket, self.mixed, self.seen = bucket, mixed, None

    def bucket(self, n):
        return self._bucket

    def mixed_rows(self, t, n_chunks, n_decode):
        return None if self.mixed is None else self.mixed.fits(t, n_chunks, n_decode)

    def run(self, bucket, model, kv, state):
        self.seen = state.buffers["block_tables"][:bucket].clone()
        return torch.zeros(bucket, 4)

    def run_mixed(self, rows, model, kv, state, meta):
        self.seen = meta.decode_block_tables.clone()
        return torch.zeros(rows, 4)


def test_graphed_steps_read_the_same_block_tables_from_mirrors(monkeypatch):
    """host_arrays.block_table's mirrors as ``tables`` (read before a rollback, a preemption and
    growth past their room, as the runner reads them every step) give a CUDA-graphed decode
    step (rows padded with the scratch block's list) and a mixed graphed step (the real
    MixedInputs views, on the CPU) the block tables the lists give, row for row."""
    from engine.forward.mixed_inputs import MixedInputs
    from engine.kv.block_manager import BlockManager
    from engine.ops.host_arrays import block_table
    from engine.params import SamplingParams
    from engine.request import Request

    monkeypatch.setattr(prefill_attention, "usable", lambda *a: True)
    bs, nb = 4, 96
    bm = BlockManager(nb, bs, enable_caching=False)
    reqs = []
    for i, n in enumerate((9, 6, 30)):
        r = Request(f"r{i}", [100 * i + j for j in range(n)], SamplingParams(max_tokens=80))
        bm.admit(r, [], -(-n // bs))
        bm.advance(r, n - 1)
        reqs.append(r)
    a, b, c = reqs
    block_table(a)
    bm.grow(a, 3)  # draft rows: read, then rolled back, other blocks taken
    block_table(a)
    bm.advance(a, a.num_computed_tokens)
    block_table(b)
    bm.free(b)  # preempted, then admitted again on other blocks
    b.num_computed_tokens = 0
    bm.grow(a, 3)  # as many blocks as the mirror read before the rollback
    bm.admit(b, [], 2)
    bm.advance(b, 5)
    block_table(c)
    bm.grow(c, 40)  # past the mirror's room
    bm.check_integrity(reqs)
    assert [block_table(r).tolist() for r in reqs] == [r.block_ids for r in reqs]
    decode = [([7], a.num_computed_tokens, a.block_ids, True),
              ([8, 9, 10], b.num_computed_tokens, b.block_ids, True),  # a decode + drafts
              ([11], c.num_computed_tokens, c.block_ids, True)]
    prompt = ([1] * 13, 0, list(range(80, 84)), False)

    def tables_read(seqs, graphs, mirrors):
        state = ModelState(max_tokens=256, max_seqs=8, max_blocks_per_seq=64,
                           device=torch.device("cpu"))
        tables = ([block_table(r) if s[3] else None for r, s in zip(reqs + [None], seqs)]
                  if mirrors else None)
        packed_forward(_PagedCapture(), torch.zeros(1), state, graphs, torch.device("cpu"), bs,
                       seqs, None, tables)
        return graphs.seen

    rows = [a.block_ids, b.block_ids, b.block_ids, b.block_ids, c.block_ids]
    width = max(map(len, rows))
    for seqs, make in ((decode, lambda: _GraphsCapture(8)),
                       (decode + [prompt], lambda: _GraphsCapture(None, MixedInputs(
                           max_tokens=256, max_rows=8, table_width=64,
                           scratch_block=_GraphsCapture.scratch_block, block_size=bs,
                           device=torch.device("cpu"))))):
        got = tables_read(seqs, make(), True)
        assert torch.equal(got, tables_read(seqs, make(), False))
        assert got[:5, :width].tolist() == [r + [0] * (width - len(r)) for r in rows]
        assert got[5:8, 0].tolist() == [_GraphsCapture.scratch_block] * 3

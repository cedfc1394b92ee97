"""engine/ops/cpu/invariant_attention.py's C library: every tensor is checked before a pointer
crosses into C, every row's length and blocks before a key is read; the cache's 16-bit types
convert exactly. (Its invariance: tests/test_deterministic.py.)"""

import pytest
import torch

from engine.ops.cpu import invariant_attention

kern = invariant_attention.module()
pytestmark = pytest.mark.skipif(kern is None, reason="the C++ kernel is not built here")


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 8, 4, 2, 16, generator=g).to(dtype)
    q = torch.randn(3, 4, 16, generator=g)
    tables = torch.tensor([[0, 1, 2], [7, 6, 5], [3, 3, 3]])
    lens = torch.tensor([12, 5, 1])
    return q, cache, tables, lens


def test_good_inputs_run():
    out = kern.invariant_attention(*_inputs(), 0.25)
    assert out.shape == (3, 4, 16) and torch.isfinite(out).all()


@pytest.mark.parametrize("bad", [
    lambda q, c, t, n: (q, c, t, torch.tensor([13, 5, 1])),  # past its table (3 blocks of 4)
    lambda q, c, t, n: (q, c, t, torch.tensor([12, 0, 1])),  # no key
    lambda q, c, t, n: (q, c, torch.tensor([[0, 1, 8], [7, 6, 5], [3, 3, 3]]), n),  # no block 8
    lambda q, c, t, n: (q, c, torch.tensor([[0, 1, 2], [7, -1, 5], [3, 3, 3]]), n),
    lambda q, c, t, n: (q, c, t.int(), n),
    lambda q, c, t, n: (q, c, t, n[:2]),
    lambda q, c, t, n: (q, c, t.t().contiguous().t(), n),  # not contiguous
    lambda q, c, t, n: (q.double(), c, t, n),
    lambda q, c, t, n: (q[:, :3].contiguous(), c, t, n),  # 3 heads over 2 KV heads
    lambda q, c, t, n: (q, c[..., :8].contiguous(), t, n),  # head sizes disagree
    lambda q, c, t, n: (q, c.to(torch.int16), t, n),
    lambda q, c, t, n: (q, c[0], t, n),
    lambda q, c, t, n: (q, c, t, n.to("meta")),
])
def test_bad_inputs_are_refused_before_c_reads_them(bad):
    with pytest.raises(ValueError):
        kern.invariant_attention(*bad(*_inputs()), 0.25)


def test_a_non_finite_scale_is_refused():
    with pytest.raises(ValueError):
        kern.invariant_attention(*_inputs(), float("nan"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_value_converts_exactly(dtype):
    """One key per row: its value comes out times exp(0) / 1 (one rounding-free product each)."""
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    cache = torch.zeros(2, 65536, 1, 1, 1, dtype=dtype)
    cache[1, :, 0, 0, 0] = values
    out = kern.invariant_attention(torch.zeros(65536, 1, 1), cache,
                                   torch.arange(65536)[:, None].contiguous(),
                                   torch.ones(65536, dtype=torch.long), 1.0).view(-1)
    want = values.float()
    want = torch.where(want == 0, torch.zeros_like(want), want)  # 0 + (-0) is +0 in the sum
    assert torch.equal(out.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(out[ok].view(torch.int32), want[ok].view(torch.int32))

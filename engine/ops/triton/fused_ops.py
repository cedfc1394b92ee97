"""Fused decoder kernels in Triton (CUDA only): residual add + RMSNorm, SiLU x mul, and
q/k RMSNorm + rotary + KV-cache write in one launch.

Why by hand: torch has no fused forms of these (``torch.compile`` would generate them, but its
compile time at every start and its guards inside our CUDA graphs cost more than these three
small kernels), and the eager forms launch ~60 element-wise kernels per decoder layer -- at batch
1 a graph replay of Qwen3-0.6B spent most of its ~5 ms on kernel boundaries, not on bytes.

Numerics follow the plain torch path of engine/model/llama.py step for step: every value that the
torch path rounds to the model dtype is rounded here at the same point (residual sums, the
normalized rows before the weight, the weight product, SiLU before the product), and only the
fp32 reductions' order differs. ``tests/gpu/test_gpu_fused.py`` compares the two paths' logits.

The ``fused`` kill switch (engine/envs.py) turns the fused path off where an engine is built.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

try:  # Triton is optional: without it (CPU, CI) the model runs the plain torch path.
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    AVAILABLE = False
#: Triton's CPU interpreter (tests): the kernels may run on CPU tensors
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def usable(x: torch.Tensor, head_dim: int) -> bool:
    """Whether the fused path can run this forward (else the plain torch path)."""
    return (AVAILABLE and (x.is_cuda or INTERPRET)
            and head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, R, W, Y, stride_x, stride_r, stride_y, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:  # s = x + residual, rounded as torch's add; the residual becomes s
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(R.dtype.element_ty)
            tl.store(R + row * stride_r + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        y = (xf * rstd).to(Y.dtype.element_ty)
        w = tl.load(W + cols, mask=mask, other=0.0)
        y = (y.to(tl.float32) * w.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + row * stride_y + cols, y, mask=mask)

    @triton.jit(do_not_specialize=["n"])  # n varies with the batch: one compiled variant
    def _silu_mul_kernel(G, U, O, n, width, stride_in, BLOCK: tl.constexpr):
        # O is [n / width, width], contiguous; G and U rows are ``stride_in`` apart
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        src = (offs // width) * stride_in + offs % width
        g = tl.load(G + src, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + src, mask=mask, other=0.0)
        s = (g / (1.0 + tl.exp(-g))).to(U.dtype.element_ty)
        tl.store(O + offs, (s.to(tl.float32) * u.to(tl.float32)).to(O.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_rope_kv_kernel(Q, K, V, QW, KW, COS, SIN, POS, SLOT, QO, KO, KC, VC,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_ot, stride_oh, stride_kot, stride_koh,
                           stride_cs, stride_ch, stride_tab, num_heads, eps,
                           HAS_NORM: tl.constexpr, HALF: tl.constexpr):
        # one program per (token, head): heads [0, H) are query heads, [H, H + Hkv) key heads
        # (which also carry their value head into the cache)
        t = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, HALF)
        pos = tl.load(POS + t)
        cos = tl.load(COS + pos * stride_tab + d)
        sin = tl.load(SIN + pos * stride_tab + d)
        is_q = h < num_heads
        kh = h - num_heads
        if is_q:
            src = Q + t * stride_qt + h * stride_qh
        else:
            src = K + t * stride_kt + kh * stride_kh
        x1 = tl.load(src + d)
        x2 = tl.load(src + HALF + d)
        if HAS_NORM:  # Qwen3's per-head RMSNorm of q and k, before the rotation
            if is_q:
                wp = QW
            else:
                wp = KW
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF) + eps)
            w1 = tl.load(wp + d).to(tl.float32)
            w2 = tl.load(wp + HALF + d).to(tl.float32)
            x1 = ((f1 * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
            x2 = ((f2 * rstd).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        o1 = (a * cos - b * sin).to(x1.dtype)
        o2 = (b * cos + a * sin).to(x1.dtype)
        if is_q:
            dst = QO + t * stride_ot + h * stride_oh
            tl.store(dst + d, o1)
            tl.store(dst + HALF + d, o2)
        else:
            dst = KO + t * stride_kot + kh * stride_koh
            tl.store(dst + d, o1)
            tl.store(dst + HALF + d, o2)
            slot = tl.load(SLOT + t)
            kc = KC + slot * stride_cs + kh * stride_ch
            tl.store(kc + d, o1.to(KC.dtype.element_ty))
            tl.store(kc + HALF + d, o2.to(KC.dtype.element_ty))
            vs = V + t * stride_vt + kh * stride_vh
            vc = VC + slot * stride_cs + kh * stride_ch
            tl.store(vc + d, tl.load(vs + d).to(VC.dtype.element_ty))
            tl.store(vc + HALF + d, tl.load(vs + HALF + d).to(VC.dtype.element_ty))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``RMSNorm(x)``, or with ``residual``: ``residual += x`` (in place) then
    ``RMSNorm(residual)``. Rows are the last dimension of 2-D ``x``."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    r = residual.reshape(-1, n) if residual is not None else x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r, weight, out, x2.stride(0), r.stride(0), out.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
            num_warps=4 if n <= 2048 else 8)
    return out.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` in one pass (contiguous inputs of one shape)."""
    out = torch.empty_like(up)
    _silu_mul(gate, up, out, up.shape[-1], up.shape[-1])
    return out


def silu_mul_halves(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u`` for ``g, u = gate_up.chunk(2, -1)`` (``gate_up`` [T, 2I], rows
    contiguous: a fused gate/up projection's output), in one pass -> [T, I]."""
    t, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, width), dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul(gate_up, gate_up[:, width:], out, width, gate_up.stride(0))
    return out


def _silu_mul(gate, up, out, width: int, stride_in: int) -> None:
    n = out.numel()
    if n:
        block = 1024
        _silu_mul_kernel[(triton.cdiv(n, block),)](gate, up, out, n, width, stride_in,
                                                   BLOCK=block, num_warps=4)


def qk_norm_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_weight: Optional[torch.Tensor], k_weight: Optional[torch.Tensor],
                       eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor, slots: torch.Tensor,
                       cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, Hkv, D] (row-strided views are fine): per-head RMSNorm of q and
    k when ``q_weight`` is given, the rotary embedding at ``positions`` (``cos``/``sin``: the
    full fp32 tables [P, D/2]), and k, v written into ``cache`` [2, blocks, block_size, Hkv, D]
    at ``slots``. Returns the rotated (q, k), contiguous."""
    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    qo = torch.empty((t, heads, dim), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, kv_heads, dim), dtype=k.dtype, device=k.device)
    if t:
        kc = cache[0].view(-1, kv_heads, dim)
        vc = cache[1].view(-1, kv_heads, dim)
        has_norm = q_weight is not None
        _qk_rope_kv_kernel[(t, heads + kv_heads)](
            q, k, v, q_weight if has_norm else q, k_weight if has_norm else k, cos, sin,
            positions, slots, qo, ko, kc, vc,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
            kc.stride(0), kc.stride(1), cos.stride(0), heads, eps,
            HAS_NORM=has_norm, HALF=dim // 2, num_warps=1)
    return qo, ko

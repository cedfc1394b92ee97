"""``PackedLinear``: a bias-free linear layer whose weight is kept in a CPU kernel's own format.

Kinds (``KINDS``), each made from the float weight the loader produced:

* ``int4`` -- 4-bit, asymmetric, one scale and minimum per 32 inputs. Where engine/ops/cpu/csrc/int4_mm.cpp
  runs (``cpu_ext.int4_usable``: the extension built, AVX512-BF16) it keeps a GGUF Q4_1 group's
  fp16 ``d`` and ``m`` as they are (``w = d * q + m``) in its own block layout (``q4``, ``d16``,
  ``m16``; :func:`pack_int4_blocks`) and multiplies with float32 accumulation. Elsewhere torch's
  ``_weight_int4pack_mm_for_cpu`` (dequantizes ``(q - 8) * scale + zero`` with bf16 scale and
  zero, measured): scale ``d``, zero ``m + 8 d``. A Q4_0 group maps to the same grid.
* ``int8`` -- 8-bit, one symmetric scale per output row and 32 inputs (``INT8_CHUNK``; one
  ``_weight_int8pack_mm`` call per 32 inputs, summed in float32). Used for Q8_0 tensors. Built
  as an LM head (``head_top``), it computes every logit in one kernel call from a copy with one
  scale per row (approximate) and then the ``head_top`` best of each row again, exactly from the
  groups of 32 in float32 (see :class:`PackedLinear`).
* ``fbgemm_fp16`` -- fp16 weights in fbgemm's packed layout (``quantized.linear_dynamic_fp16``),
  fp32 activations: AVX2 kernels, near-fp32 results.

Not here: fbgemm's dynamic int8 linear (``quantized.linear_dynamic``). Measured on the default
model it was ~1.3x faster than fbgemm fp16 but its per-tensor 7-bit activation quantization put
the last-position logits 19% (of their max) off the fp32 path and changed the argmax; its weight
has to be a deprecated quantized tensor.

The aten kinds keep their tensors as buffers (offloaded, restored and emptied like any weight).
The fbgemm kind holds a ``torch.ScriptObject``; :meth:`release_packed` drops it, the owner calls
it when the module is released, and ``reachable_tensors`` reports a ScriptObject left behind.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

from . import cpu_ext

KINDS = ("int4", "int8", "fbgemm_fp16")
GROUP = 32  # GGUF's block size for Q4_0/Q4_1/Q8_0, and the int4 kernel's group size here
#: from this many rows (a prefill chunk, a batch of 16+ decodes) a bf16 int4 linear runs the dense
#: bf16 GEMM (oneDNN: AMX / AVX512-BF16) on its weight dequantized once at load (``dense``: +2
#: bytes a weight) instead of the weight-only kernel, which is compute-bound from ~4 rows here.
#: Measured on the 2-core Xeon, one thread, 3072x576, us: kernel at 8 / 16 / 64 rows 398 / 780 /
#: 3,089, dense 392 / 508 / 843; at 1,000 rows 39.7 ms against 4.1 ms. Dequantizing per call
#: instead (what this replaced) cost 3.9 ms a matrix, ~230 ms per 1,000-token prefill chunk.
DENSE_ROWS = 16
#: inputs per int8 scale (each chunk is one kernel call): GGUF Q8_0's own groups of 32, so a
#: Q8_0 tensor is kept as it is (up to the scales' rounding to the activation dtype). One scale
#: per row (576 inputs of the default model's head) was 2.7 ms a step faster at batch 1, but
#: put its logits 2-4 % off and cut greedy agreement with the fp32 path from 74 % to 60 %.
INT8_CHUNK = 32
#: the head computes its exact logits for this many rows at a time (each row gathers
#: ``head_top`` x in_features float32 weights)
_HEAD_ROWS = 256
_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default


def _top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each row's ``k`` largest (in no order): numpy's selection, 56 against
    torch's topk 192 us on one 49,152-logit row (one thread, measured). Ties at the k-th value
    may pick other indices than ``topk``."""
    a = x.numpy()
    n = a.shape[1]
    return torch.from_numpy(np.argpartition(a, n - k, axis=1)[:, n - k:])


def _int4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] float -> (int4 values [N, K] int32 in 0..15, scales/zeros [K/32, N, 2])."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((g - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.int32)
    zero = lo + 8 * scale
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [K/32, N, 2]
    return q.reshape(n, k), sz


def pack_int4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [N, K] float -> engine/ops/cpu/csrc/int4_mm.cpp's ``(q4 [N/16, K/32, 8, 32] uint8, d16,
    m16 [N/16, K/32, 16] fp16, the weight those give back [N, K] float32)``: per group of 32
    inputs ``d = (max - min) / 15`` and ``m = min`` rounded to fp16, ``q = round((w - m) / d)``
    in 0..15. A GGUF Q4_1 tensor comes back exactly (its groups are fp16 ``d``, ``m`` with
    ``q`` spanning 0..15)."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d16, m16 = ((hi - lo) / 15).half(), lo.half()
    d, m = d16.float(), m16.float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = ((g - m.unsqueeze(-1)) / safe.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.uint8)
    back = (q.float() * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(n, k)
    # [N, G, 32] -> [N/16 blocks, G, 8 pieces, 16 lanes, 2 inputs, low/high nibble]: piece j's
    # lane l holds inputs (2j, 2j + 1) in the low nibbles and (2j + 16, 2j + 17) in the high
    qq = q.reshape(n // 16, 16, k // GROUP, 2, 8, 2).permute(0, 2, 4, 1, 5, 3)
    q4 = (qq[..., 0] | (qq[..., 1] << 4)).contiguous().reshape(n // 16, k // GROUP, 8, 32)
    lanes = lambda t: t.reshape(n // 16, 16, k // GROUP).transpose(1, 2).contiguous()  # noqa: E731
    return q4, lanes(d16), lanes(m16), back


def _dequantize(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """int4 values [N, K] and scales/zeros [K/32, N, 2] -> ``q * scale + zero - 8 * scale``
    [N, K] in ``sz``'s dtype, computed in it (what the kernel computes)."""
    n, k = q.shape
    sz = sz.transpose(0, 1)  # [N, K/32, 2]
    scale = sz[..., :1]
    w = q.view(n, k // GROUP, GROUP).to(sz.dtype)
    return w.mul_(scale).add_(sz[..., 1:] - 8 * scale).view(n, k).contiguous()


def _int8_rows(w: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (int8 [K/chunk, N, chunk], scales [K/chunk, N]): one symmetric scale per
    output row and ``chunk`` inputs (the kernel scales per row; chunks are separate calls)."""
    n, k = w.shape
    g = w.float().reshape(n, k // chunk, chunk).transpose(0, 1)
    scale = g.abs().amax(-1).clamp_min(1e-12) / 127
    q = (g / scale.unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale


class PackedLinear(nn.Module):
    """``y = x @ W.T`` with ``W`` packed as ``kind``; ``x`` float32 (or the activation dtype
    the kind was built for).

    ``head_top`` (int8 in bf16 only): the LM head. One int4 kernel call over a copy of the
    weight requantized to groups of 32 (4-bit, asymmetric) gives every logit approximately
    (~10 % of the row's largest off, the median on the default model); the ``head_top`` largest
    of each row are then computed again from the exact int8 groups in float32 and put in their
    place. Greedy picks, top-k / top-p and top logprobs read those; the rest keep the
    approximation. On the default model (500 positions) the exact argmax was always among the
    int4 copy's best 32 and the exact best 20 always among its best 128 (``HEAD_TOP`` in
    engine/model/cpu_weights.py); the logsumexp is ~0.03 off (median; the int8 per-row copy this
    replaced: 0.016, with its best 20 among its 32 best at 99.4 %). In a 1-stream decode step
    (2-core Xeon, one thread) the int4 pass took 2.6 ms less than the per-row int8 one (half
    a byte a weight read, against one); that int8 pass was itself ~6 ms faster than 18 chunked
    calls. Where the int4 kernel cannot take the shape (``in_features`` not a multiple of 32,
    ``out_features`` not of 16) the approximate pass is one int8 call over a copy with one scale
    per row (~2-4 % of the largest off)."""

    def __init__(self, weight: torch.Tensor, kind: str, act_dtype: torch.dtype = torch.float32,
                 head_top: int = 0):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown packed kind {kind!r}; kinds: {', '.join(KINDS)}")
        self.kind, self.act_dtype = kind, act_dtype
        self.head_top = head_top if kind == "int8" and act_dtype == torch.bfloat16 else 0
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        self._packed: Optional[torch.ScriptObject] = None
        self.packed_nbytes = 0
        with torch.no_grad():
            if kind == "int4":
                if self.in_features % GROUP:
                    raise ValueError(f"int4 needs in_features divisible by {GROUP}")
                if act_dtype == torch.bfloat16 and cpu_ext.int4_usable(*weight.shape):
                    self._register_blocks("", weight)
                    return
                q, sz = _int4_groups(weight)
                self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
                self.register_buffer("scales_zeros", sz.to(act_dtype))
                if act_dtype == torch.bfloat16:  # the dense path's weight (DENSE_ROWS)
                    self.register_buffer("dense", _dequantize(q, sz.to(act_dtype)))
            elif kind == "int8":
                chunk = INT8_CHUNK if self.in_features % INT8_CHUNK == 0 else self.in_features
                q, scale = _int8_rows(weight, chunk)
                self.register_buffer("qweight", q)
                self.register_buffer("scales", scale.to(act_dtype))
                if self.head_top:
                    self.scales = scale  # float32: the exact rows and logits read them
                    # the approximate pass: the exact int8 values, requantized to int4 groups
                    exact = (q.float() * scale.unsqueeze(-1)).transpose(0, 1).reshape(weight.shape)
                    if cpu_ext.int4_usable(*exact.shape):
                        self._register_blocks("approx_", exact)
                    elif self.in_features % GROUP == 0 and self.out_features % 16 == 0:  # the kernel's
                        q4, sz = _int4_groups(exact)
                        self.register_buffer("approx_qweight",
                                             torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1))
                        self.register_buffer("approx_scales_zeros", sz.to(act_dtype))
                    else:
                        q_row, s_row = _int8_rows(exact, self.in_features)
                        self.register_buffer("row_qweight", q_row[0])
                        self.register_buffer("row_scales", s_row[0].to(act_dtype))
            else:
                self._packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)
                self.packed_nbytes = weight.numel() * 2  # nominal: fbgemm pads, see cpu_weights

    def _register_blocks(self, prefix: str, weight: torch.Tensor) -> None:
        """engine/ops/cpu/csrc/int4_mm.cpp's buffers (``q4``, ``d16``, ``m16``)."""
        q4, d16, m16, _ = pack_int4_blocks(weight)
        self.register_buffer(prefix + "q4", q4)
        self.register_buffer(prefix + "d16", d16)
        self.register_buffer(prefix + "m16", m16)

    def _int4(self, x: torch.Tensor, prefix: str = "") -> torch.Tensor:
        """float32 ``x`` [T, K] through the 4-bit weight (``prefix`` "approx_": the head's
        approximate copy) -> float32 [T, N]."""
        b = self._buffers
        if prefix + "q4" in b:
            # engine/ops/cpu/csrc/int4_mm.cpp's kernel at every row count, prompt steps too: a
            # GEMM on the weight dequantized for the call lost either accuracy or time. In bf16
            # (activations and weight rounded to 8 bits) a prompt's K/V and first logits moved
            # enough to flip near-tie greedy picks (bench.cpu_agreement on an AMD EPYC box: 89.7 %
            # of tokens, against 100 % through the kernel); in float32 it was exact but slower:
            # a prompt's first token took 305 against 237 ms at 128 tokens and 2,085 against
            # 2,031 ms at 1,000 (the same box, 2 threads, medians of 5 interleaved; per matrix
            # the kernel lost only on the narrow ones, o at 2,048 rows: tools/cpu_kernels.py),
            # and a float32 GEMM has no AMX, which the kernel uses where the CPU has it.
            return cpu_ext.int4_mm(x, b[prefix + "q4"], b[prefix + "d16"], b[prefix + "m16"])
        return _INT4_MM(x.to(torch.bfloat16), b[prefix + "qweight"], GROUP,
                        b[prefix + "scales_zeros"]).float()

    def dense_weight(self) -> torch.Tensor:
        """The int4 weight dequantized to ``[N, K]`` in the activation dtype."""
        if "q4" in self._buffers:
            b = self._buffers
            return cpu_ext.module().int4_dequant_t(b["q4"], b["d16"], b["m16"]).t()
        return self.dense

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the int8 weight, dequantized to float32: an embedding lookup on the
        tied LM head, so the model keeps one copy of the table."""
        # [C, n, chunk]; index_select, not indexing: 47 against 146 us for the head's 128 rows
        q = self.qweight.index_select(1, ids).float().mul_(self.scales.index_select(1, ids).unsqueeze(-1))
        return q.permute(1, 0, 2).reshape(ids.shape[0], self.in_features)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """int4 in bf16 only: float32 ``x`` [T, K] -> float32 ``[T, N]`` (what :meth:`forward`
        computes for a float32 input)."""
        if x.shape[0] >= DENSE_ROWS and "dense" in self._buffers:
            return F.linear(x.to(torch.bfloat16), self._buffers["dense"]).float()
        return self._int4(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.kind
        if self.head_top:
            return self._head(x)
        if kind == "int4" and self.act_dtype == torch.bfloat16:
            return self.mm(x.float()).to(x.dtype)
        if kind == "int4":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.act_dtype), self.qweight,
                                                              GROUP, self.scales_zeros).to(x.dtype)
        if kind == "int8":
            xa = x.to(self.act_dtype)
            chunk = self.qweight.shape[2]
            y = None
            for c in range(self.qweight.shape[0]):
                part = torch.ops.aten._weight_int8pack_mm(xa[:, c * chunk:(c + 1) * chunk],
                                                          self.qweight[c], self.scales[c])
                y = part.float() if y is None else y.add_(part)
            return y.to(x.dtype)
        if self._packed is None:
            raise RuntimeError("PackedLinear used after its packed weight was released")
        shape = x.shape
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, shape[-1]).float(), self._packed)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, N]: every one from the int4 copy, the ``head_top`` best of
        each row exact (see the class docstring)."""
        if "approx_q4" in self._buffers or "approx_qweight" in self._buffers:
            logits = self._int4(x.float(), "approx_")
        else:
            logits = torch.ops.aten._weight_int8pack_mm(x.to(self.act_dtype), self.row_qweight,
                                                        self.row_scales).float()
        top = min(self.head_top, self.out_features)
        xf = x.float()
        ext = cpu_ext.module() if self.qweight.shape[2] % 16 == 0 and cpu_ext.bf16_cpu() else None
        for r0 in range(0, x.shape[0], _HEAD_ROWS):  # bounds the gathered weights' memory
            part = logits[r0:r0 + _HEAD_ROWS]
            idx = _top_indices(part, top)  # [t, top]
            if ext is not None:  # the same sums in C++, no gathered copy (~0.4 ms a step less)
                exact = ext.head_logits_exact(xf[r0:r0 + _HEAD_ROWS], self.qweight, self.scales, idx)
            else:
                w = self.rows(idx.reshape(-1)).view(idx.shape[0], top, self.in_features)
                exact = torch.bmm(w, xf[r0:r0 + _HEAD_ROWS].unsqueeze(-1)).squeeze(-1)
            part.scatter_(1, idx, exact)
        return logits

    def release_packed(self) -> None:
        """Drop the fbgemm object (if any); the owner calls this when it releases the module."""
        self._packed = None
        self.packed_nbytes = 0

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


__all__ = ["PackedLinear", "KINDS", "GROUP", "pack_int4_blocks"]

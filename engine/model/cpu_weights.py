"""Which weight format a CPU engine runs, and packing a loaded model into it.

``choose_format`` decides from the device, ``--dtype``, ``--cpu-weights``, the checkpoint's GGUF
tensor types and the CPU (``torch.backends.cpu.get_cpu_capability()``), and says why:

* ``float`` -- today's path: every weight dequantized to the engine dtype. ``--dtype float32``
  (or any explicit dtype), a CUDA device, and checkpoints that are not quantized GGUF get it.
* ``woq`` -- Q4_0/Q4_1 tensors as ``int4`` (exact), Q8_0 as ``int8``; q/k/v and gate/up fused
  into one call each; the tied embedding looked up in the int8 head. The int4 linears run
  engine/ops/cpu/csrc/int4_mm.cpp where the C++ extension is built (engine/ops/cpu/cpu_ext.py: GGUF's fp16
  group scales kept, float32 sums on AMX; 128+ rows through oneDNN's bf16 GEMM on the weight
  dequantized for the call), else torch's weight-only kernels with bf16 activations (and 16+
  rows through a dense bf16 copy). The model runs engine/model/woq_forward.py (``model.woq_forward``,
  where :func:`woq_forward.usable`), a step of decode rows in one C++ call. ``auto``'s choice on
  AVX-512 CPUs with AVX512-BF16: on the 2-core Sapphire Rapids box, batch-1 decode took 21.8 ms
  a step against 43.7 ms with fbgemm fp16 and 56.2 ms in fp32 (one thread;
  bench/RESULTS.md); 10.8 ms (one thread) and 6.6 ms (two) with the C++ step and kernel.
* deterministic mode (``EngineConfig.deterministic``) always gets ``float``: the packed kernels
  change path with the row count (``DENSE_ROWS``, the 4-bit kernel's AVX and AMX tiles;
  fbgemm's fp16 GEMM gave one result for one row, another for two or three, another for more,
  measured), and the float
  linears are made batch-invariant instead (engine/model/invariant.py).
* ``fbgemm_fp16`` -- fbgemm's fp16-weight GEMM (AVX2, and AVX-512 without BF16), ``auto``'s
  choice there. On an AVX2-only CPU torch's
  weight-only kernels run a scalar fallback: measured on the 2-core AMD EPYC (AVX2) box,
  ``_weight_int8pack_mm`` was 7-90x and ``_weight_int4pack_mm_for_cpu`` 15-150x slower than the
  fp32 GEMM (1536x576, 1-64 rows, best of 30, one thread), while fbgemm's fp16 GEMM was ~2x
  faster than fp32 at 1 row, with near-fp32 logits. Not smaller in memory: fbgemm's packed fp16
  matrices took ~3.6 bytes a parameter resident (measured: 60 of 1536x576 took 190 MiB).

``pack_model`` swaps each decoder ``nn.Linear`` (and the LM head, tied or not) for a
:class:`PackedLinear`; the float weights it replaces are dropped.
"""

from __future__ import annotations

import logging
from typing import Mapping, Optional

import torch
from torch import nn

from engine.config import CPU_WEIGHT_FORMATS
from engine.ops.cpu import cpu_ext
from engine.ops.cpu.cpu_ext import amx_cpu, bf16_cpu, cpu_capability
from engine.ops.cpu.packed_linear import PackedLinear

from . import woq_forward

log = logging.getLogger("enginecore.cpu_weights")

FORMATS = CPU_WEIGHT_FORMATS
_QUANTIZED = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_QKV, _GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
_FUSED = {"qkv_proj": _QKV, "gate_up_proj": _GATE_UP}
#: an int8 LM head in bf16 computes this many logits of each row exactly (PackedLinear): the
#: most logprobs a request may ask for (20) fell among its int4 pass's best 128 every time on the
#: default model (best 64: 96 %)
HEAD_TOP = 128


def _act_dtype(fmt: str) -> torch.dtype:
    """woq's kernels are vectorized for bf16 activations only (fp32 ones: measured 10-40x
    slower on an AVX-512 Xeon); the rest of the model stays float32."""
    return torch.bfloat16 if fmt == "woq" else torch.float32


def is_quantized(gguf_types: Optional[Mapping[str, str]]) -> bool:
    """A GGUF checkpoint with Q4_0 / Q4_1 / Q8_0 tensors (what ``woq`` packs)."""
    return bool(gguf_types) and any(t in _QUANTIZED for t in gguf_types.values())


def choose_format(device: torch.device, dtype_flag: str, cpu_weights: str,
                  gguf_types: Optional[Mapping[str, str]],
                  deterministic: bool = False) -> tuple[str, str]:
    """``(format, why)`` for a model on ``device`` (see the module docstring)."""
    if device.type != "cpu":
        return "float", f"{device.type} device"
    if deterministic:  # the packed kernels pick their path by row count (DENSE_ROWS, ...)
        return "float", "deterministic mode: float weights through the batch-invariant linears"
    quantized = is_quantized(gguf_types)
    if cpu_weights not in ("auto", "float") and not quantized:
        return "float", f"--cpu-weights {cpu_weights} needs a Q4_0/Q4_1/Q8_0 GGUF checkpoint"
    if cpu_weights != "auto":
        return cpu_weights, f"--cpu-weights {cpu_weights}"
    if dtype_flag != "auto":
        return "float", f"--dtype {dtype_flag} asked for dequantized weights"
    if not quantized:
        return "float", "the checkpoint is not a Q4_0/Q4_1/Q8_0 GGUF"
    cap = cpu_capability()
    if cap.startswith("AVX512") and bf16_cpu():
        own = cpu_ext.module() is not None
        return "woq", (f"CPU capability {cap} with AVX512-BF16{' and AMX' if amx_cpu() else ''}: "
                       + ("enginecore's int4 kernel (engine/ops/cpu/csrc/int4_mm.cpp: the file's fp16 group "
                          "scales, float32 sums) and C++ decode step" if own else
                          "torch's int4/int8 weight-only kernels with bf16 activations (the C++ "
                          "extension is not built: engine/ops/cpu/cpu_ext.py)")
                       + "; weights read at ~0.6 byte each, prefill chunks through a dense bf16 GEMM")
    if cap.startswith("AVX512"):
        return "fbgemm_fp16", (f"CPU capability {cap} without AVX512-BF16: torch's weight-only "
                               "kernels are vectorized for bf16 activations only; fbgemm's fp16 GEMM")
    if cap == "AVX2":
        return "fbgemm_fp16", ("CPU capability AVX2: torch's int4/int8 weight-only kernels are "
                               "scalar here (measured 7-150x slower than fp32); fbgemm's fp16 GEMM "
                               "is ~2x faster than fp32 at batch 1")
    return "float", f"CPU capability {cap}: no faster kernel known"


def checkpoint_dtype(device: torch.device, config, tensors, dtype: torch.dtype) -> torch.dtype:
    """``--dtype auto`` on a CPU with AVX512-BF16: a checkpoint's float weights (safetensors,
    an unquantized GGUF) run in bf16 -- oneDNN's bf16 GEMMs (AMX where there is one) read half
    the bytes of float32. A quantized GGUF keeps its packed format (float32 around its kernels),
    synthetic weights (``random:``, no ``tensors``) and tensor parallel engines (every rank
    decides alike only from the config) keep ``dtype``."""
    if (device.type != "cpu" or config.dtype != "auto" or tensors is None
            or config.tensor_parallel_size > 1
            or is_quantized(getattr(tensors, "gguf_types", None)) or not bf16_cpu()):
        return dtype
    log.info("dtype: bfloat16 (--dtype auto: a float checkpoint on a CPU with AVX512-BF16%s; "
             "--dtype float32 keeps float32)", " and AMX" if amx_cpu() else "")
    return torch.bfloat16


def _kind(fmt: str, gguf_type: Optional[str]) -> Optional[str]:
    if fmt == "woq":
        return _QUANTIZED.get(gguf_type or "")
    return fmt if gguf_type in _QUANTIZED else None


def _fused_kind(fmt: str, gguf_types: Mapping[str, str], prefix: str, names) -> Optional[str]:
    kinds = {_kind(fmt, gguf_types.get(f"{prefix}.{n}.weight")) for n in names}
    return kinds.pop() if len(kinds) == 1 else None


def pack_model(model: nn.Module, fmt: str, gguf_types: Mapping[str, str]) -> int:
    """Replace the linears whose GGUF tensors were quantized by ``PackedLinear`` of ``fmt``:
    q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` where their kinds agree (one
    kernel call instead of three / two; each output row keeps its own groups, so this is exact).
    Returns how many of the checkpoint's linears were packed."""
    if fmt == "float":
        return 0
    cfg = model.config
    act = _act_dtype(fmt)
    packed = 0
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for parent_name, parent, group, fused in (
                    ("self_attn", layer.self_attn, _QKV, "qkv_proj"),
                    ("mlp", layer.mlp, _GATE_UP, "gate_up_proj")):
                prefix = f"model.layers.{i}.{parent_name}"
                lins = [getattr(parent, n, None) for n in group]
                kind = _fused_kind(fmt, gguf_types, prefix, group)
                if kind is not None and all(isinstance(m, nn.Linear) and m.bias is None for m in lins):
                    setattr(parent, fused, PackedLinear(torch.cat([m.weight for m in lins]), kind, act))
                    for n in group:
                        delattr(parent, n)
                    packed += len(group)
                for name in _LINEARS:
                    lin = getattr(parent, name, None)
                    if not isinstance(lin, nn.Linear) or lin.bias is not None:
                        continue
                    kind = _kind(fmt, gguf_types.get(f"{prefix}.{name}.weight"))
                    if kind is not None:
                        setattr(parent, name, PackedLinear(lin.weight, kind, act))
                        packed += 1
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        kind = _kind(fmt, gguf_types.get(head_name))
        if kind is not None:
            w = model.model.embed_tokens.weight if cfg.tie_word_embeddings else model.lm_head.weight
            model.packed_head = PackedLinear(w, kind, act, head_top=HEAD_TOP)
            if not cfg.tie_word_embeddings:
                del model.lm_head
            elif kind == "int8":  # one table for the head and the lookup (Q8_0: 113 MB fp32)
                del model.model.embed_tokens
                model.embed_from_head = True
            packed += 1
    if fmt == "woq" and packed:
        model.woq_forward = woq_forward.usable(model)
    return packed


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())


def packed_types(model: nn.Module) -> dict[str, str]:
    """GGUF-like types by HF weight name that make ``pack_model`` pack another model of the same
    architecture as ``model`` is packed (``update_weights`` on packed weights)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear):
            t = "Q8_0" if m.kind == "int8" else "Q4_1"
            if name == "packed_head":
                name = "model.embed_tokens" if model.config.tie_word_embeddings else "lm_head"
            parent, _, leaf = name.rpartition(".")
            for n in _FUSED.get(leaf, (leaf,)):
                out[f"{parent}.{n}.weight" if parent else f"{n}.weight"] = t
    return out


__all__ = ["FORMATS", "choose_format", "pack_model", "is_packed", "packed_types", "cpu_capability",
           "bf16_cpu", "amx_cpu", "is_quantized", "checkpoint_dtype"]

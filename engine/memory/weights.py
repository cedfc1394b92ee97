"""Weights in place: a module's storage swapped to host memory and back (sleep level 1), and
new values loaded into the existing weight storage (``update_weights``), validated in full
before the first copy.

Offloading keeps the module and its ``Parameter`` objects; only each tensor's storage changes
(``tensor.data = copy``), so nothing outside holds a stale device pointer -- and nothing that
was captured against the old addresses (CUDA graphs) may survive it: the runner releases the
graphs before it offloads.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Union

import torch
from torch import nn

from engine.errors import BadRequestError, CheckpointError
from engine.model import fused_linears
from engine.model.llama import CausalLM
from engine.model.model_config import ModelConfig

# What checkpoints carry besides the weights (the loader skips them too).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
#: ModelConfig fields that do not shape the computation (the tokenizer's ids).
_NOT_ARCHITECTURE = ("bos_token_id", "eos_token_ids")

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return list(module.parameters()) + list(module.buffers())


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(module))


def offload_module(module: nn.Module, pin: bool) -> int:
    """Move every parameter and buffer of ``module`` to host memory (page-locked if ``pin``),
    in place. Returns the bytes moved. The device copies are dropped tensor by tensor (the
    caching allocator orders the frees after the copies on the stream)."""
    moved = 0
    with torch.no_grad():
        for t in _tensors(module):
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            host.copy_(t, non_blocking=pin)
            t.data = host
            moved += host.numel() * host.element_size()
    if pin:
        torch.cuda.synchronize()  # the host copies are complete before anyone reads them
    return moved


def restore_module(module: nn.Module, device: torch.device) -> int:
    """Copy an offloaded ``module`` back to ``device``, in place; returns the bytes copied.
    (Pinned sources stay cached by torch's host allocator until its cache is emptied.)"""
    moved = 0
    with torch.no_grad():
        for t in _tensors(module):
            dev = torch.empty(t.shape, dtype=t.dtype, device=device)
            dev.copy_(t, non_blocking=t.is_pinned())
            t.data = dev
            moved += dev.numel() * dev.element_size()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return moved


def check_architecture(engine_cfg: ModelConfig, new_cfg: ModelConfig, source: str) -> None:
    """``new_cfg`` must describe the engine's architecture (token ids aside)."""
    for f in dataclasses.fields(ModelConfig):
        if f.name in _NOT_ARCHITECTURE:
            continue
        a, b = getattr(engine_cfg, f.name), getattr(new_cfg, f.name)
        if a != b:
            raise CheckpointError(source, f"a different architecture: {f.name} is {b!r}, the "
                                          f"engine's model has {a!r}")


def weight_spec(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every parameter's name, shape and dtype, from a model on the meta device (no memory)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    return {n: (tuple(p.shape), dtype) for n, p in model.named_parameters()}


def validated(spec: Mapping[str, tuple[tuple[int, ...], torch.dtype]], named: NamedTensors,
              cfg: ModelConfig, source: str, *, exact_dtype: bool,
              partial: bool = False) -> dict[str, torch.Tensor]:
    """Check every tensor of ``named`` against ``spec`` before anything is copied: a name the
    model does not have, a shape or dtype that differs, or a weight that is missing raises
    (``CheckpointError`` for a checkpoint, ``BadRequestError`` for in-memory tensors), naming
    the tensor. ``exact_dtype``: in-memory tensors must have the engine's dtype; a checkpoint's
    floating-point tensors are converted as at load time. ``partial``: any non-empty subset."""

    def fail(problem: str) -> Exception:
        return BadRequestError(f"update_weights: {problem}") if exact_dtype else CheckpointError(source, problem)

    items = named.items() if isinstance(named, Mapping) else named
    out: dict[str, torch.Tensor] = {}
    for name, t in items:
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise fail("expected (name, tensor) pairs")
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if name not in spec:
            raise fail(f"unexpected weight {name!r} for {cfg.architecture}")
        if name in out:
            raise fail(f"weight {name!r} given twice")
        shape, dtype = spec[name]
        if tuple(t.shape) != shape:
            raise fail(f"shape mismatch for {name}: given {tuple(t.shape)}, model {shape}")
        if (t.dtype != dtype) if exact_dtype else not t.dtype.is_floating_point:
            raise fail(f"dtype mismatch for {name}: given {t.dtype}, model {dtype}")
        out[name] = t
    if partial and not out:
        raise fail("no weights given")
    missing = [] if partial else sorted(set(spec) - set(out))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise fail(f"missing weights: {', '.join(missing[:5])}{more}")
    return out


def copy_into(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy validated ``tensors`` into ``module``'s parameters, wherever their storage is."""
    params = dict(module.named_parameters())
    if any(name not in params for name in tensors):  # q/k/v, gate/up fused (fused_linears)
        params.update(fused_linears.views(module))
    with torch.no_grad():
        for name, t in tensors.items():
            p = params[name]
            p.copy_(t, non_blocking=p.is_pinned() or p.device.type == "cuda")
    if torch.cuda.is_available():
        torch.cuda.synchronize()


__all__ = ["offload_module", "restore_module", "module_bytes", "check_architecture",
           "weight_spec", "validated", "copy_into", "NamedTensors"]

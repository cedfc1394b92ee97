"""Argument parsing shared by the entry points: the model/engine flags and the config they make."""

from __future__ import annotations

import argparse

import msgspec

from engine.config import EngineConfig


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help='"default" (embedded SmolLM2-135M), a HF checkpoint dir, a .gguf, or random:<preset>')
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV cache of earlier prompts' full blocks")
    p.add_argument("--speculator", choices=["none", "ngram", "draft"], default="none")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--config-json", default=None, help="a whole EngineConfig as JSON (overrides the flags)")


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    if a.config_json:
        return msgspec.json.decode(a.config_json, type=EngineConfig)
    return EngineConfig(
        model=a.model, device=a.device, dtype=a.dtype, kv_cache_bytes=a.kv_cache_bytes,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len, enable_prefix_caching=a.enable_prefix_caching,
        speculator=a.speculator,
        num_speculative_tokens=a.num_speculative_tokens, draft_model=a.draft_model,
    )

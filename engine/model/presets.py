"""``random:<preset>``: real architectures' shapes with seeded synthetic weights."""

from __future__ import annotations

from .model_config import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=256, eos_token_ids=(257,),
    ),
    "tiny-qwen3": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=2048,
        rms_norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tie_word_embeddings=True,
        bos_token_id=256, eos_token_ids=(257,),
    ),
    "smollm2-135m": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=256, eos_token_ids=(257,),
    ),
    "qwen3-0.6b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        tie_word_embeddings=True, bos_token_id=256, eos_token_ids=(257,),
    ),
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, bos_token_id=256, eos_token_ids=(257,),
    ),
}

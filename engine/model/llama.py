"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) in torch.

Parameter names follow Hugging Face, so a checkpoint's state dict loads as is.
"""

from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F

from engine.envs import Switches
from engine.ops.triton import fused_ops

from . import woq_forward
from .attention import AttentionMetadata, paged_attention, write_kv
from .model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s:  # "llama3": scale low frequencies, keep high ones, blend in between
        factor = s["factor"]
        low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    return inv


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if self.cos.device.type == "meta":  # shapes only: computed by reset() on the real device
            # (computing them on the meta device imports torch._refs: 1.7 s of a first load)
            self.cos = torch.empty(cfg.max_position_embeddings, cfg.head_dim // 2)
            self.sin = torch.empty(cfg.max_position_embeddings, cfg.head_dim // 2)
        else:
            self.reset(self.cos.device)

    def reset(self, device: torch.device) -> None:
        """(Re)compute the fp32 cos/sin tables on ``device``."""
        inv = rope_inv_freq(self.cfg).to(device)
        t = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows for ``positions``, [T, 1, D/2]: gathered once per forward, not per
        layer and per q/k (on CPU each gather is an op call of tens of microseconds)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def forward(self, x: torch.Tensor, positions) -> torch.Tensor:
        """x: [T, H, D] rotated by the half-split (HF "rotate_half") convention; ``positions``
        a [T] tensor or the :meth:`tables` of one."""
        cos, sin = self.tables(positions) if isinstance(positions, torch.Tensor) else positions
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = self.head_dim ** -0.5
        #: q, k and v in one linear replacing the three: packed on CPU (engine/model/cpu_weights.py),
        #: float where the fused Triton path runs (engine/model/fused_linears.py)
        self.qkv_proj = None
        self.qkv_sizes = (self.heads * self.head_dim, self.kv_heads * self.head_dim,
                          self.kv_heads * self.head_dim)

    def _qkv(self, x):
        t = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.view(t, self.heads, self.head_dim), k.view(t, self.kv_heads, self.head_dim),
                v.view(t, self.kv_heads, self.head_dim))

    def forward(self, x, positions, rotary: Rotary, cache: torch.Tensor, meta: AttentionMetadata):
        t = x.shape[0]
        q, k, v = self._qkv(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, positions), rotary(k, positions)
        write_kv(cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, cache, meta, self.scale)
        return self.o_proj(o.reshape(t, -1))

    def forward_fused(self, x, positions, rotary: Rotary, cache: torch.Tensor, meta: AttentionMetadata):
        """As :meth:`forward`, with q/k norm, rotary and the KV write in one kernel."""
        t = x.shape[0]
        q, k, v = self._qkv(x)
        qw = self.q_norm.weight if self.qk_norm else None
        kw = self.k_norm.weight if self.qk_norm else None
        eps = self.q_norm.eps if self.qk_norm else 0.0
        q, k = fused_ops.qk_norm_rope_write(q, k, v, qw, kw, eps, rotary.cos, rotary.sin,
                                            positions, meta.slot_mapping, cache)
        o = paged_attention(q, k, v, cache, meta, self.scale)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        #: gate and up in one linear replacing the two: packed on CPU (engine/model/cpu_weights.py),
        #: float where the fused Triton path runs (engine/model/fused_linears.py)
        self.gate_up_proj = None

    def forward(self, x):
        if self.gate_up_proj is not None:
            g, u = self.gate_up_proj(x).chunk(2, -1)
            return self.down_proj(F.silu(g).mul_(u))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_fused(self, x):
        if self.gate_up_proj is not None:
            return self.down_proj(fused_ops.silu_mul_halves(self.gate_up_proj(x)))
        return self.down_proj(fused_ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # NOTE: ``_weight`` skips nn.Embedding's normal_() init (the loader fills every weight):
        # on the meta device that init imports torch._refs, 1.7 s of a first load in a process
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)


class CausalLM(nn.Module):
    """``forward`` returns final hidden states; ``logits`` projects only the rows asked for."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.packed_head = None  # a PackedLinear LM head on CPU (engine/model/cpu_weights.py)
        #: tied embeddings looked up in the int8 packed head: the float table is dropped
        self.embed_from_head = False
        #: the kernels it may run (engine/envs.py; set by the loader when an engine is built)
        self.switches = Switches()
        #: the fused Triton path (engine/ops/triton/fused_ops.py): None = wherever it can run
        self.use_fused: bool | None = None
        #: packed for woq: the forward of engine/model/woq_forward.py (set by ``pack_model``)
        self.woq_forward = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        fused = self.use_fused
        if fused is None:
            fused = self.switches.fused and fused_ops.usable(input_ids, self.config.head_dim)
        if fused:
            return self._forward_fused(input_ids, positions, kv, meta)
        if self.woq_forward:
            return woq_forward.forward(self, input_ids, positions, kv, meta)
        m = self.model
        x = self.packed_head.rows(input_ids) if self.embed_from_head else m.embed_tokens(input_ids)
        rot = m.rotary.tables(positions)
        for i, layer in enumerate(m.layers):
            x = layer(x, rot, m.rotary, kv[i], meta)
        return m.norm(x)

    def _forward_fused(self, input_ids, positions, kv, meta) -> torch.Tensor:
        """The same computation with the residual carried beside the hidden state: each
        norm adds the previous block's output into it in the same kernel."""
        m = self.model
        x = m.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(m.layers):
            norm = layer.input_layernorm
            if residual is None:
                residual = x
                h = fused_ops.rms_norm(x, norm.weight, norm.eps)
            else:
                h = fused_ops.rms_norm(x, norm.weight, norm.eps, residual)
            h = layer.self_attn.forward_fused(h, positions, m.rotary, kv[i], meta)
            norm = layer.post_attention_layernorm
            x = layer.mlp.forward_fused(fused_ops.rms_norm(h, norm.weight, norm.eps, residual))
        if residual is None:
            return m.norm(x)
        return fused_ops.rms_norm(x, m.norm.weight, m.norm.eps, residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, w).float()

"""Triton kernels (CUDA): paged decode and prefill attention, the fused decoder ops (residual +
RMSNorm, SiLU x mul, q/k norm + rotary + KV write) and the one-pass sampler."""

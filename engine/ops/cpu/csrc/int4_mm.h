// engine/ops/cpu/csrc/int4_mm.cpp: y = x @ W.T for a 4-bit weight with fp16 group scales and minimums.
#pragma once
#include <ATen/core/Tensor.h>

// x [M, K] float32; q [N/16, K/32, 8, 32] uint8; d, m [N/16, K/32, 16] fp16 -> [M, N] float32.
// lo: x is taken as two bf16 parts (hi + lo, ~16 significant bits) instead of one; amx: rows
// go through the CPU's AMX tiles (else AVX512-BF16 dot products).
at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                   bool lo, bool amx);

// the weight's transpose [K, N]: d q + m in float32 (f32, exact) or bf16, for matmuls of many
// rows (a dense GEMM)
at::Tensor int4_dequant_t(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, bool f32);

// engine/ops/cpu/csrc/decode_ops.cpp: the float32 pieces of a decode step between its matmuls.
#pragma once
#include <cstdint>

// out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w, rows of n (n % 16 == 0)
void rms_norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* out);

// qkv [T, (Hq + 2 Hkv) D]: q and k heads rotated in place (x cos2 + swap_halves(x) sin2, cos2 and
// sin2 [T, D]); k and v written to cache slot slots[t] (cache [2, S, Hkv, D] float32)
void rope_write(float* qkv, const float* cos2, const float* sin2, const int64_t* slots, int64_t T,
                int64_t Hq, int64_t Hkv, int64_t D, float* cache, int64_t S);

// out [T, Hq D]: row t's query heads (in qkv) attend to its first lens[t] cache slots through
// block table row t (width entries of block_size slots)
void attend(const float* qkv, const float* cache, int64_t S, const int64_t* tables, int64_t width,
            int64_t block_size, const int64_t* lens, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
            float scale, float* out);

// out[t, i] = silu(gu[t, i]) * gu[t, n + i], gu [T, 2n]
void silu_mul(const float* gu, int64_t rows, int64_t n, float* out);

// out [T, top]: the LM head's exact logits at each row's candidate ids [T, top] (q [C, N, chunk]
// int8, s [C, N] float32 scales, x [T, K = C chunk] float32; chunk % 16 == 0)
void head_logits(const float* x, int64_t T, int64_t K, const int8_t* q, const float* s, int64_t C, int64_t N,
                 int64_t chunk, const int64_t* ids, int64_t top, float* out);

// The float32 pieces of a woq decode step between its matmuls, for engine/ops/cpu/csrc/woq_decode.cpp.
//
// Why by hand: at one row, ATen's versions of these are dominated by their own overhead -- on
// the 2-core Xeon `rms_norm` took 22 us a call (six ops inside) and `scaled_dot_product_attention`
// 39 us for one query against 128 keys: 1.4 + 1.2 ms of a 14.7 ms step for ~0.1 ms of
// arithmetic. These loops do the same float32 arithmetic (up to summation order) in one pass.
#include "decode_ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#define EC_AVX512 __attribute__((target("avx512f,avx512dq")))

namespace {

// e^x for float32 lanes: x = k ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7
// (error < 6e-9 relative there), scaled by 2^k; x below -87.3 gives 0
EC_AVX512 inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}

EC_AVX512 inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

// one row's query heads [q0, q0 + gqa) sharing kv head g
EC_AVX512 void attend_group(const float* q, const float* cache, int64_t S, const int64_t* table,
                            int64_t block_size, int64_t n, int64_t Hkv, int64_t g, int64_t gqa,
                            int64_t D, float scale, float* out, std::vector<float>& p) {
  p.resize(static_cast<size_t>(gqa * n));
  const float* keys = cache;
  const float* values = cache + S * Hkv * D;
  for (int64_t i = 0; i < gqa; ++i) {
    float* s = p.data() + i * n;
    const float* qi = q + i * D;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = table[j / block_size] * block_size + j % block_size;
      s[j] = dot(qi, keys + (slot * Hkv + g) * D, D) * scale;
    }
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
      _mm512_storeu_ps(s + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (j < n) {
      const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv)));
      _mm512_mask_storeu_ps(s + j, k, e);
      sum = _mm512_add_ps(sum, e);
    }
    const float inv = 1.f / _mm512_reduce_add_ps(sum);
    for (int64_t j2 = 0; j2 < n; ++j2) s[j2] *= inv;
  }
  for (int64_t i = 0; i < gqa; ++i)
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + i * D + d, _mm512_setzero_ps());
  for (int64_t j = 0; j < n; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const float* v = values + (slot * Hkv + g) * D;
    for (int64_t i = 0; i < gqa; ++i) {
      const __m512 pj = _mm512_set1_ps(p[i * n + j]);
      float* o = out + i * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_ps(o + d, _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + d), _mm512_loadu_ps(o + d)));
    }
  }
}

}  // namespace

EC_AVX512 void rms_norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * n;
    float* o = out + t * n;
    const float r = 1.f / std::sqrt(dot(xr, xr, n) / static_cast<float>(n) + eps);
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), rv), _mm512_loadu_ps(w + i)));
  }
}

EC_AVX512 void rope_write(float* qkv, const float* cos2, const float* sin2, const int64_t* slots, int64_t T,
                          int64_t Hq, int64_t Hkv, int64_t D, float* cache, int64_t S) {
  const int64_t width = (Hq + 2 * Hkv) * D, half = D / 2;
  std::vector<float> tmp(static_cast<size_t>(D));
  for (int64_t t = 0; t < T; ++t) {
    float* row = qkv + t * width;
    const float* c = cos2 + t * D;
    const float* s = sin2 + t * D;
    for (int64_t h = 0; h < Hq + Hkv; ++h) {
      float* x = row + h * D;
      for (int64_t i = 0; i < D; ++i) tmp[i] = x[i] * c[i] + x[(i + half) % D] * s[i];
      std::copy(tmp.begin(), tmp.end(), x);
    }
    float* k_dst = cache + slots[t] * Hkv * D;
    float* v_dst = cache + (S + slots[t]) * Hkv * D;
    std::copy(row + Hq * D, row + (Hq + Hkv) * D, k_dst);
    std::copy(row + (Hq + Hkv) * D, row + width, v_dst);
  }
}

void attend(const float* qkv, const float* cache, int64_t S, const int64_t* tables, int64_t width,
            int64_t block_size, const int64_t* lens, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
            float scale, float* out) {
  const int64_t gqa = Hq / Hkv, row_width = (Hq + 2 * Hkv) * D;
  at::parallel_for(0, T * Hkv, 1, [&](int64_t a, int64_t b) {
    std::vector<float> p;
    for (int64_t task = a; task < b; ++task) {
      const int64_t t = task / Hkv, g = task % Hkv;
      attend_group(qkv + t * row_width + g * gqa * D, cache, S, tables + t * width, block_size, lens[t],
                   Hkv, g, gqa, D, scale, out + t * Hq * D + g * gqa * D, p);
    }
  });
}

EC_AVX512 void silu_mul(const float* gu, int64_t rows, int64_t n, float* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* g = gu + t * 2 * n;
    const float* u = g + n;
    float* o = out + t * n;
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 gv = _mm512_loadu_ps(g + i);
      // silu(g) = g / (1 + e^-g)
      const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_storeu_ps(o + i, _mm512_mul_ps(sig, _mm512_loadu_ps(u + i)));
    }
  }
}

// out[t, j] = sum_c s[c, n] * sum_i q[c, n, i] * x[t, c * chunk + i] for n = ids[t, j]: the LM
// head's exact logits of each row's candidates (q [C, N, chunk] int8, s [C, N] float32)
EC_AVX512 static void head_logits_row(const float* x, const int8_t* q, const float* s, int64_t C, int64_t N,
                                      int64_t chunk, const int64_t* ids, int64_t top, float* out) {
  for (int64_t j = 0; j < top; ++j) {
    const int64_t n = ids[j];
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const int8_t* qr = q + (c * N + n) * chunk;
      const float* xc = x + c * chunk;
      __m512 v = _mm512_setzero_ps();
      for (int64_t i = 0; i < chunk; i += 16) {
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qr + i))));
        v = _mm512_fmadd_ps(w, _mm512_loadu_ps(xc + i), v);
      }
      acc = _mm512_fmadd_ps(v, _mm512_set1_ps(s[c * N + n]), acc);
    }
    out[j] = _mm512_reduce_add_ps(acc);
  }
}

void head_logits(const float* x, int64_t T, int64_t K, const int8_t* q, const float* s, int64_t C, int64_t N,
                 int64_t chunk, const int64_t* ids, int64_t top, float* out) {
  at::parallel_for(0, T, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) head_logits_row(x + t * K, q, s, C, N, chunk, ids + t * top, top, out + t * top);
  });
}

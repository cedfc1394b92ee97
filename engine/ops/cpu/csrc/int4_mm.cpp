// A 4-bit weight-only matmul for CPUs with AVX512-BF16 (and AMX), for decode-sized batches.
//
// Why by hand: torch's `_weight_int4pack_mm_for_cpu` (the one library kernel for this on x86)
// rounds each group's scale and zero point to bf16 -- ~0.3 % off per linear on a GGUF Q4_1
// grid, the main reason greedy decoding drifted from the float32 path -- and is compute-bound
// from ~4 rows (~45 us a row for a 3072x576 matrix here). No well-kept library takes GGUF's
// fp16 (d, m) groups as they are. This kernel keeps them exact: the 4-bit values become bf16
// exactly (0..15), the dot products accumulate in float32 (AVX512-BF16 `vdpbf16ps`, or AMX
// `tdpbf16ps` tiles for 2+ rows), each group's sum is scaled by its float32 `d`, and `m` times
// the group's input sum is added. With `lo` the input is split into two bf16 parts (hi + lo),
// so it is carried at ~16 bits instead of bf16's 8: measured ~5e-6 relative error per linear
// against float64, torch's kernel ~3e-3.
//
// Layout (engine/ops/cpu/packed_linear.py `pack_int4_blocks` builds it): outputs in blocks of 16 (a
// vector lane each), inputs in groups of 32; a block's group is 8 pieces of 32 bytes; byte b of
// piece j holds output (b / 2)'s input 2j + b % 2 in its low nibble and input 2j + 16 + b % 2
// in its high nibble. Zero-extended to 16-bit words, the low nibbles are the 16 x 2 bf16 pairs
// `vdpbf16ps` multiplies by the broadcast input pair (2j, 2j + 1) -- the VNNI layout AMX's B
// tile takes, so one group of one block is one 16 x 64-byte tile.
#include "int4_mm.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

#define EC_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512dq,f16c")))
#define EC_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512dq,f16c,amx-tile,amx-bf16")))

namespace {

// bf16 bit patterns of 0..15, twice (vpermw reads a 32-word table)
alignas(64) const uint16_t kBf16Of[32] = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
    0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

struct Inputs {
  const uint16_t* hi;  // [M, K] bf16
  const uint16_t* lo;  // [M, K] bf16 (x - hi)
  const float* sums;   // [M, K/32]: each group's input sum, float32
};

// x [n] float32 (n a multiple of 32) -> bf16 hi and lo parts and the sums of 32
EC_AVX512 void split(const float* x, int64_t n, uint16_t* hi, uint16_t* lo, float* sums) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    _mm512_storeu_si512(hi + i, h);
    const __m512 ha = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
    const __m512 hb = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
    _mm512_storeu_si512(lo + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha)));
    sums[i / 32] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
}

// R rows (<= 8) of AVX512-BF16 dot products, output blocks [b0, b1)
// Every loop over r is unrolled (the pragmas): rolled, GCC at -O2 kept the rows' accumulators on
// the stack (R = 2 with `lo` ran 3.4x slower than one row instead of ~1.4x, measured).
template <int R, bool LO>
EC_AVX512 void avx_rows(const Inputs& in, int64_t K, const uint8_t* q, const uint16_t* d,
                        const uint16_t* m, int64_t b0, int64_t b1, float* out, int64_t N) {
  const int64_t G = K / 32;
  const __m512i tbl = _mm512_load_si512(kBf16Of);
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  const uint32_t* hi = reinterpret_cast<const uint32_t*>(in.hi);  // bf16 pairs
  const uint32_t* lo = reinterpret_cast<const uint32_t*>(in.lo);
  for (int64_t blk = b0; blk < b1; ++blk) {
    __m512 acc[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* qg = q + (blk * G + g) * 256;
      __m512 ta[R], tb[R], tc[R], td[R];
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) ta[r] = tb[r] = tc[r] = td[r] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qg + j * 32)));
        const __m512bh wa = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(w, low4), tbl);
        const __m512bh wb = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), tbl);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const uint32_t* xr = hi + r * (K / 2) + g * 16;
          ta[r] = _mm512_dpbf16_ps(ta[r], wa, (__m512bh)_mm512_set1_epi32(xr[j]));
          tb[r] = _mm512_dpbf16_ps(tb[r], wb, (__m512bh)_mm512_set1_epi32(xr[j + 8]));
          if (LO) {
            const uint32_t* xl = lo + r * (K / 2) + g * 16;
            tc[r] = _mm512_dpbf16_ps(tc[r], wa, (__m512bh)_mm512_set1_epi32(xl[j]));
            td[r] = _mm512_dpbf16_ps(td[r], wb, (__m512bh)_mm512_set1_epi32(xl[j + 8]));
          }
        }
      }
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + (blk * G + g) * 16)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m + (blk * G + g) * 16)));
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 s = LO ? _mm512_add_ps(_mm512_add_ps(ta[r], tb[r]), _mm512_add_ps(tc[r], td[r]))
                            : _mm512_add_ps(ta[r], tb[r]);
        acc[r] = _mm512_fmadd_ps(s, dv, acc[r]);
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(in.sums[r * G + g]), acc[r]);
      }
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * N + blk * 16, acc[r]);
  }
}

template <bool LO>
void avx_tile(const Inputs& in, int64_t rows, int64_t K, const uint8_t* q, const uint16_t* d,
              const uint16_t* m, int64_t b0, int64_t b1, float* out, int64_t N) {
  switch (rows) {
#define EC_CASE(R) \
  case R:          \
    return avx_rows<R, LO>(in, K, q, d, m, b0, b1, out, N);
    EC_CASE(1) EC_CASE(2) EC_CASE(3) EC_CASE(4) EC_CASE(5) EC_CASE(6) EC_CASE(7)
    default: return avx_rows<8, LO>(in, K, q, d, m, b0, b1, out, N);
#undef EC_CASE
  }
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_permitted() {  // Linux gives a process AMX's tile state only when asked (once)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// tiles 0, 1 (C), 2, 3, 6, 7 (A) of `rows` rows; 4, 5 (B) of 16; every row 64 bytes
EC_AMX void configure_tiles(int64_t rows) {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t : {0, 1, 2, 3, 6, 7}) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  cfg.rows[4] = cfg.rows[5] = 16;
  cfg.colsb[4] = cfg.colsb[5] = 64;
  // NOTE: GCC's _tile_loadconfig tells the compiler it reads 8 bytes of `cfg` only, so the
  // stores to the rest were dropped as dead (SIGILL at the first tile load): make them live
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// `unpack` one block's group (8 pieces) into a 16 x 64-byte B tile
EC_AMX inline void unpack_tile(const uint8_t* qg, uint16_t* tile, __m512i tbl, __m512i low4) {
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qg + j * 32)));
    _mm512_store_si512(tile + j * 32, _mm512_permutexvar_epi16(_mm512_and_si512(w, low4), tbl));
    _mm512_store_si512(tile + (j + 8) * 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), tbl));
  }
}

// Any number of rows through AMX: per block of 16 outputs and group of 32 inputs, the weight
// is unpacked once into a B tile, then for each tile of up to 16 rows C = A_hi B (+ A_lo B)
// and acc += C d + m sums (acc: rows x 16 float32 in `acc`). Two groups in flight: tiles 0/1
// for C, 2/6 and 3/7 for A, 4/5 for B; tiles of fewer rows reconfigure.
template <bool LO>
EC_AMX void amx_rows(const Inputs& in, int64_t M, int64_t K, const uint8_t* q, const uint16_t* d,
                     const uint16_t* m, int64_t b0, int64_t b1, float* out, int64_t N, float* acc) {
  const int64_t G = K / 32;
  const int64_t stride = K * 2;
  const __m512i tbl = _mm512_load_si512(kBf16Of);
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  alignas(64) uint16_t btile[2][512];
  alignas(64) float c[2][256];
  int64_t configured = -1;
  for (int64_t blk = b0; blk < b1; ++blk) {
    for (int64_t i = 0; i < M * 16; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
    for (int64_t g = 0; g < G; g += 2) {
      const bool two = g + 1 < G;
      const uint8_t* qg = q + (blk * G + g) * 256;
      unpack_tile(qg, btile[0], tbl, low4);
      if (two) unpack_tile(qg + 256, btile[1], tbl, low4);
      const __m512 dv0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + (blk * G + g) * 16)));
      const __m512 mv0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m + (blk * G + g) * 16)));
      __m512 dv1 = dv0, mv1 = mv0;
      if (two) {
        dv1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + (blk * G + g + 1) * 16)));
        mv1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m + (blk * G + g + 1) * 16)));
      }
      for (int64_t r0 = 0; r0 < M; r0 += 16) {
        const int64_t rows = std::min<int64_t>(16, M - r0);
        if (rows != configured) {
          configure_tiles(rows);
          configured = rows;
        }
        const uint16_t* hi = in.hi + r0 * K + g * 32;
        const uint16_t* lo = in.lo + r0 * K + g * 32;
        _tile_loadd(4, btile[0], 64);
        _tile_loadd(2, hi, stride);
        _tile_zero(0);
        _tile_dpbf16ps(0, 2, 4);
        if (LO) {
          _tile_loadd(3, lo, stride);
          _tile_dpbf16ps(0, 3, 4);
        }
        if (two) {
          _tile_loadd(5, btile[1], 64);
          _tile_loadd(6, hi + 32, stride);
          _tile_zero(1);
          _tile_dpbf16ps(1, 6, 5);
          if (LO) {
            _tile_loadd(7, lo + 32, stride);
            _tile_dpbf16ps(1, 7, 5);
          }
        }
        _tile_stored(0, c[0], 64);
        if (two) _tile_stored(1, c[1], 64);
        const float* sums = in.sums + r0 * G + g;
        float* a = acc + r0 * 16;
        for (int64_t r = 0; r < rows; ++r) {
          __m512 v = _mm512_fmadd_ps(_mm512_load_ps(c[0] + r * 16), dv0, _mm512_load_ps(a + r * 16));
          v = _mm512_fmadd_ps(mv0, _mm512_set1_ps(sums[r * G]), v);
          if (two) {
            v = _mm512_fmadd_ps(_mm512_load_ps(c[1] + r * 16), dv1, v);
            v = _mm512_fmadd_ps(mv1, _mm512_set1_ps(sums[r * G + 1]), v);
          }
          _mm512_store_ps(a + r * 16, v);
        }
      }
    }
    for (int64_t r = 0; r < M; ++r) _mm512_storeu_ps(out + r * N + blk * 16, _mm512_load_ps(acc + r * 16));
  }
  _tile_release();
}

// blocks [b0, b1) of the 4-bit weight -> its transpose wt [K, N], row-major: d q + m computed in
// float32 (exact: d q has at most 15 significant bits, so the one rounding is the add's, as in
// GGUF's own dequantization), stored as float32 (F32) or rounded to nearest even bf16 (as torch
// converts float to bf16). In the block layout one piece's 16 lanes are 16 consecutive outputs
// of one input: a row of wt.
template <bool F32>
EC_AVX512 void dequant_t_blocks(const uint8_t* q, const uint16_t* d16, const uint16_t* m16, int64_t K,
                                int64_t N, int64_t b0, int64_t b1, void* wt) {
  const int64_t G = K / 32;
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  for (int64_t blk = b0; blk < b1; ++blk) {
    for (int64_t g = 0; g < G; ++g) {
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d16 + (blk * G + g) * 16)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(m16 + (blk * G + g) * 16)));
      const uint8_t* qg = q + (blk * G + g) * 256;
      const int64_t at = (g * 32) * N + blk * 16;
      for (int j = 0; j < 8; ++j) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(qg + j * 32)));
        const __m512i nib[2] = {_mm512_and_si512(w, low4), _mm512_srli_epi16(w, 4)};  // k, k + 16
        for (int h = 0; h < 2; ++h) {
          for (int e = 0; e < 2; ++e) {  // lane l's word 2l + e: input 2j + e (+ 16 for h)
            const __m512i v = e ? _mm512_srli_epi32(nib[h], 16) : _mm512_and_si512(nib[h], low16);
            const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), dv, mv);
            const int64_t k = 2 * j + e + 16 * h;
            if constexpr (F32)
              _mm512_storeu_ps(static_cast<float*>(wt) + at + k * N, f);
            else
              _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(wt) + at + k * N),
                                  (__m256i)_mm512_cvtneps_pbh(f));
          }
        }
      }
    }
  }
}

}  // namespace

// The AVX-512 (BF16) loops above are refused on a CPU without them: an error, never an illegal
// instruction (the callers check the CPU first; a direct call must not kill the process either)
static void require_avx512_bf16(const char* what) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("f16c"),
              what, ": needs a CPU with AVX512-BF16");
}

at::Tensor int4_dequant_t(const at::Tensor& q, const at::Tensor& d, const at::Tensor& m, bool f32) {
  require_avx512_bf16("int4_dequant_t");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 8 && q.size(3) == 32 && q.scalar_type() == at::kByte,
              "int4_dequant_t: q must be [N/16, K/32, 8, 32] uint8");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous() && m.is_contiguous() &&
                  d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf &&
                  d.numel() == q.size(0) * q.size(1) * 16 && m.numel() == d.numel(),
              "int4_dequant_t: q, d and m must be contiguous and agree, d and m float16");
  const int64_t NB = q.size(0), N = NB * 16, K = q.size(1) * 32;
  at::Tensor wt = at::empty({K, N}, q.options().dtype(f32 ? at::kFloat : at::kBFloat16));
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = reinterpret_cast<const uint16_t*>(m.data_ptr());
  void* wp = wt.data_ptr();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    if (f32)
      dequant_t_blocks<true>(qp, dp, mp, K, N, b0, b1, wp);
    else
      dequant_t_blocks<false>(qp, dp, mp, K, N, b0, b1, wp);
  });
  return wt;
}
at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m,
                   bool lo, bool amx) {
  require_avx512_bf16("int4_mm");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "int4_mm: x must be [M, K] float32");
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 8 && q.size(3) == 32 && q.scalar_type() == at::kByte,
              "int4_mm: q must be [N/16, K/32, 8, 32] uint8");
  TORCH_CHECK(q.is_contiguous() && d.is_contiguous() && m.is_contiguous() &&
                  d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf,
              "int4_mm: q, d and m must be contiguous, d and m float16");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = q.size(0), N = NB * 16, G = K / 32;
  TORCH_CHECK(K == q.size(1) * 32 && d.numel() == NB * G * 16 && m.numel() == NB * G * 16,
              "int4_mm: shapes do not agree");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  at::Tensor hi = at::empty({M, K}, x.options().dtype(at::kBFloat16));
  at::Tensor lo_part = at::empty({M, K}, x.options().dtype(at::kBFloat16));
  at::Tensor sums = at::empty({M, G}, x.options());
  split(x.data_ptr<float>(), M * K, reinterpret_cast<uint16_t*>(hi.data_ptr()),
        reinterpret_cast<uint16_t*>(lo_part.data_ptr()), sums.data_ptr<float>());
  const auto* hp = reinterpret_cast<const uint16_t*>(hi.data_ptr());
  const auto* lp = reinterpret_cast<const uint16_t*>(lo_part.data_ptr());
  const float* sp = sums.data_ptr<float>();
  const auto* qp = q.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = reinterpret_cast<const uint16_t*>(m.data_ptr());
  float* op = out.data_ptr<float>();
  if (amx && amx_permitted()) {
    at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
      // this thread's running sums for a block (torch's CPU allocator aligns to 64 bytes)
      at::Tensor acc = at::empty({M * 16}, x.options());
      const Inputs in{hp, lp, sp};
      lo ? amx_rows<true>(in, M, K, qp, dp, mp, b0, b1, op, N, acc.data_ptr<float>())
         : amx_rows<false>(in, M, K, qp, dp, mp, b0, b1, op, N, acc.data_ptr<float>());
    });
    return out;
  }
  // rows at a time: with `lo` each row keeps 5 vector accumulators, so 4 rows (20) fit the 32
  // registers beside the weights; 8 spilled (measured: 8 rows 2.2x the time of 4 instead of 2x)
  const int64_t chunk = lo ? 4 : 8;
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t r0 = 0; r0 < M; r0 += chunk) {
      const int64_t rows = std::min<int64_t>(chunk, M - r0);
      const Inputs in{hp + r0 * K, lp + r0 * K, sp + r0 * G};
      lo ? avx_tile<true>(in, rows, K, qp, dp, mp, b0, b1, op + r0 * N, N)
         : avx_tile<false>(in, rows, K, qp, dp, mp, b0, b1, op + r0 * N, N);
    }
  });
  return out;
}

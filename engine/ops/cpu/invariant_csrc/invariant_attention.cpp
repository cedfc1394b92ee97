// Batch-invariant paged attention for deterministic mode (engine/ops/cpu/invariant_attention.py).
//
// A plain C-ABI library (no torch headers: against them the build took ~45 s on 2 cores, this
// one a few seconds), built by the Python side with the system compiler and called through
// ctypes with raw pointers; that side checks every tensor's dtype, device, layout and shapes
// first, and the functions here check each row's length and blocks before any is read.
//
// Why by hand: torch's CPU attention reduces a query's keys in an order that the shapes of the
// call decide -- SDPA's flash kernel splits queries and keys into blocks sized by the sequence
// lengths and multiplies them with GEMMs whose kernel depends on the block's row count; a
// padded gather changes the reduction length -- so a token's output changes with the batch
// beside it, with the prefill's chunking and with whether its keys come from the cache. No
// library offers an attention whose per-query arithmetic is fixed. Here every (row, KV head) is
// one task, and what it computes depends only on its queries, its keys and their count:
//   * score j: the dot product over D in 8 fixed lanes (lane l sums d = l, l + 8, ... in
//     order), the lanes added in a fixed tree, times the scale;
//   * the maximum over the keys (exact in any order), then exp(score - max) by `fexp` below, their
//     sum in double in key order;
//   * the values weighted by those exps, accumulated in key order per d, divided by the sum.
// Keys are read through the row's block table (key j in slot table[j / bs] * bs + j % bs), so a
// key's place in memory does not matter, and only keys 0 .. len - 1 are read. OpenMP threads split
// the tasks, never one task's sums. Compiled with -ffp-contract=off and without -ffast-math (only
// -fno-trapping-math, which lets loops with a select vectorize and changes no value): only
// IEEE additions, multiplications and divisions, each rounded on its own, so a loop the compiler
// vectorizes computes every element as its scalar remainder does, and a build with AVX2 gives
// the bits of one without.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 8;

// The cache's element types, as their bits; each converts to float32 exactly (as torch's own
// conversions do), so the kernel sees the same values whichever way it is built.
struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};

inline float to_float(float x) { return x; }

inline float to_float(Bf16 x) {  // bfloat16 is float32's upper half
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float to_float(Half x) {  // selects, not branches: the loops that read it vectorize
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t e = (x.bits >> 10) & 0x1fu, m = x.bits & 0x3ffu;
  const uint32_t normal = ((e + 112u) << 23) | (m << 13);  // exponent rebased 15 -> 127
  const uint32_t special = 0x7f800000u | (m << 13);        // inf, nan
  const float tiny = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
  uint32_t tiny_bits;
  std::memcpy(&tiny_bits, &tiny, sizeof tiny_bits);
  const uint32_t bits = sign | (e == 31u ? special : (e == 0u ? tiny_bits : normal));
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e^x for x <= 0 in float32 from IEEE operations only (std::exp is a library call the compiler
// cannot vectorize): x = k ln2 + r, |r| <= ln2 / 2 (k rounded to nearest by the 1.5 * 2^23
// trick), e^r by its Taylor series to r^7 (relative error < 6e-9 there), times 2^k built in the
// exponent bits; below -87 (e^x < 2^-125) 0. Within 2 ulp of std::exp (tests/test_deterministic.py).
inline float fexp(float x) {
  const float xc = std::max(x, -87.0f);
  const float t = xc * 1.44269504088896341f;
  const float k = (t + 12582912.0f) - 12582912.0f;
  float r = xc - k * 0.693145751953125f;
  r = r - k * 1.428606765330187045e-06f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x > -87.0f ? p * scale : 0.0f;
}

template <typename kv_t>
inline float dot(const float* q, const kv_t* k, int64_t d_size) {
  float lane[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + kLanes <= d_size; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) lane[l] += q[d + l] * to_float(k[d + l]);
  }
  for (int l = 0; d + l < d_size; ++l) lane[l] += q[d + l] * to_float(k[d + l]);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// one row's `gqa` query heads that share KV head g: q [gqa, D] -> out [gqa, D]
template <typename kv_t>
void attend(const float* q, const kv_t* keys, const kv_t* values, const int64_t* table,
            int64_t n, int64_t bs, int64_t kv_heads, int64_t g, int64_t gqa, int64_t d_size,
            float scale, float* out, std::vector<float>& p, std::vector<float>& acc) {
  p.resize(static_cast<size_t>(gqa * n));
  acc.assign(static_cast<size_t>(gqa * d_size), 0.f);
  std::vector<double> sums(static_cast<size_t>(gqa), 0.0);
  std::vector<float> maxes(static_cast<size_t>(gqa), -INFINITY);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t slot = table[j / bs] * bs + j % bs;
    const kv_t* k = keys + (slot * kv_heads + g) * d_size;
    for (int64_t i = 0; i < gqa; ++i) {
      const float s = dot(q + i * d_size, k, d_size) * scale;
      p[i * n + j] = s;
      maxes[i] = std::max(maxes[i], s);
    }
  }
  for (int64_t i = 0; i < gqa; ++i) {
    float* pi = p.data() + i * n;
    double sum = 0.0;
    const float m = maxes[i];
    for (int64_t j = 0; j < n; ++j) pi[j] = fexp(pi[j] - m);
    for (int64_t j = 0; j < n; ++j) sum += pi[j];
    sums[i] = sum;
  }
  for (int64_t j = 0; j < n; ++j) {
    const int64_t slot = table[j / bs] * bs + j % bs;
    const kv_t* v = values + (slot * kv_heads + g) * d_size;
    for (int64_t i = 0; i < gqa; ++i) {
      const float w = p[i * n + j];
      float* a = acc.data() + i * d_size;
      for (int64_t d = 0; d < d_size; ++d) a[d] += w * to_float(v[d]);
    }
  }
  for (int64_t i = 0; i < gqa; ++i) {
    const float inv = static_cast<float>(1.0 / sums[i]);
    for (int64_t d = 0; d < d_size; ++d) out[i * d_size + d] = acc[i * d_size + d] * inv;
  }
}

template <typename kv_t>
void run(const float* q, const void* cache, const int64_t* tables, const int64_t* lens,
         int64_t rows, int64_t heads, int64_t d_size, int64_t blocks, int64_t bs,
         int64_t kv_heads, int64_t width, float scale, float* out, int threads) {
  const int64_t gqa = heads / kv_heads;
  const int64_t plane = blocks * bs * kv_heads * d_size;  // K, then V
  const kv_t* keys = static_cast<const kv_t*>(cache);
  const kv_t* values = keys + plane;
  const int64_t tasks = rows * kv_heads;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> p, acc;
    // static: each thread one contiguous range of tasks; which thread runs a task changes
    // nothing in it
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      const int64_t off = (r * heads + g * gqa) * d_size;
      attend(q + off, keys, values, tables + r * width, lens[r], bs, kv_heads, g, gqa, d_size,
             scale, out + off, p, acc);
    }
  }
}

}  // namespace

extern "C" {

// q [rows, heads, D] float32; cache [2, blocks, bs, kv_heads, D] of `dtype` (0 float32,
// 1 bfloat16, 2 float16); tables [rows, width] int64 (row r's block table); lens [rows] int64
// (row r sees keys 0 .. lens[r] - 1) -> out [rows, heads, D] float32; all contiguous. Returns 0;
// -1: bad sizes or dtype; r + 1: row r's length or one of its blocks is out of range (nothing
// computed).
int64_t enginecore_invariant_attention(const float* q, const void* cache, int32_t dtype,
                                       const int64_t* tables, const int64_t* lens, int64_t rows,
                                       int64_t heads, int64_t d_size, int64_t blocks, int64_t bs,
                                       int64_t kv_heads, int64_t width, float scale, float* out,
                                       int32_t threads) {
  if (rows < 0 || heads < 1 || d_size < 1 || blocks < 1 || bs < 1 || kv_heads < 1
      || heads % kv_heads != 0 || width < 0 || threads < 1 || dtype < 0 || dtype > 2) {
    return -1;
  }
  for (int64_t r = 0; r < rows; ++r) {  // every slot read is in the cache
    const int64_t n = lens[r];
    if (n < 1 || (n - 1) / bs >= width) return r + 1;
    for (int64_t b = 0; b <= (n - 1) / bs; ++b) {
      if (tables[r * width + b] < 0 || tables[r * width + b] >= blocks) return r + 1;
    }
  }
  const auto f = dtype == 0 ? run<float> : dtype == 1 ? run<Bf16> : run<Half>;
  f(q, cache, tables, lens, rows, heads, d_size, blocks, bs, kv_heads, width, scale, out,
    threads);
  return 0;
}

// the kernel's exp, elementwise (for the tests)
void enginecore_invariant_fexp(const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fexp(x[i]);
}

}  // extern "C"

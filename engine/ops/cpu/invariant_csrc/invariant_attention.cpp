// Batch-invariant paged attention for deterministic mode (engine/ops/cpu/invariant_attention.py).
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
// key's place in memory does not matter, and only keys 0 .. len - 1 are read. Threads split the
// tasks, never one task's sums. Compiled with -ffp-contract=off and without -ffast-math (only
// -fno-trapping-math, which lets loops with a select vectorize and changes no value): only
// IEEE additions, multiplications and divisions, each rounded on its own, so a loop the compiler
// vectorizes computes every element as its scalar remainder does, and a build with AVX2 gives
// the bits of one without.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kLanes = 8;

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
    for (int l = 0; l < kLanes; ++l) lane[l] += q[d + l] * static_cast<float>(k[d + l]);
  }
  for (int l = 0; d + l < d_size; ++l) lane[l] += q[d + l] * static_cast<float>(k[d + l]);
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
      for (int64_t d = 0; d < d_size; ++d) a[d] += w * static_cast<float>(v[d]);
    }
  }
  for (int64_t i = 0; i < gqa; ++i) {
    const float inv = static_cast<float>(1.0 / sums[i]);
    for (int64_t d = 0; d < d_size; ++d) out[i * d_size + d] = acc[i * d_size + d] * inv;
  }
}

template <typename kv_t>
void run(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
         const torch::Tensor& lens, double scale, torch::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), d_size = q.size(2);
  const int64_t bs = cache.size(2), kv_heads = cache.size(3);
  const int64_t gqa = heads / kv_heads, width = tables.size(1);
  const int64_t plane = cache.size(1) * bs * kv_heads * d_size;  // K, then V
  const kv_t* keys = cache.data_ptr<kv_t>();
  const kv_t* values = keys + plane;
  const float* qp = q.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p, acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      const int64_t off = (r * heads + g * gqa) * d_size;
      attend(qp + off, keys, values, tp + r * width, lp[r], bs, kv_heads, g, gqa, d_size,
             static_cast<float>(scale), op + off, p, acc);
    }
  });
}

}  // namespace

// q [T, H, D] float32; cache [2, blocks, bs, Hkv, D] float32 / bfloat16 / float16; tables [T, W]
// int64 (row r's block table); lens [T] int64 (row r sees keys 0 .. lens[r] - 1) -> [T, H, D]
torch::Tensor invariant_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor tables,
                                  torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q: [T, H, D] float32");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(), "cache: [2, blocks, bs, Hkv, D]");
  TORCH_CHECK(cache.size(4) == q.size(2) && q.size(1) % cache.size(3) == 0, "cache and q disagree");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && tables.dim() == 2 && tables.is_contiguous()
              && tables.size(0) == q.size(0), "tables: [T, W] int64");
  TORCH_CHECK(lens.scalar_type() == torch::kLong && lens.dim() == 1 && lens.is_contiguous()
              && lens.size(0) == q.size(0), "lens: [T] int64");
  const int64_t bs = cache.size(2), blocks = cache.size(1), width = tables.size(1);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t r = 0; r < q.size(0); ++r) {  // every slot read is in the cache
    TORCH_CHECK(lp[r] >= 1 && (lp[r] + bs - 1) / bs <= width, "row ", r, ": bad length");
    for (int64_t b = 0; b < (lp[r] + bs - 1) / bs; ++b) {
      TORCH_CHECK(tp[r * width + b] >= 0 && tp[r * width + b] < blocks, "row ", r, ": bad block");
    }
  }
  auto out = torch::empty_like(q);
  switch (cache.scalar_type()) {
    case torch::kFloat: run<float>(q, cache, tables, lens, scale, out); break;
    case torch::kBFloat16: run<at::BFloat16>(q, cache, tables, lens, scale, out); break;
    case torch::kHalf: run<at::Half>(q, cache, tables, lens, scale, out); break;
    default: TORCH_CHECK(false, "cache dtype ", cache.scalar_type(), " is not supported");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("invariant_attention", &invariant_attention, "batch-invariant paged attention");
  m.def("fexp", [](torch::Tensor x) {  // the kernel's exp, elementwise (for the tests)
    TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous(), "float32, contiguous");
    auto out = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) op[i] = fexp(xp[i]);
    return out;
  });
}

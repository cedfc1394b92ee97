// A decode-only step of a woq-packed model (engine/woq_forward.py), all layers in one call.
//
// Why by hand: on the 2-core CPU a decode step is ~45 ATen op calls a layer, and from Python
// each costs ~2-3 us of binding and dispatch (measured: an eager `x + 1` on a 576-wide row
// takes 2.2 us, a compiled one 14 us), ~4 ms of a ~12 ms step. torch.compile does not help
// here (its guards and wrapper cost more than they save: measured slower per layer), and no
// library runs "these ATen ops, in this order" without Python between them. This file calls
// the very same ATen ops, in the same order and dtypes, as woq_forward.forward does for a
// step of decode rows only, so the results are the Python path's bit for bit (tested).
#include <torch/extension.h>

#include <vector>

#include "int4_mm.h"

namespace {

constexpr int64_t kGroup = 32;  // engine/packed_linear.py GROUP

// PackedLinear's int4 buffers: (q4, d16, m16) of engine/csrc/int4_mm.cpp, or torch's
// (qweight, scales_zeros) with `mins` undefined; dense: the bf16 copy, undefined if none
struct Linear {
  at::Tensor q, scales, mins, dense;
};

struct MatmulOptions {
  int64_t dense_rows, q4_dense_rows;  // packed_linear.DENSE_ROWS, Q4_DENSE_ROWS
  bool lo, amx;
};

// PackedLinear.mm: float32 [T, K] -> float32 [T, N]
at::Tensor mm(const at::Tensor& x, const Linear& lin, const MatmulOptions& opt) {
  if (x.size(0) >= opt.dense_rows && lin.dense.defined())
    return at::linear(x.to(at::kBFloat16), lin.dense).to(at::kFloat);
  if (lin.mins.defined()) {
    if (x.size(0) >= opt.q4_dense_rows)
      return at::mm(x.to(at::kBFloat16), int4_dequant_t(lin.q, lin.scales, lin.mins)).to(at::kFloat);
    return int4_mm(x, lin.q, lin.scales, lin.mins, opt.lo, opt.amx);
  }
  return at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), lin.q, kGroup, lin.scales).to(at::kFloat);
}

at::Tensor defined_or_none(const at::Tensor& t) { return t.numel() == 0 ? at::Tensor() : t; }

Linear linear_at(const std::vector<at::Tensor>& w, size_t i) {
  return Linear{w[i], w[i + 1], defined_or_none(w[i + 2]), defined_or_none(w[i + 3])};
}

// woq_forward._decode_attention: q [B, H, D] -> [B, H, D]
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& mask,
                            const std::vector<int64_t>& spans, const at::Tensor& block_tables,
                            double scale) {
  const int64_t bsz = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = cache.size(3), block_size = cache.size(2);
  const at::Tensor qd = q.reshape({bsz, kv_heads, heads / kv_heads, dim});
  if (!spans.empty()) {
    const at::Tensor flat = cache.view({2, -1, kv_heads, dim});
    std::vector<at::Tensor> outs;
    outs.reserve(bsz);
    for (int64_t b = 0; b < bsz; ++b) {
      const int64_t first = spans[2 * b], n = spans[2 * b + 1];
      const int64_t used = (n + block_size - 1) / block_size * block_size;
      const at::Tensor kvs = flat.slice(1, first, first + used).permute({0, 2, 1, 3});
      outs.push_back(at::scaled_dot_product_attention(
          qd.slice(0, b, b + 1), kvs.slice(0, 0, 1), kvs.slice(0, 1, 2),
          mask.slice(0, b, b + 1).slice(3, 0, used), 0.0, false, scale));
    }
    const at::Tensor o = bsz == 1 ? outs[0] : at::cat(outs);
    return o.view({bsz, heads, dim});
  }
  const at::Tensor kvs = cache.index_select(1, block_tables.reshape(-1))
                             .view({2, bsz, -1, kv_heads, dim})
                             .permute({0, 1, 3, 2, 4});
  const at::Tensor o = at::scaled_dot_product_attention(qd, kvs[0], kvs[1], mask, 0.0, false, scale);
  return o.view({bsz, heads, dim});
}

}  // namespace

// x: [T, hidden] float32 embeddings (updated in place, returned normed by the final norm);
// weights: per layer, in order: input norm weight, qkv (q, scales, mins, dense), o (4),
// post-attention norm weight, gate_up (4), down (4) -- 18 tensors a layer (an empty tensor
// where a linear has no mins or no dense copy), then the final norm weight. kv: [L, 2, blocks, bs, Hkv, D].
// spans: flattened (first slot, context length) per row, or empty for the gathered path with
// block_tables [B, width]. mask: [B, 1, 1, width * bs] bool.
at::Tensor woq_decode(at::Tensor x, const std::vector<at::Tensor>& weights, const at::Tensor& kv,
                      const at::Tensor& cos2, const at::Tensor& sin2, const at::Tensor& slot_mapping,
                      const at::Tensor& mask, const std::vector<int64_t>& spans,
                      const at::Tensor& block_tables, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, double eps, double scale, int64_t dense_rows,
                      int64_t q4_dense_rows, bool lo, bool amx) {
  constexpr size_t kPerLayer = 18;
  const MatmulOptions opt{dense_rows, q4_dense_rows, lo, amx};
  const int64_t t = x.size(0), hidden = x.size(1);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const int64_t qk_heads = heads + kv_heads;
  const int64_t layers = kv.size(0);
  TORCH_CHECK(weights.size() == layers * kPerLayer + 1, "woq_decode: ", weights.size(),
              " weights for ", layers, " layers");
  const std::vector<int64_t> norm_shape{hidden};
  for (int64_t l = 0; l < layers; ++l) {
    const size_t base = l * kPerLayer;
    const at::Tensor cache = kv[l];
    at::Tensor h = at::rms_norm(x, norm_shape, weights[base], eps);
    const at::Tensor qkv = mm(h, linear_at(weights, base + 1), opt);
    at::Tensor qk = qkv.slice(1, 0, q_width + kv_width).view({t, qk_heads, head_dim});
    const at::Tensor swapped =
        qk.view({t, qk_heads, 2, head_dim / 2}).flip({2}).view({t, qk_heads, head_dim});
    at::add_out(qk, qk * cos2, swapped * sin2);
    const at::Tensor q = qk.slice(1, 0, heads);
    const at::Tensor new_kv = qkv.slice(1, q_width).view({t, 2, kv_heads, head_dim}).transpose(0, 1);
    cache.view({2, -1, kv_heads, head_dim}).index_copy_(1, slot_mapping, new_kv);
    const at::Tensor o = decode_attention(q, cache, mask, spans, block_tables, scale);
    x.add_(mm(o.reshape({t, q_width}), linear_at(weights, base + 5), opt));
    h = at::rms_norm(x, norm_shape, weights[base + 9], eps);
    const at::Tensor gu = mm(h, linear_at(weights, base + 10), opt);
    const int64_t inter = gu.size(1) / 2;
    const at::Tensor a = at::silu(gu.slice(1, 0, inter)).mul_(gu.slice(1, inter));
    x.add_(mm(a, linear_at(weights, base + 14), opt));
  }
  return at::rms_norm(x, norm_shape, weights.back(), eps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("woq_decode", &woq_decode, "a decode-only step of a woq-packed model (all layers)");
  m.def("int4_mm", &int4_mm, "x @ W.T for a 4-bit weight with fp16 group scales and minimums");
  m.def("int4_dequant_t", &int4_dequant_t, "the 4-bit weight's transpose as bf16 [K, N]");
}

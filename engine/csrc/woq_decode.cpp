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

namespace {

constexpr int64_t kGroup = 32;  // engine/packed_linear.py GROUP

struct Linear {
  at::Tensor qweight, scales_zeros, dense;  // dense: undefined when the linear has none
};

at::Tensor mm(const at::Tensor& x, const Linear& lin, int64_t dense_rows) {
  if (x.size(0) >= dense_rows && lin.dense.defined()) return at::linear(x, lin.dense);
  return at::_weight_int4pack_mm_for_cpu(x, lin.qweight, kGroup, lin.scales_zeros);
}

Linear linear_at(const std::vector<at::Tensor>& w, size_t i) {
  Linear lin{w[i], w[i + 1], w[i + 2]};
  if (lin.dense.numel() == 0) lin.dense = at::Tensor();
  return lin;
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
// weights: per layer, in order: input norm weight, qkv (qweight, scales_zeros, dense), o (3),
// post-attention norm weight, gate_up (3), down (3) -- 14 tensors a layer (an empty tensor
// where a linear has no dense copy), then the final norm weight. kv: [L, 2, blocks, bs, Hkv, D].
// spans: flattened (first slot, context length) per row, or empty for the gathered path with
// block_tables [B, width]. mask: [B, 1, 1, width * bs] bool.
at::Tensor woq_decode(at::Tensor x, const std::vector<at::Tensor>& weights, const at::Tensor& kv,
                      const at::Tensor& cos2, const at::Tensor& sin2, const at::Tensor& slot_mapping,
                      const at::Tensor& mask, const std::vector<int64_t>& spans,
                      const at::Tensor& block_tables, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, double eps, double scale, int64_t dense_rows) {
  constexpr size_t kPerLayer = 14;
  const int64_t t = x.size(0), hidden = x.size(1);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const int64_t qk_heads = heads + kv_heads;
  const int64_t layers = kv.size(0);
  TORCH_CHECK(weights.size() == layers * kPerLayer + 1, "woq_decode: ", weights.size(),
              " weights for ", layers, " layers");
  const std::vector<int64_t> norm_shape{hidden};
  const auto bf16 = at::kBFloat16;
  for (int64_t l = 0; l < layers; ++l) {
    const size_t base = l * kPerLayer;
    const at::Tensor cache = kv[l];
    at::Tensor h = at::rms_norm(x, norm_shape, weights[base], eps).to(bf16);
    const at::Tensor qkv = mm(h, linear_at(weights, base + 1), dense_rows).to(at::kFloat);
    at::Tensor qk = qkv.slice(1, 0, q_width + kv_width).view({t, qk_heads, head_dim});
    const at::Tensor swapped =
        qk.view({t, qk_heads, 2, head_dim / 2}).flip({2}).view({t, qk_heads, head_dim});
    at::add_out(qk, qk * cos2, swapped * sin2);
    const at::Tensor q = qk.slice(1, 0, heads);
    const at::Tensor new_kv = qkv.slice(1, q_width).view({t, 2, kv_heads, head_dim}).transpose(0, 1);
    cache.view({2, -1, kv_heads, head_dim}).index_copy_(1, slot_mapping, new_kv);
    const at::Tensor o = decode_attention(q, cache, mask, spans, block_tables, scale);
    x.add_(mm(o.reshape({t, q_width}).to(bf16), linear_at(weights, base + 4), dense_rows));
    h = at::rms_norm(x, norm_shape, weights[base + 7], eps).to(bf16);
    const at::Tensor gu = mm(h, linear_at(weights, base + 8), dense_rows).to(at::kFloat);
    const int64_t inter = gu.size(1) / 2;
    const at::Tensor a = at::silu(gu.slice(1, 0, inter)).mul_(gu.slice(1, inter));
    x.add_(mm(a.to(bf16), linear_at(weights, base + 11), dense_rows));
  }
  return at::rms_norm(x, norm_shape, weights.back(), eps);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("woq_decode", &woq_decode, "a decode-only step of a woq-packed model (all layers)");
}

// A decode-only step of a woq-packed model (engine/model/woq_forward.py), all layers in one call.
//
// Why by hand: on the 2-core CPU a decode step is ~45 ATen op calls a layer, and from Python
// each costs ~2-3 us of binding and dispatch (measured: an eager `x + 1` on a 576-wide row
// takes 2.2 us, a compiled one 14 us), ~4 ms of a ~12 ms step. torch.compile does not help
// here (its guards and wrapper cost more than they save: measured slower per layer), and no
// library runs "these ATen ops, in this order" without Python between them. This file calls
// the same computation as woq_forward.forward does for a step of decode rows only: the
// matmuls as PackedLinear.mm, the rest in engine/ops/cpu/csrc/decode_ops.cpp (the same float32
// arithmetic up to summation order: tests/test_woq_forward.py compares the two).
#include <torch/extension.h>

#include <vector>

#include "decode_ops.h"
#include "int4_mm.h"

namespace {

constexpr int64_t kGroup = 32;  // engine/ops/cpu/packed_linear.py GROUP

// PackedLinear's int4 buffers: (q4, d16, m16) of engine/ops/cpu/csrc/int4_mm.cpp, or torch's
// (qweight, scales_zeros) with `mins` undefined; dense: the bf16 copy, undefined if none
struct Linear {
  at::Tensor q, scales, mins, dense;
};

struct MatmulOptions {
  int64_t dense_rows;  // packed_linear.DENSE_ROWS
  bool lo, amx;
};

// PackedLinear.mm: float32 [T, K] -> float32 [T, N]
at::Tensor mm(const at::Tensor& x, const Linear& lin, const MatmulOptions& opt) {
  if (x.size(0) >= opt.dense_rows && lin.dense.defined())
    return at::linear(x.to(at::kBFloat16), lin.dense).to(at::kFloat);
  if (lin.mins.defined())  // every row count (packed_linear.py PackedLinear._int4 says why)
    return int4_mm(x, lin.q, lin.scales, lin.mins, opt.lo, opt.amx);
  return at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), lin.q, kGroup, lin.scales).to(at::kFloat);
}

at::Tensor defined_or_none(const at::Tensor& t) { return t.numel() == 0 ? at::Tensor() : t; }

Linear linear_at(const std::vector<at::Tensor>& w, size_t i) {
  return Linear{w[i], w[i + 1], defined_or_none(w[i + 2]), defined_or_none(w[i + 3])};
}

}  // namespace

// x: [T, hidden] float32 embeddings (updated in place; returned normed by the final norm);
// weights: per layer, in order: input norm weight, qkv (q, scales, mins, dense), o (4),
// post-attention norm weight, gate_up (4), down (4) -- 18 tensors a layer (an empty tensor
// where a linear has no mins or no dense copy), then the final norm weight. kv: [L, 2, blocks,
// bs, Hkv, D] float32; cos2/sin2 [T, 1, D]; row t attends to its first context_lens[t] slots
// through block_tables row t. Needs hidden, intermediate and head_dim multiples of 16 and a CPU
// with AVX-512 (engine/model/woq_forward.py checks).
at::Tensor woq_decode(at::Tensor x, const std::vector<at::Tensor>& weights, const at::Tensor& kv,
                      const at::Tensor& cos2, const at::Tensor& sin2, const at::Tensor& slot_mapping,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, double eps, double scale, int64_t dense_rows,
                      bool lo, bool amx) {
  constexpr size_t kPerLayer = 18;
  // its loops are AVX-512 (decode_ops.cpp): refused on a CPU without it, never an illegal
  // instruction (the caller checks first; a direct call must not kill the process either)
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"),
              "woq_decode: needs a CPU with AVX-512 (avx512f, avx512dq)");
  const MatmulOptions opt{dense_rows, lo, amx};
  // NOTE: the loops below take heads, kv_heads and head_dim as the cache's and the qkv rows'
  // layout: checked against kv here and against each matmul's output below (a mismatch read
  // and wrote past both; kv_heads 0 was a SIGFPE), never trusted
  TORCH_CHECK(x.dim() == 2 && kv.dim() == 6 && kv.size(1) == 2 && heads > 0 && kv_heads > 0 && head_dim > 0 &&
                  kv.size(4) == kv_heads && kv.size(5) == head_dim,
              "woq_decode: kv [L, 2, blocks, bs, ", kv_heads, ", ", head_dim, "] expected, got ", kv.sizes());
  const int64_t t = x.size(0), hidden = x.size(1);
  const int64_t layers = kv.size(0), block_size = kv.size(3);
  const int64_t slots = kv.size(2) * block_size;
  TORCH_CHECK(weights.size() == layers * kPerLayer + 1, "woq_decode: ", weights.size(),
              " weights for ", layers, " layers");
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat && kv.is_contiguous() &&
                  kv.scalar_type() == at::kFloat, "woq_decode: x and kv must be contiguous float32");
  const at::Tensor c2 = cos2.contiguous(), s2 = sin2.contiguous();
  const at::Tensor slot_ids = slot_mapping.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  // the loops below index the cache through these: every slot, block and length in range
  const int64_t width = tables.size(1), num_blocks = kv.size(2);
  TORCH_CHECK(slot_ids.numel() == t && tables.size(0) == t && lens.numel() == t && c2.numel() == t * head_dim &&
                  s2.numel() == t * head_dim && heads % kv_heads == 0 && head_dim % 16 == 0 && hidden % 16 == 0,
              "woq_decode: step inputs do not agree with ", t, " rows");
  for (int64_t i = 0; i < t; ++i) {
    const int64_t slot = slot_ids.data_ptr<int64_t>()[i], n = lens.data_ptr<int64_t>()[i];
    TORCH_CHECK(slot >= 0 && slot < slots && n >= 1 && n <= width * block_size,
                "woq_decode: row ", i, " has slot ", slot, " and context ", n, " out of range");
    const int64_t* row = tables.data_ptr<int64_t>() + i * width;
    for (int64_t j = 0; j < (n + block_size - 1) / block_size; ++j)
      TORCH_CHECK(row[j] >= 0 && row[j] < num_blocks, "woq_decode: row ", i, " block ", row[j], " out of range");
  }
  at::Tensor h = at::empty_like(x);
  at::Tensor o = at::empty({t, heads * head_dim}, x.options());
  float* xp = x.data_ptr<float>();
  for (int64_t l = 0; l < layers; ++l) {
    const size_t base = l * kPerLayer;
    float* cache = kv[l].data_ptr<float>();
    TORCH_CHECK(weights[base].numel() == hidden && weights[base + 9].numel() == hidden,
                "woq_decode: layer ", l, " norm weights are not ", hidden, " wide");
    rms_norm_rows(xp, weights[base].data_ptr<float>(), eps, t, hidden, h.data_ptr<float>());
    at::Tensor qkv = mm(h, linear_at(weights, base + 1), opt).contiguous();
    TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "woq_decode: layer ", l, " qkv is ",
                qkv.size(1), " wide, not (", heads, " + 2 x ", kv_heads, ") x ", head_dim);
    rope_write(qkv.data_ptr<float>(), c2.data_ptr<float>(), s2.data_ptr<float>(), slot_ids.data_ptr<int64_t>(),
               t, heads, kv_heads, head_dim, cache, slots);
    attend(qkv.data_ptr<float>(), cache, slots, tables.data_ptr<int64_t>(), tables.size(1), block_size,
           lens.data_ptr<int64_t>(), t, heads, kv_heads, head_dim, static_cast<float>(scale), o.data_ptr<float>());
    x.add_(mm(o, linear_at(weights, base + 5), opt));
    rms_norm_rows(xp, weights[base + 9].data_ptr<float>(), eps, t, hidden, h.data_ptr<float>());
    const at::Tensor gu = mm(h, linear_at(weights, base + 10), opt).contiguous();
    const int64_t inter = gu.size(1) / 2;
    TORCH_CHECK(gu.size(1) % 32 == 0, "woq_decode: layer ", l, " gate_up is ", gu.size(1), " wide");
    at::Tensor a = at::empty({t, inter}, x.options());
    silu_mul(gu.data_ptr<float>(), t, inter, a.data_ptr<float>());
    x.add_(mm(a, linear_at(weights, base + 14), opt));
  }
  TORCH_CHECK(weights.back().numel() == hidden, "woq_decode: the final norm weight is not ", hidden, " wide");
  at::Tensor out = at::empty_like(x);
  rms_norm_rows(xp, weights.back().data_ptr<float>(), eps, t, hidden, out.data_ptr<float>());
  return out;
}

// PackedLinear's head: the exact logits of each row's candidates (engine/ops/cpu/csrc/decode_ops.cpp)
at::Tensor head_logits_exact(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales,
                             const at::Tensor& ids_in) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq"),
              "head_logits_exact: needs a CPU with AVX-512 (avx512f, avx512dq)");
  TORCH_CHECK(x_in.dim() == 2 && q.dim() == 3 && scales.dim() == 2 && ids_in.dim() == 2 &&
                  q.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat && q.is_contiguous() &&
                  scales.is_contiguous(), "head_logits_exact: x [T, K], q [C, N, chunk] int8, scales [C, N] float32");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t T = x.size(0), K = x.size(1), C = q.size(0), N = q.size(1), chunk = q.size(2), top = ids.size(1);
  TORCH_CHECK(C * chunk == K && chunk % 16 == 0 && scales.size(0) == C && scales.size(1) == N && ids.size(0) == T,
              "head_logits_exact: shapes do not agree");
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * top; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < N, "head_logits_exact: id ", idp[i], " out of range");
  at::Tensor out = at::empty({T, top}, x.options());
  head_logits(x.data_ptr<float>(), T, K, q.data_ptr<int8_t>(), scales.data_ptr<float>(), C, N, chunk, idp, top,
              out.data_ptr<float>());
  return out;
}

// NOTE: each call lets go of the GIL (its arguments are converted before, its result after):
// held, a whole decode step (10+ ms, far more at 100+ rows) stopped the event loop's thread,
// which the step thread exists to run beside the step (ATen's ops in the Python loop release it)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("woq_decode", &woq_decode, "a decode-only step of a woq-packed model (all layers)", nogil());
  m.def("int4_mm", &int4_mm, "x @ W.T for a 4-bit weight with fp16 group scales and minimums", nogil());
  m.def("int4_dequant_t", &int4_dequant_t, "the 4-bit weight's transpose [K, N], float32 or bf16",
        py::arg("q"), py::arg("d"), py::arg("m"), py::arg("f32") = false, nogil());
  m.def("head_logits_exact", &head_logits_exact, "the LM head's exact logits at candidate ids", nogil());
}

// Attention over strided per-head views: the problem description every kernel takes, and
// the textbook loops that judge them (in double: the oracle, never removed). Backends' kernels live in
// core/cpu/ and core/cuda/.
#ifndef ATTENTION_CORE_ATTENTION_KERNELS_H_
#define ATTENTION_CORE_ATTENTION_KERNELS_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "core/attention_options.h"
#include "core/mha_types.h"

namespace attention::core {

// Where row i of head h of sequence b lives: base + b*batch + h*head + i*row (in floats).
struct HeadLayout {
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;

  int64_t Offset(int64_t b, int64_t h, int64_t i) const {
    return b * batch_stride + h * head_stride + i * row_stride;
  }
  // [B, heads, rows, width], as torch lays out SDPA inputs.
  static HeadLayout BatchHeadRow(int64_t heads, int64_t rows, int64_t width) {
    return {heads * rows * width, rows * width, width};
  }
  // [B, rows, heads, width], as projections come out of a GEMM over tokens.
  static HeadLayout BatchRowHead(int64_t heads, int64_t rows, int64_t width) {
    return {rows * heads * width, width, heads * width};
  }
  // The same with `row_stride` floats between tokens, e.g. Q, K and V as column ranges of
  // one fused projection.
  static HeadLayout StridedRows(int64_t rows, int64_t width, int64_t row_stride) {
    return {rows * row_stride, width, row_stride};
  }
};

// Kernels take float problems; the textbook loops also take double ones.
template <typename T>
struct AttentionProblemOf {
  AttentionDims dims;
  const T* query = nullptr;  // rows of dk
  HeadLayout query_layout;
  const T* key = nullptr;  // rows of dk, Hkv heads
  HeadLayout key_layout;
  const T* value = nullptr;  // rows of dv, Hkv heads
  HeadLayout value_layout;
  T* output = nullptr;  // rows of dv, H heads
  HeadLayout output_layout;
  // Null, or dense per-head attention weights [B, H, Nq, Nk] after masking and dropout.
  T* weights = nullptr;
  // Null, or per row the natural log of its softmax normaliser over the scaled, masked
  // scores (before dropout), -inf for a fully masked row: one float per (b, h, i) at
  // log_sum_exp_layout.Offset(b, h, i). Only AttentionBlockedCpu writes it (paged prefill).
  T* log_sum_exp = nullptr;
  HeadLayout log_sum_exp_layout;
  const AttentionOptions* options = nullptr;  // validated against dims; not owned
  // AttentionBlockedCpu multiplies scores and values in bf16 (Q, K, probabilities and V
  // rounded, float32 accumulation; softmax in float32): a BFLOAT16 layer on a CPU with
  // AVX512-BF16.
  bool bf16_products = false;
  // With bf16_products and no weights: Q, K and V already rounded to bf16, in the layouts
  // above (query, key and value then unused). A BFLOAT16 layer's projections write them so.
  const uint16_t* query_bf16 = nullptr;
  const uint16_t* key_bf16 = nullptr;
  const uint16_t* value_bf16 = nullptr;
  // Null, or where the output rows go rounded to bf16 instead of `output` (its layout):
  // what a BFLOAT16 layer's output projection reads.
  uint16_t* output_bf16 = nullptr;
  // A FLOAT16 scaled dot-product attention call: products in fp16 where a backend has them
  // (cuDNN's fused SDPA on a GPU); every other path computes it in float32.
  bool fp16_products = false;
};
using AttentionProblem = AttentionProblemOf<float>;

// Naive loops with every product, sum and exp in T (float and double are compiled): in
// double the oracle; in float the plain evaluation whose error bounds a fast path's
// (FlashAttention's rule: max|fast - oracle| <= 2 max|float textbook - oracle| + floor).
template <typename T>
void AttentionTextbook(const AttentionProblemOf<T>& problem);

// The key/value head that query head h reads (GQA: H / Hkv query heads share one).
inline int64_t KvHead(const AttentionDims& dims, int64_t h) {
  return h / (dims.num_heads / dims.num_kv_heads);
}

// [B, H, Nq, Nk] -> [B, Nq, Nk], mean over heads.
template <typename T>
std::vector<T> AverageHeads(absl::Span<const T> per_head, const AttentionDims& d) {
  std::vector<T> averaged(d.batch * d.q_len * d.kv_len, T{0});
  const int64_t plane = d.q_len * d.kv_len;
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.num_heads; ++h) {
      const T* src = per_head.data() + (b * d.num_heads + h) * plane;
      T* dst = averaged.data() + b * plane;
      for (int64_t e = 0; e < plane; ++e) dst[e] += src[e] / d.num_heads;
    }
  }
  return averaged;
}

// Kernels write per-head weights; this averages them over heads when that was asked.
void FinishWeights(AttentionResult& result, const AttentionDims& dims, NeedWeights need);

// The problem of scaled dot-product attention on [B, heads, rows, width] tensors in T
// (`weights` may be null), with `input`'s dims and options.
template <typename T>
AttentionProblemOf<T> SdpaProblem(const SdpaInput& input, const T* query, const T* key,
                                  const T* value, T* output, T* weights) {
  const AttentionDims& d = input.dims;
  AttentionProblemOf<T> p;
  p.dims = d;
  p.query = query;
  p.query_layout = HeadLayout::BatchHeadRow(d.num_heads, d.q_len, d.head_dim);
  p.key = key;
  p.key_layout = HeadLayout::BatchHeadRow(d.num_kv_heads, d.kv_len, d.head_dim);
  p.value = value;
  p.value_layout = HeadLayout::BatchHeadRow(d.num_kv_heads, d.kv_len, d.v_head_dim);
  p.output = output;
  p.output_layout = HeadLayout::BatchHeadRow(d.num_heads, d.q_len, d.v_head_dim);
  p.weights = weights;
  p.options = &input.options;
  p.bf16_products = input.compute_dtype == DType::kBFloat16;
  p.fp16_products = input.compute_dtype == DType::kFloat16;
  return p;
}

// The problem of an input's own tensors, writing into `result`, whose output (and
// weights, when asked) are already sized.
inline AttentionProblem SdpaProblem(const SdpaInput& input, AttentionResult& result) {
  return SdpaProblem(input, input.query.data(), input.key.data(), input.value.data(),
                     result.output.data(),
                     result.weights.empty() ? nullptr : result.weights.data());
}

}  // namespace attention::core

#endif  // ATTENTION_CORE_ATTENTION_KERNELS_H_

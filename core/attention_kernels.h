// Attention over strided per-head views: the problem description every kernel takes, and
// the double-precision reference (the oracle, never removed). Backends' kernels live in
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

struct AttentionProblem {
  AttentionDims dims;
  const float* query = nullptr;  // rows of dk
  HeadLayout query_layout;
  const float* key = nullptr;  // rows of dk, Hkv heads
  HeadLayout key_layout;
  const float* value = nullptr;  // rows of dv, Hkv heads
  HeadLayout value_layout;
  float* output = nullptr;  // rows of dv, H heads
  HeadLayout output_layout;
  // Null, or dense per-head attention weights [B, H, Nq, Nk] after masking and dropout.
  float* weights = nullptr;
  const AttentionOptions* options = nullptr;  // validated against dims; not owned
};

// Naive, double accumulation.
void AttentionReference(const AttentionProblem& problem);

// The key/value head that query head h reads (GQA: H / Hkv query heads share one).
inline int64_t KvHead(const AttentionDims& dims, int64_t h) {
  return h / (dims.num_heads / dims.num_kv_heads);
}

// [B, H, Nq, Nk] -> [B, Nq, Nk], mean over heads.
std::vector<float> AverageHeads(absl::Span<const float> per_head, const AttentionDims& dims);

// Kernels write per-head weights; this averages them over heads when that was asked.
void FinishWeights(AttentionResult& result, const AttentionDims& dims, NeedWeights need);

// The problem of a scaled dot-product attention input ([B, heads, rows, width] tensors),
// writing into `result`, whose output (and weights, when asked) are already sized.
AttentionProblem SdpaProblem(const SdpaInput& input, AttentionResult& result);

}  // namespace attention::core

#endif  // ATTENTION_CORE_ATTENTION_KERNELS_H_

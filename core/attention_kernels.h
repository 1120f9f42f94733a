// Attention kernels over strided per-head views: the double-precision reference (the
// oracle, never removed) and the blocked float32 CPU kernel used in production.
#ifndef ATTENTION_CORE_ATTENTION_KERNELS_H_
#define ATTENTION_CORE_ATTENTION_KERNELS_H_

#include <algorithm>
#include <cstdint>

#include "absl/types/span.h"
#include "core/attention_options.h"
#include "core/thread_pool.h"

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

// Blocked float32 kernel: for each (sequence, head, block of QueryBlockRows(Nk) queries),
// GEMMs for the scores against the keys up to the block's causal frontier, a vectorized
// masked softmax, GEMMs with the values. Past 1024 keys (and when no weights are returned)
// the keys are taken in blocks with an online softmax (running max and sum, flash-style),
// so extra memory is at most rows x 1024 floats per thread: no Nq x Nk matrix unless
// weights are requested. All problems share one ParallelFor, so a batch of many small
// requests keeps every thread busy.
void AttentionBlockedCpu(absl::Span<const AttentionProblem> problems, ThreadPool& pool);

// Query rows per block: as many as keep the block's scores within 1 MiB (half of a
// 2 MiB L2, the rest for the K and V tiles), between 64 and 256. Taller blocks make the
// two GEMMs more efficient; short keys allow them.
inline int64_t QueryBlockRows(int64_t kv_len) {
  constexpr int64_t kScoreFloats = (1024 << 10) / sizeof(float);
  const int64_t rows = kScoreFloats / std::max<int64_t>(kv_len, 1);
  return std::clamp<int64_t>(rows, 64, 256);
}

}  // namespace attention::core

#endif  // ATTENTION_CORE_ATTENTION_KERNELS_H_

// How a layer's forward pass runs over one batch: where each input's rows sit in the packed
// token matrices, whether Q, K and V are one GEMM, each input's RoPE base, attention sizes
// and options. Plain host logic, planned once here and run by every backend (as ggml builds
// the graph once and backends only run it), so that a new path (decode) is planned once too.
#ifndef ATTENTION_CORE_FORWARD_PLAN_H_
#define ATTENTION_CORE_FORWARD_PLAN_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/types/span.h"
#include "core/attention_kernels.h"
#include "core/attention_options.h"
#include "core/mha_types.h"

namespace attention::core {

struct ForwardPlan {
  // One input of the batch.
  struct Input {
    int64_t q_row = 0;         // its first query row in the packed query tokens
    int64_t kv_row = 0;        // its first key/value row in the packed key and value tokens
    AttentionDims dims;        // the layer's heads over the input's sequences
    AttentionOptions options;  // the request's, with the layer's causal flag and window
    double rotary_base = 0.0;  // 0 when the layer has no rotary embedding

    int64_t q_rows() const { return dims.batch * dims.q_len; }
    int64_t kv_rows() const { return dims.batch * dims.kv_len; }
  };

  std::vector<Input> inputs;
  int64_t q_rows = 0;   // query tokens of the whole batch
  int64_t kv_rows = 0;  // key/value tokens of the whole batch
  // Every input is self-attention: keys and values are projected from the query tokens.
  bool all_self_attention = true;
  // Q, K and V come from one GEMM against the fused weight, as column ranges of one
  // [q_rows, Q + K + V] matrix: only when every input is self-attention.
  bool fused_qkv = false;
  // Floats from one token's projected Q (K, V) row to the next: Q + K + V when fused.
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;

  // Input n's attention over projected `q`, `k`, `v` (at this plan's strides, first token
  // of the batch) into `attended` ([q_rows, H * dv]); no weights. Options point into
  // the plan, which must outlive the problem.
  AttentionProblem Attention(size_t n, const float* q, const float* k, const float* v,
                             float* attended) const;
  // The same with the attended rows rounded to bf16 into `attended` (bf16 products).
  AttentionProblem Attention(size_t n, const float* q, const float* k, const float* v,
                             uint16_t* attended) const;
  // The same over Q, K and V already rounded to bf16 (bf16 products; no weights), into
  // `attended` in bf16.
  AttentionProblem AttentionBf16(size_t n, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                 uint16_t* attended) const;

 private:
  // Input n's problem with its layouts, but no Q, K, V or output yet.
  AttentionProblem Shape(size_t n) const;
  // The same reading float32 `q`, `k`, `v`.
  AttentionProblem FloatSources(size_t n, const float* q, const float* k, const float* v) const;
  // Where input n's attended rows start in the batch's.
  int64_t AttendedOffset(size_t n) const;
};

// The plan of `inputs` (16-bit or float32) for a layer of `config`; `has_fused_qkv_weight`
// says whether the layer's weights hold Q, K and V as one matrix (MhaWeightsView).
ForwardPlan PlanForward(const MhaConfig& config, absl::Span<const MhaInput* const> inputs,
                        bool has_fused_qkv_weight);

// Copies float32 input `in`, planned as `input`, into the packed token matrices: its query
// rows into `x` ([q_rows, E]), its key and value rows (its query rows for self-attention)
// into `key_input` ([kv_rows, kdim]) and `value_input` ([kv_rows, vdim]); null skips one.
// `copy(from, to)` does each copy when given (a GPU's staging copies run on several threads).
using CopyFloats = std::function<void(absl::Span<const float> from, float* to)>;
void PackInputTokens(const MhaConfig& config, const ForwardPlan::Input& input, const MhaInput& in,
                     float* x, float* key_input, float* value_input,
                     const CopyFloats& copy = nullptr);

}  // namespace attention::core

#endif  // ATTENTION_CORE_FORWARD_PLAN_H_

// The steps of a CPU forward pass that float32 layers (cpu_backend.cc) and BFLOAT16 layers
// (bf16_layer.cc) share around their projections.
#ifndef ATTENTION_CORE_CPU_FORWARD_STEPS_H_
#define ATTENTION_CORE_CPU_FORWARD_STEPS_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cpu/thread_pool.h"
#include "core/forward_plan.h"
#include "core/mha_types.h"

namespace attention::core {

// RoPE on every planned input's projected Q and K rows (at the plan's strides, each input
// with its own base), in place, on the pool's threads; nothing without RoPE.
void RotatePlanned(const MhaConfig& config, const ForwardPlan& plan, float* q, float* k,
                   ThreadPool& pool);

// Every planned input's attention over projected `q`, `k`, `v` into `attended` ([q_rows,
// H * dv]), scores and values multiplied in bf16 on `bf16_products`' kernel where it has one,
// else in float32. One result per input,
// holding its attention weights when it asked (averaged if so); outputs still to deliver.
std::vector<AttentionResult> AttendPlanned(const ForwardPlan& plan,
                                           absl::Span<const MhaInput* const> inputs, const float* q,
                                           const float* k, const float* v, float* attended,
                                           std::optional<Bf16Kernel> bf16_products,
                                           ThreadPool& pool);
// The same with bf16 products on `kernel`, the attended rows rounded to bf16 into `attended`.
std::vector<AttentionResult> AttendPlanned(const ForwardPlan& plan,
                                           absl::Span<const MhaInput* const> inputs, const float* q,
                                           const float* k, const float* v, uint16_t* attended,
                                           Bf16Kernel kernel, ThreadPool& pool);
// The same over Q, K and V already rounded to bf16 (bf16 products), into `attended` in
// bf16, for inputs that ask for no attention weights.
std::vector<AttentionResult> AttendPlannedBf16(const ForwardPlan& plan,
                                               absl::Span<const MhaInput* const> inputs,
                                               const uint16_t* q, const uint16_t* k,
                                               const uint16_t* v, uint16_t* attended,
                                               Bf16Kernel kernel, ThreadPool& pool);

// Hands each input its rows of the batch's `output` ([q_rows, output_dim]).
void DeliverPlanned(const ForwardPlan& plan, absl::Span<const MhaInput* const> inputs,
                    const float* output, int64_t output_dim, std::vector<AttentionResult>& results);

// A session's decode rows: fused [rows, Q + K + V] projections copied apart into q, k, v.
void SplitFusedRows(const MhaConfig& config, const float* qkv, int64_t rows, float* q, float* k,
                    float* v);
// RoPE on decode rows of q and k at the tokens' absolute positions (base theta: sessions
// refuse dynamic scaling); nothing without RoPE.
void RotateAtPositions(const MhaConfig& config, absl::Span<const int64_t> positions, float* q,
                       float* k);

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_FORWARD_STEPS_H_

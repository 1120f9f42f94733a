#include "core/cpu/forward_steps.h"

#include <algorithm>
#include <optional>

#include "core/attention_kernels.h"
#include "core/cpu/attention_cpu.h"
#include "core/cpu/cpu_backend.h"

namespace attention::core {

void RotatePlanned(const MhaConfig& c, const ForwardPlan& plan, float* q, float* k,
                   ThreadPool& pool) {
  if (c.rope_theta <= 0.0) return;
  // One table of angles, as long as the longest input, for every input of its base (sincos
  // costs as much as rotating); rebuilt only where dynamic scaling changes the base.
  int64_t longest = 0;
  for (const ForwardPlan::Input& in : plan.inputs) {
    longest = std::max({longest, in.dims.q_len, in.dims.kv_len});
  }
  std::optional<RotaryAngles> angles;
  for (const ForwardPlan::Input& in : plan.inputs) {
    if (!angles.has_value() || angles->base() != in.rotary_base) {
      angles = RotaryAngles::FirstPositions(longest, c.head_dim, in.rotary_base, c.rope_scaling);
    }
    ApplyRotary(q + in.q_row * plan.q_stride, in.q_rows(), in.dims.q_len, c.num_heads, c.head_dim,
                *angles, plan.q_stride, &pool);
    ApplyRotary(k + in.kv_row * plan.k_stride, in.kv_rows(), in.dims.kv_len, c.num_kv_heads,
                c.head_dim, *angles, plan.k_stride, &pool);
  }
}

namespace {

// Runs `problems` (one per input) and gives each input its result, with its weights when it
// asked for them.
std::vector<AttentionResult> Attend(absl::Span<const MhaInput* const> inputs,
                                    std::vector<AttentionProblem>& problems, Bf16Kernel kernel,
                                    ThreadPool& pool) {
  std::vector<AttentionResult> results(inputs.size());
  for (size_t n = 0; n < inputs.size(); ++n) {
    const AttentionDims& d = problems[n].dims;
    if (inputs[n]->options.need_weights != NeedWeights::kNone) {
      results[n].weights.resize(d.batch * d.num_heads * d.q_len * d.kv_len);
      problems[n].weights = results[n].weights.data();
    }
  }
  AttentionBlockedCpu(problems, pool, kernel);
  for (size_t n = 0; n < inputs.size(); ++n) {
    FinishWeights(results[n], problems[n].dims, inputs[n]->options.need_weights);
  }
  return results;
}

}  // namespace

std::vector<AttentionResult> AttendPlanned(const ForwardPlan& plan,
                                           absl::Span<const MhaInput* const> inputs, const float* q,
                                           const float* k, const float* v, float* attended,
                                           std::optional<Bf16Kernel> bf16_products,
                                           ThreadPool& pool) {
  std::vector<AttentionProblem> problems(inputs.size());
  for (size_t n = 0; n < inputs.size(); ++n) {
    problems[n] = plan.Attention(n, q, k, v, attended);
    problems[n].bf16_products = bf16_products.has_value();
  }
  return Attend(inputs, problems, bf16_products.value_or(Bf16Kernel::kPortable), pool);
}

std::vector<AttentionResult> AttendPlanned(const ForwardPlan& plan,
                                           absl::Span<const MhaInput* const> inputs, const float* q,
                                           const float* k, const float* v, uint16_t* attended,
                                           Bf16Kernel kernel, ThreadPool& pool) {
  std::vector<AttentionProblem> problems(inputs.size());
  for (size_t n = 0; n < inputs.size(); ++n) problems[n] = plan.Attention(n, q, k, v, attended);
  return Attend(inputs, problems, kernel, pool);
}

std::vector<AttentionResult> AttendPlannedBf16(const ForwardPlan& plan,
                                               absl::Span<const MhaInput* const> inputs,
                                               const uint16_t* q, const uint16_t* k,
                                               const uint16_t* v, uint16_t* attended,
                                               Bf16Kernel kernel, ThreadPool& pool) {
  std::vector<AttentionProblem> problems(inputs.size());
  for (size_t n = 0; n < inputs.size(); ++n) {
    problems[n] = plan.AttentionBf16(n, q, k, v, attended);
  }
  return Attend(inputs, problems, kernel, pool);
}

void DeliverPlanned(const ForwardPlan& plan, absl::Span<const MhaInput* const> inputs,
                    const float* output, int64_t output_dim,
                    std::vector<AttentionResult>& results) {
  for (size_t n = 0; n < inputs.size(); ++n) {
    DeliverOutput(*inputs[n], output + plan.inputs[n].q_row * output_dim,
                  plan.inputs[n].q_rows() * output_dim, &results[n]);
  }
}

void SplitFusedRows(const MhaConfig& c, const float* qkv, int64_t rows, float* q, float* k,
                    float* v) {
  const int64_t width = c.QWidth() + c.KWidth() + c.VWidth();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = qkv + r * width;
    std::copy_n(row, c.QWidth(), q + r * c.QWidth());
    std::copy_n(row + c.QWidth(), c.KWidth(), k + r * c.KWidth());
    std::copy_n(row + c.QWidth() + c.KWidth(), c.VWidth(), v + r * c.VWidth());
  }
}

void RotateAtPositions(const MhaConfig& c, absl::Span<const int64_t> positions, float* q,
                       float* k) {
  if (c.rope_theta <= 0.0) return;
  ApplyRotaryAt(q, positions, c.num_heads, c.head_dim, c.rope_theta, c.QWidth(), c.rope_scaling);
  ApplyRotaryAt(k, positions, c.num_kv_heads, c.head_dim, c.rope_theta, c.KWidth(), c.rope_scaling);
}

}  // namespace attention::core

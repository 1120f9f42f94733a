#include "core/forward_plan.h"

#include <algorithm>

namespace attention::core {

ForwardPlan PlanForward(const MhaConfig& c, absl::Span<const MhaInput* const> inputs,
                        bool has_fused_qkv_weight) {
  ForwardPlan plan;
  plan.inputs.resize(inputs.size());
  for (size_t n = 0; n < inputs.size(); ++n) {
    const MhaInput& in = *inputs[n];
    ForwardPlan::Input& planned = plan.inputs[n];
    planned.q_row = plan.q_rows;
    planned.kv_row = plan.kv_rows;
    planned.dims = {in.batch,  c.num_heads, c.num_kv_heads, in.q_len,
                    in.kv_len, c.head_dim,  c.v_head_dim};
    planned.options = c.LayerOptions(in.options);
    // Dynamic RoPE scaling depends on the longer of the two sequences.
    if (c.rope_theta > 0.0) planned.rotary_base = c.RotaryBaseFor(std::max(in.q_len, in.kv_len));
    plan.q_rows += planned.q_rows();
    plan.kv_rows += planned.kv_rows();
    plan.all_self_attention = plan.all_self_attention && in.self_attention();
  }
  plan.fused_qkv = plan.all_self_attention && has_fused_qkv_weight;
  const int64_t fused_width = c.QWidth() + c.KWidth() + c.VWidth();
  plan.q_stride = plan.fused_qkv ? fused_width : c.QWidth();
  plan.k_stride = plan.fused_qkv ? fused_width : c.KWidth();
  plan.v_stride = plan.fused_qkv ? fused_width : c.VWidth();
  return plan;
}

AttentionProblem ForwardPlan::Shape(size_t n) const {
  const Input& in = inputs[n];
  const AttentionDims& d = in.dims;
  AttentionProblem p;
  p.dims = d;
  p.query_layout = HeadLayout::StridedRows(d.q_len, d.head_dim, q_stride);
  p.key_layout = HeadLayout::StridedRows(d.kv_len, d.head_dim, k_stride);
  p.value_layout = HeadLayout::StridedRows(d.kv_len, d.v_head_dim, v_stride);
  p.output_layout = HeadLayout::BatchRowHead(d.num_heads, d.q_len, d.v_head_dim);
  p.options = &in.options;
  return p;
}

AttentionProblem ForwardPlan::FloatSources(size_t n, const float* q, const float* k,
                                           const float* v) const {
  AttentionProblem p = Shape(n);
  p.query = q + inputs[n].q_row * q_stride;
  p.key = k + inputs[n].kv_row * k_stride;
  p.value = v + inputs[n].kv_row * v_stride;
  return p;
}

AttentionProblem ForwardPlan::Attention(size_t n, const float* q, const float* k, const float* v,
                                        float* attended) const {
  AttentionProblem p = FloatSources(n, q, k, v);
  p.output = attended + AttendedOffset(n);
  return p;
}

AttentionProblem ForwardPlan::Attention(size_t n, const float* q, const float* k, const float* v,
                                        uint16_t* attended) const {
  AttentionProblem p = FloatSources(n, q, k, v);
  p.output_bf16 = attended + AttendedOffset(n);
  p.bf16_products = true;
  return p;
}

AttentionProblem ForwardPlan::AttentionBf16(size_t n, const uint16_t* q, const uint16_t* k,
                                            const uint16_t* v, uint16_t* attended) const {
  AttentionProblem p = Shape(n);
  p.query_bf16 = q + inputs[n].q_row * q_stride;
  p.key_bf16 = k + inputs[n].kv_row * k_stride;
  p.value_bf16 = v + inputs[n].kv_row * v_stride;
  p.output_bf16 = attended + AttendedOffset(n);
  p.bf16_products = true;
  return p;
}

int64_t ForwardPlan::AttendedOffset(size_t n) const {
  const AttentionDims& d = inputs[n].dims;
  return inputs[n].q_row * d.num_heads * d.v_head_dim;
}

void PackInputTokens(const MhaConfig& c, const ForwardPlan::Input& input, const MhaInput& in,
                     float* x, float* key_input, float* value_input, const CopyFloats& copy) {
  const auto copy_to = [&copy](absl::Span<const float> from, float* to) {
    if (copy) {
      copy(from, to);
    } else {
      std::copy(from.begin(), from.end(), to);
    }
  };
  const absl::Span<const float> key = in.key.empty() ? in.query : in.key;
  const absl::Span<const float> value = in.value.empty() ? in.query : in.value;
  if (x != nullptr) copy_to(in.query, x + input.q_row * c.embed_dim);
  if (key_input != nullptr) copy_to(key, key_input + input.kv_row * c.kdim);
  if (value_input != nullptr) copy_to(value, value_input + input.kv_row * c.vdim);
}

}  // namespace attention::core

#include "core/cuda/staging.h"

#include <cstring>

namespace attention::core::cuda {
namespace {

DeviceLayout ToDevice(const HeadLayout& layout) {
  return {layout.batch_stride, layout.head_stride, layout.row_stride};
}

AttentionShape ToShape(const AttentionDims& d) {
  return {d.batch, d.num_heads, d.num_kv_heads, d.q_len, d.kv_len, d.head_dim, d.v_head_dim};
}

}  // namespace

void StagedMask::Plan(const AttentionOptions& o, Arena& arena) {
  if (!o.key_lengths.empty()) key_lengths = arena.Add(o.key_lengths.size() * sizeof(int64_t));
  if (!o.key_padding_keep.empty()) key_padding = arena.Add(o.key_padding_keep.size());
  if (!o.attn_mask_keep.empty()) mask_keep = arena.Add(o.attn_mask_keep.size());
  if (!o.attn_mask_bias.empty()) mask_bias = arena.Add(o.attn_mask_bias.size() * sizeof(float));
}

void StagedMask::Stage(const AttentionOptions& o, char* staging) const {
  auto copy = [staging](int64_t offset, const void* data, size_t bytes) {
    if (offset >= 0) std::memcpy(staging + offset, data, bytes);
  };
  copy(key_lengths, o.key_lengths.data(), o.key_lengths.size() * sizeof(int64_t));
  copy(key_padding, o.key_padding_keep.data(), o.key_padding_keep.size());
  copy(mask_keep, o.attn_mask_keep.data(), o.attn_mask_keep.size());
  copy(mask_bias, o.attn_mask_bias.data(), o.attn_mask_bias.size() * sizeof(float));
}

MaskView StagedMask::View(const AttentionOptions& o, const AttentionDims& dims,
                          char* device) const {
  MaskView view = o.View(dims);
  auto at = [device](int64_t offset) { return offset >= 0 ? device + offset : nullptr; };
  view.key_lengths = reinterpret_cast<const int64_t*>(at(key_lengths));
  view.key_padding_keep = reinterpret_cast<const uint8_t*>(at(key_padding));
  view.attn_mask_keep = reinterpret_cast<const uint8_t*>(at(mask_keep));
  view.attn_mask_bias = reinterpret_cast<const float*>(at(mask_bias));
  return view;
}

void StagedWeights::PlanOutput(const AttentionDims& d, NeedWeights need, Arena& arena) {
  if (need == NeedWeights::kNone) return;
  count = d.batch * d.num_heads * d.q_len * d.kv_len;
  weights = arena.Add(count * sizeof(float));
}

void StagedWeights::PlanScratch(const AttentionDims& d, NeedWeights need, Arena& arena) {
  if (need == NeedWeights::kNone) return;
  row_max = arena.Add(d.batch * d.num_heads * d.q_len * sizeof(float));
  row_sum = arena.Add(d.batch * d.num_heads * d.q_len * sizeof(float));
}

void StagedWeights::Attach(char* device, DeviceAttentionProblem& problem) const {
  if (weights < 0) return;
  problem.weights = reinterpret_cast<float*>(device + weights);
  problem.row_max = reinterpret_cast<float*>(device + row_max);
  problem.row_sum = reinterpret_cast<float*>(device + row_sum);
}

void StagedWeights::CopyOut(const char* staging, std::vector<float>& out) const {
  if (weights < 0) return;
  out.resize(count);
  std::memcpy(out.data(), staging + weights, count * sizeof(float));
}

DeviceAttentionProblem ToDeviceProblem(const AttentionProblem& problem, const StagedMask& mask,
                                       const StagedWeights& weights, char* device) {
  const AttentionOptions& options = *problem.options;
  DeviceAttentionProblem p;
  p.shape = ToShape(problem.dims);
  p.query = problem.query;
  p.query_layout = ToDevice(problem.query_layout);
  p.key = problem.key;
  p.key_layout = ToDevice(problem.key_layout);
  p.value = problem.value;
  p.value_layout = ToDevice(problem.value_layout);
  p.output = problem.output;
  p.output_layout = ToDevice(problem.output_layout);
  p.mask = mask.View(options, problem.dims, device);
  p.scale = options.Scale(problem.dims);
  p.dropout_p = options.dropout_p;
  p.dropout_seed = options.dropout_seed;
  p.bf16_products = problem.bf16_products;
  p.fp16_products = problem.fp16_products;
  p.host_key_lengths = options.key_lengths.empty() ? nullptr : options.key_lengths.data();
  p.host_key_padding_keep =
      options.key_padding_keep.empty() ? nullptr : options.key_padding_keep.data();
  weights.Attach(device, p);
  return p;
}

}  // namespace attention::core::cuda

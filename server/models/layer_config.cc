#include "server/models/layer_config.h"

#include <cctype>
#include <map>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "proto/tensor_codec.h"
#include "server/common/status_util.h"

namespace attention::server {

absl::StatusOr<BatchLimitOverrides> ConvertBatchingPolicy(const v1::BatchingPolicy& policy,
                                                          absl::string_view field) {
  BatchLimitOverrides overrides;
  if (policy.has_max_batch_requests()) overrides.max_batch_requests = policy.max_batch_requests();
  if (policy.has_max_batch_tokens()) overrides.max_batch_tokens = policy.max_batch_tokens();
  // Durations are checked here, to name the wire field and its unit.
  auto microseconds = [&](absl::string_view name, int64_t value, absl::string_view note,
                          std::optional<absl::Duration>& out) {
    if (value < 0) return Invalid(field, ".", name, " = ", value, " must be >= 0 (", note, ")");
    out = absl::Microseconds(value);
    return absl::OkStatus();
  };
  if (policy.has_max_queue_delay_us()) {
    RETURN_IF_ERROR(microseconds("max_queue_delay_us", policy.max_queue_delay_us(),
                                 "microseconds", overrides.max_queue_delay));
  }
  if (policy.has_queue_timeout_us()) {
    RETURN_IF_ERROR(microseconds("queue_timeout_us", policy.queue_timeout_us(),
                                 "microseconds; 0 = no limit", overrides.queue_timeout));
  }
  if (policy.has_max_queue_requests()) overrides.max_queue_requests = policy.max_queue_requests();
  if (policy.has_max_queue_tokens()) overrides.max_queue_tokens = policy.max_queue_tokens();
  // The defaults are valid, so whatever fails is a field the caller set (named as on the
  // wire).
  RETURN_IF_ERROR(overrides.ApplyTo(BatchLimits{}).Validate(absl::StrCat(field, ".")));
  return overrides;
}

v1::BatchingPolicy BatchingPolicyToProto(const BatchLimitOverrides& overrides) {
  v1::BatchingPolicy policy;
  if (overrides.max_batch_requests) policy.set_max_batch_requests(*overrides.max_batch_requests);
  if (overrides.max_batch_tokens) policy.set_max_batch_tokens(*overrides.max_batch_tokens);
  if (overrides.max_queue_delay) {
    policy.set_max_queue_delay_us(absl::ToInt64Microseconds(*overrides.max_queue_delay));
  }
  if (overrides.max_queue_requests) policy.set_max_queue_requests(*overrides.max_queue_requests);
  if (overrides.max_queue_tokens) policy.set_max_queue_tokens(*overrides.max_queue_tokens);
  if (overrides.queue_timeout) {
    policy.set_queue_timeout_us(absl::ToInt64Microseconds(*overrides.queue_timeout));
  }
  return policy;
}

v1::BatchingPolicy BatchingPolicyToProto(const BatchLimits& limits) {
  return BatchingPolicyToProto(BatchLimitOverrides{
      limits.max_batch_requests, limits.max_batch_tokens, limits.max_queue_delay,
      limits.max_queue_requests, limits.max_queue_tokens, limits.queue_timeout});
}

absl::StatusOr<core::MhaConfig> ConvertConfig(const v1::LayerConfig& in,
                                              absl::string_view field) {
  core::MhaConfig out;
  out.embed_dim = in.embed_dim();
  out.num_heads = in.num_heads();
  out.num_kv_heads = in.num_kv_heads();
  out.head_dim = in.head_dim();
  out.v_head_dim = in.v_head_dim();
  out.kdim = in.kdim();
  out.vdim = in.vdim();
  out.output_dim = in.output_dim();
  out.qkv_bias = !in.no_qkv_bias();
  out.output_bias = !in.no_output_bias();
  out.output_projection = !in.skip_output_projection();
  out.rope_theta = in.rope_theta();
  out.always_causal = in.always_causal();
  out.sliding_window = in.sliding_window();
  if (in.compute_dtype() != v1::DATA_TYPE_UNSPECIFIED) {  // Resolve refuses all but two
    ASSIGN_OR_RETURN(out.compute_dtype,
                     wire::ConvertDType(in.compute_dtype(), absl::StrCat(field, ".compute_dtype")));
  }
  if (in.has_rope_scaling()) {
    const v1::RopeScaling& scaling = in.rope_scaling();
    static const std::map<std::string, int, std::less<>> kTypes = {
        {"linear", core::RopeScaling::kLinear},
        {"dynamic", core::RopeScaling::kDynamic},
        {"llama3", core::RopeScaling::kLlama3}};
    const auto type = kTypes.find(scaling.rope_type());
    if (type == kTypes.end()) {
      return Invalid(field, ".rope_scaling.rope_type = ", Quoted(scaling.rope_type()),
                     " is not implemented (linear, dynamic, llama3); refused rather than "
                     "approximated");
    }
    out.rope_scaling.type = type->second;
    out.rope_scaling.factor = scaling.factor();
    out.rope_scaling.low_freq_factor = scaling.low_freq_factor();
    out.rope_scaling.high_freq_factor = scaling.high_freq_factor();
    out.rope_scaling.original_max_positions = scaling.original_max_position_embeddings();
  }
  return out;
}

v1::LayerConfig ConfigToProto(const core::MhaConfig& in) {
  v1::LayerConfig out;
  out.set_embed_dim(in.embed_dim);
  out.set_num_heads(in.num_heads);
  out.set_num_kv_heads(in.num_kv_heads);
  out.set_head_dim(in.head_dim);
  out.set_v_head_dim(in.v_head_dim);
  out.set_kdim(in.kdim);
  out.set_vdim(in.vdim);
  out.set_output_dim(in.output_dim);
  out.set_no_qkv_bias(!in.qkv_bias);
  out.set_no_output_bias(!in.output_bias);
  out.set_skip_output_projection(!in.output_projection);
  out.set_rope_theta(in.rope_theta);
  out.set_always_causal(in.always_causal);
  out.set_sliding_window(in.sliding_window);
  out.set_compute_dtype(wire::WireDType(in.compute_dtype));
  if (in.rope_scaling.type != core::RopeScaling::kNone) {
    v1::RopeScaling* scaling = out.mutable_rope_scaling();
    const core::RopeScaling& s = in.rope_scaling;
    scaling->set_rope_type(s.type == core::RopeScaling::kLinear    ? "linear"
                           : s.type == core::RopeScaling::kDynamic ? "dynamic"
                                                                   : "llama3");
    scaling->set_factor(s.factor);
    if (s.type == core::RopeScaling::kLlama3) {
      scaling->set_low_freq_factor(s.low_freq_factor);
      scaling->set_high_freq_factor(s.high_freq_factor);
    }
    if (s.type != core::RopeScaling::kLinear) {
      scaling->set_original_max_position_embeddings(s.original_max_positions);
    }
  }
  return out;
}

absl::Status ValidateLayerName(absl::string_view name, absl::string_view field) {
  if (name.empty() || name.size() > 128) {
    return Invalid(field, " has ", name.size(), " characters; expected 1 to 128");
  }
  for (char ch : name) {
    const bool allowed = std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' ||
                         ch == '-';
    if (!allowed) {
      return Invalid(field, " ", Quoted(name), " has a character outside [A-Za-z0-9._-]");
    }
  }
  return absl::OkStatus();
}

}  // namespace attention::server

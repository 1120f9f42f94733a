#include "server/wire_convert.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <map>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "server/status_util.h"

namespace attention::server {
namespace {

using core::DType;
using wire::CheckByteCount;
using wire::CheckShape;
using wire::ConvertDType;
using wire::HasContent;
using wire::ShapeString;

// A mask tensor: boolean keep flags (polarity resolved) or additive float bias.
struct DecodedMask {
  std::vector<int64_t> shape;
  std::vector<uint8_t> keep;
  std::vector<float> bias;
};

absl::StatusOr<DecodedMask> DecodeMask(const v1::Tensor& tensor, v1::BoolMaskPolarity polarity,
                                       absl::string_view field) {
  DecodedMask mask;
  if (tensor.dtype() == v1::BOOL) {
    ASSIGN_OR_RETURN(const int64_t count, CheckShape(tensor, field));
    RETURN_IF_ERROR(CheckByteCount(tensor, DType::kBool, count, field));
    const bool true_attends = polarity == v1::TRUE_ATTENDS;
    mask.keep.resize(count);
    for (int64_t e = 0; e < count; ++e) {
      mask.keep[e] = (tensor.raw_data()[e] != 0) == true_attends;
    }
    mask.shape.assign(tensor.shape().begin(), tensor.shape().end());
    return mask;
  }
  ASSIGN_OR_RETURN(FloatTensor decoded, DecodeFloatTensor(tensor, field));
  mask.shape = std::move(decoded.shape);
  mask.bias = std::move(decoded.values);
  return mask;
}

}  // namespace

absl::StatusOr<core::DType> OutputDType(v1::DataType requested, v1::DataType query_dtype,
                                        bool float_data_output) {
  if (float_data_output) {
    if (requested == v1::DATA_TYPE_UNSPECIFIED || requested == v1::FLOAT32) return DType::kFloat32;
    return Invalid("output_dtype = ", v1::DataType_Name(requested),
                   " cannot travel in float_data (float_data_output is set); leave it "
                   "unspecified or give FLOAT32");
  }
  if (requested == v1::DATA_TYPE_UNSPECIFIED) {
    return query_dtype == v1::DATA_TYPE_UNSPECIFIED ? DType::kFloat32
                                                    : ConvertDType(query_dtype, "query.dtype");
  }
  ASSIGN_OR_RETURN(const DType dtype, ConvertDType(requested, "output_dtype"));
  if (dtype == DType::kBool) return Invalid("output_dtype is BOOL; expected a float type");
  return dtype;
}

void RawToFloatData(v1::Tensor* tensor) {
  const std::string& bytes = tensor->raw_data();
  auto* values = tensor->mutable_float_data();
  values->Resize(static_cast<int>(bytes.size() / sizeof(float)), 0.0f);
  std::memcpy(values->mutable_data(), bytes.data(), bytes.size());
  tensor->clear_raw_data();
}

absl::StatusOr<absl::Time> QueueDeadline(const v1::AttentionOptions& options,
                                         absl::Time call_deadline, absl::Time now) {
  const int64_t timeout_us = options.queue_timeout_us();
  if (timeout_us < 0) {
    return Invalid("options.queue_timeout_us = ", timeout_us,
                   " must be >= 0 (microseconds; 0 = no limit)");
  }
  if (timeout_us == 0) return call_deadline;
  return std::min(call_deadline, now + absl::Microseconds(timeout_us));
}

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

absl::StatusOr<core::AttentionOptions> ConvertOptions(const v1::AttentionOptions& in,
                                                      const core::AttentionDims& dims) {
  core::AttentionOptions out;
  out.causal = in.causal();
  out.key_lengths.assign(in.key_lengths().begin(), in.key_lengths().end());
  if (HasContent(in.key_padding_mask())) {
    if (in.key_padding_mask().dtype() != v1::BOOL) {
      return Invalid("options.key_padding_mask.dtype is ",
                     v1::DataType_Name(in.key_padding_mask().dtype()),
                     "; expected BOOL (use attn_mask for additive float masks)");
    }
    ASSIGN_OR_RETURN(DecodedMask mask, DecodeMask(in.key_padding_mask(), in.key_padding_polarity(),
                                                  "options.key_padding_mask"));
    if (mask.shape != std::vector<int64_t>{dims.batch, dims.kv_len}) {
      return Invalid("options.key_padding_mask.shape ", ShapeString(mask.shape),
                     " must be [B, Nk] = [", dims.batch, ", ", dims.kv_len, "]");
    }
    out.key_padding_keep = std::move(mask.keep);
  }
  if (HasContent(in.attn_mask())) {
    ASSIGN_OR_RETURN(DecodedMask mask,
                     DecodeMask(in.attn_mask(), in.attn_mask_polarity(), "options.attn_mask"));
    if (mask.shape.size() > 4) {
      return Invalid("options.attn_mask has rank ", mask.shape.size(),
                     "; expected at most 4, broadcastable to [B, H, Nq, Nk]");
    }
    const size_t pad = 4 - mask.shape.size();
    for (size_t d = 0; d < mask.shape.size(); ++d) out.attn_mask_dims[pad + d] = mask.shape[d];
    out.attn_mask_keep = std::move(mask.keep);
    out.attn_mask_bias = std::move(mask.bias);
  }
  if (in.has_scale()) out.scale = in.scale();
  out.dropout_p = in.dropout_p();
  out.dropout_seed = in.dropout_seed();
  switch (in.need_weights()) {
    case v1::NEED_WEIGHTS_NONE:
      out.need_weights = core::NeedWeights::kNone;
      break;
    case v1::NEED_WEIGHTS_AVERAGED:
      out.need_weights = core::NeedWeights::kAveraged;
      break;
    case v1::NEED_WEIGHTS_PER_HEAD:
      out.need_weights = core::NeedWeights::kPerHead;
      break;
    default:
      return Invalid("options.need_weights = ", static_cast<int>(in.need_weights()),
                     " is not a known NeedWeights value");
  }
  for (auto [name, value] : {std::pair<const char*, int>{"key_padding_polarity",
                                                         in.key_padding_polarity()},
                             {"attn_mask_polarity", in.attn_mask_polarity()}}) {
    if (!v1::BoolMaskPolarity_IsValid(value)) {
      return Invalid("options.", name, " = ", value, " is not a known BoolMaskPolarity");
    }
  }
  RETURN_IF_ERROR(out.Validate(dims));
  return out;
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

#include "server/validation/wire_convert.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <map>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"

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

absl::Status CheckQueueTimeout(int64_t timeout_us, absl::string_view field,
                               absl::string_view unit) {
  if (timeout_us >= 0) return absl::OkStatus();
  return Invalid(field, " = ", timeout_us, unit, " must be >= 0 (microseconds; 0 = no limit)");
}

absl::StatusOr<absl::Time> QueueDeadline(const v1::AttentionOptions& options,
                                         absl::Time call_deadline, absl::Time now) {
  const int64_t timeout_us = options.queue_timeout_us();
  RETURN_IF_ERROR(CheckQueueTimeout(timeout_us, "options.queue_timeout_us"));
  if (timeout_us == 0) return call_deadline;
  return std::min(call_deadline, now + absl::Microseconds(timeout_us));
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

}  // namespace attention::server

// Conversion between wire messages (attention.v1) and core types, with the validation
// that gives every bad field a specific INVALID_ARGUMENT message.
#ifndef ATTENTION_SERVER_WIRE_CONVERT_H_
#define ATTENTION_SERVER_WIRE_CONVERT_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "tensor_codec.h"
#include "core/attention_options.h"
#include "core/dtype.h"
#include "core/mha_layer.h"
#include "server/batch_limits.h"

namespace attention::server {

using wire::DecodeFloatTensor;
using wire::EncodeTensor;
using wire::FloatTensor;

// The dtype of the reply: output_dtype when set, else the dtype of the query; FLOAT32 for
// a float_data_output reply, which refuses any other output_dtype.
absl::StatusOr<core::DType> OutputDType(v1::DataType requested, v1::DataType query_dtype,
                                        bool float_data_output = false);

// Moves a FLOAT32 tensor's raw_data into float_data (float_data_output replies).
void RawToFloatData(v1::Tensor* tensor);

// Converts options for an attention of `dims`, checking mask shapes and values.
absl::StatusOr<core::AttentionOptions> ConvertOptions(const v1::AttentionOptions& options,
                                                      const core::AttentionDims& dims);

// When a request received at `now` stops being worth computing: the call's deadline, or
// sooner options.queue_timeout_us after `now`. INVALID_ARGUMENT for a negative timeout.
absl::StatusOr<absl::Time> QueueDeadline(const v1::AttentionOptions& options,
                                         absl::Time call_deadline, absl::Time now);

// INVALID_ARGUMENT "<field>.rope_scaling.rope_type = ..." for a rope type not implemented.
absl::StatusOr<core::MhaConfig> ConvertConfig(const v1::LayerConfig& config,
                                              absl::string_view field = "config");
v1::LayerConfig ConfigToProto(const core::MhaConfig& config);

// A layer's batching overrides from the wire; `field` prefixes the field in errors
// ("batching." -> "batching.max_batch_requests = 0 must be >= 1").
absl::StatusOr<BatchLimitOverrides> ConvertBatchingPolicy(const v1::BatchingPolicy& policy,
                                                          absl::string_view field);
// Only the fields the layer sets.
v1::BatchingPolicy BatchingPolicyToProto(const BatchLimitOverrides& overrides);
// Every field.
v1::BatchingPolicy BatchingPolicyToProto(const BatchLimits& limits);

// Layer names: 1-128 characters from [A-Za-z0-9._-].
absl::Status ValidateLayerName(absl::string_view name, absl::string_view field);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_WIRE_CONVERT_H_

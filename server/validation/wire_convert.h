// Conversion of a request's wire fields (attention.v1) into core types, with the validation
// that gives every bad field a specific INVALID_ARGUMENT message. A layer's own fields
// (config, batching policy, name) are server/models/layer_config.h.
#ifndef ATTENTION_SERVER_VALIDATION_WIRE_CONVERT_H_
#define ATTENTION_SERVER_VALIDATION_WIRE_CONVERT_H_

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

// The queue timeout rule of both APIs (options.queue_timeout_us, KServe's
// parameters["timeout"]): microseconds, 0 for no limit; INVALID_ARGUMENT naming `field`
// when negative. `unit` follows the value in the message where the field's name does not
// say microseconds (" µs" for KServe's "timeout").
absl::Status CheckQueueTimeout(int64_t timeout_us, absl::string_view field,
                               absl::string_view unit = "");

// When a request received at `now` stops being worth computing: the call's deadline, or
// sooner options.queue_timeout_us after `now`. INVALID_ARGUMENT for a negative timeout
// (CheckQueueTimeout).
absl::StatusOr<absl::Time> QueueDeadline(const v1::AttentionOptions& options,
                                         absl::Time call_deadline, absl::Time now);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_VALIDATION_WIRE_CONVERT_H_

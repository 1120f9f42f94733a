// A layer's description between the wire (attention.v1) and the models: its config, its
// batching policy and its name, with the validation that names every bad field.
#ifndef ATTENTION_SERVER_MODELS_LAYER_CONFIG_H_
#define ATTENTION_SERVER_MODELS_LAYER_CONFIG_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "core/mha_types.h"
#include "server/models/batch_limits.h"

namespace attention::server {

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

#endif  // ATTENTION_SERVER_MODELS_LAYER_CONFIG_H_

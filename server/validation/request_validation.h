// What one request will cost, computed from its shapes before anything is allocated or
// queued, and the per-request budgets it is checked against. Every size derived from
// caller numbers goes through saturating, overflow-checked arithmetic: a product past
// int64 saturates to kSaturated, which no budget admits.
#ifndef ATTENTION_SERVER_VALIDATION_REQUEST_VALIDATION_H_
#define ATTENTION_SERVER_VALIDATION_REQUEST_VALIDATION_H_

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensor_codec.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/message.h"
#include "core/attention_options.h"
#include "core/dtype.h"
#include "core/mha_layer.h"

namespace attention::server {

inline constexpr int64_t kSaturated = std::numeric_limits<int64_t>::max();

// Product and sum of non-negative numbers; kSaturated when the exact result exceeds int64.
int64_t CheckedProduct(std::initializer_list<int64_t> factors);
int64_t CheckedSum(std::initializer_list<int64_t> terms);

// Limits on one request, whatever the queue holds.
struct RequestBudget {
  // Largest answer (output plus attention weights, at the reply's dtype), bytes: the gRPC
  // message limit. >= 1.
  int64_t max_response_bytes = wire::kDefaultMaxMessageBytes;
  // Most floating-point operations one request may ask for (projections plus attention,
  // causal not discounted, softmax counted as 8 per score). >= 1; default 1e13, about 100 s of this project's
  // 2-core CPU and a 1 GiB answer's worth of BERT-base work.
  int64_t max_request_flops = 10'000'000'000'000;
  // Most bytes of buffers one request's forward pass may hold at once (projections,
  // attention output, weights asked for, the encoded answer). >= 1; default 4 GiB.
  int64_t max_request_memory_bytes = int64_t{4} << 30;
  // Refuse inputs holding NaN or infinities (additive masks may hold -inf: it masks) with
  // INVALID_ARGUMENT naming the tensor and the index, so that every backend answers alike.
  // Off, non-finite values go through the arithmetic unchecked (results then depend on the
  // backend's kernels). Default on.
  bool reject_non_finite = true;

  // INVALID_ARGUMENT naming the first field out of range.
  absl::Status Validate() const;
};

// The cost of one request; each field kSaturated when it overflowed.
struct RequestCost {
  int64_t output_elements = 0;
  int64_t weight_elements = 0;  // attention weights returned (after averaging)
  int64_t response_bytes = 0;
  int64_t flops = 0;
  int64_t memory_bytes = 0;
};

// A multi-head-attention request of `dims` through a layer of `config`.
RequestCost MultiHeadAttentionCost(const core::MhaConfig& config, const core::AttentionDims& dims,
                                   core::NeedWeights need, core::DType output_dtype);
// A scaled dot-product attention request of `dims`.
RequestCost ScaledDotProductAttentionCost(const core::AttentionDims& dims, core::NeedWeights need,
                                          core::DType output_dtype);

// One entry of a session step: `dims` has batch 1, the entry's n new tokens as q_len and
// the keys they attend to (position + n) as kv_len, causal not discounted, as in
// ScaledDotProductAttentionCost. `layer` projects the tokens (null for a session whose
// caller sends query, key and value). Outputs leave in `output_dtype`, log-sum-exp (when
// asked for) in float32.
RequestCost SessionStepEntryCost(const core::AttentionDims& dims, const core::MhaConfig* layer,
                                 bool log_sum_exp, core::DType output_dtype);

// Both costs together (saturating).
RequestCost operator+(const RequestCost& a, const RequestCost& b);

// RESOURCE_EXHAUSTED naming the budget that `cost` passes, with both numbers and the flag
// that raises it.
absl::Status CheckRequestBudget(const RequestCost& cost, const RequestBudget& budget);

// An inline layer's weights are memory of the request that carries it: RESOURCE_EXHAUSTED
// when `weight_bytes` passes max_request_memory_bytes.
absl::Status CheckInlineLayerBytes(int64_t weight_bytes, const RequestBudget& budget);

// INVALID_ARGUMENT naming `field` and the index (in `shape`) of its first NaN or infinity;
// -inf passes when `allow_negative_infinity` (additive masks).
absl::Status CheckFinite(absl::Span<const float> values, absl::Span<const int64_t> shape,
                         absl::string_view field, bool allow_negative_infinity = false);
// That INVALID_ARGUMENT for non-finite `value` at flat index `flat` of a tensor of `shape`.
absl::Status NonFiniteAt(absl::string_view field, absl::Span<const int64_t> shape, int64_t flat,
                         float value);

// UNIMPLEMENTED naming the field numbers `request` (or any message inside it, map values
// included, as parameters["timeout"]) carries that this server does not know, e.g. a mask
// added by a newer client, and the message they sit in: nothing a caller sends is silently
// ignored. (Fields beside key and value in a map entry itself never get here: protobuf's
// parser drops them.)
absl::Status CheckKnownFields(const google::protobuf::Message& request);

// INVALID_ARGUMENT when a request_id is longer than 256 bytes.
absl::Status CheckRequestId(const std::string& request_id);

// Whether `given` equals `expected`, in time that depends only on expected's length (for
// secrets such as the admin token).
bool ConstantTimeEquals(absl::string_view given, absl::string_view expected);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_VALIDATION_REQUEST_VALIDATION_H_

// libFuzzer target: a LoadLayerRequest.batching policy from arbitrary protobuf bytes through
// the conversion and validation the server applies. Seeds: tests/fuzz/corpus/batching/.
#include <cstddef>
#include <cstdint>

#include "server/models/layer_config.h"
#include "server/validation/wire_convert.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attention::v1::BatchingPolicy policy;
  if (!policy.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto overrides = attention::server::ConvertBatchingPolicy(policy, "batching");
  if (!overrides.ok()) return 0;
  const attention::server::BatchLimits limits =
      overrides->ApplyTo(attention::server::BatchLimits{});
  // Whatever conversion accepts must be a valid policy, and survive the round trip.
  if (!limits.Validate().ok()) __builtin_trap();
  auto again = attention::server::ConvertBatchingPolicy(
      attention::server::BatchingPolicyToProto(*overrides), "batching");
  if (!again.ok()) __builtin_trap();
  return 0;
}

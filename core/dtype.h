// Element types on the wire and their conversion to and from the float32 compute type.
#ifndef ATTENTION_CORE_DTYPE_H_
#define ATTENTION_CORE_DTYPE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace attention::core {

enum class DType { kFloat32, kFloat16, kBFloat16, kBool };

// Bytes per element.
int64_t ElementSize(DType dtype);
absl::string_view DTypeName(DType dtype);

float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);  // round to nearest even; overflow gives inf
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);  // round to nearest even; NaN stays NaN

// Decodes little-endian `bytes` of `dtype` (a float type) into float32 values.
// `field` names the source in error messages.
absl::StatusOr<std::vector<float>> DecodeFloats(absl::string_view bytes, DType dtype,
                                                absl::string_view field);
// Encodes float32 values as little-endian bytes of `dtype` (a float type).
std::string EncodeFloats(absl::Span<const float> values, DType dtype);

}  // namespace attention::core

#endif  // ATTENTION_CORE_DTYPE_H_

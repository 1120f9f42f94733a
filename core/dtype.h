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

// The one dtype table: every dtype once, with its size and its names in each format that
// carries it. Everything that sizes or names a dtype reads it; the wire (attention.v1
// DataType, whose value names are `name`), KServe and safetensors map their names from it.
struct DTypeInfo {
  DType dtype;
  int64_t size;                  // bytes per element
  const char* name;              // attention.v1.DataType: "FLOAT32"
  const char* kserve_name;       // KServe v2 protocol datatype: "FP32"
  const char* safetensors_name;  // safetensors header dtype: "F32"
};
// In DType's order (dtype.cc asserts it).
inline constexpr DTypeInfo kDTypes[] = {
    {DType::kFloat32, 4, "FLOAT32", "FP32", "F32"},
    {DType::kFloat16, 2, "FLOAT16", "FP16", "F16"},
    {DType::kBFloat16, 2, "BFLOAT16", "BF16", "BF16"},
    {DType::kBool, 1, "BOOL", "BOOL", "BOOL"},
};

const DTypeInfo& Info(DType dtype);
// The dtype whose `column` (e.g. &DTypeInfo::kserve_name) is `name`; null when none is.
const DTypeInfo* FindDType(absl::string_view name, const char* DTypeInfo::*column);

// Bytes per element.
int64_t ElementSize(DType dtype);
// Its attention.v1.DataType name, e.g. "FLOAT32".
absl::string_view DTypeName(DType dtype);

float HalfToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);  // round to nearest even; overflow gives inf
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);  // round to nearest even; NaN stays NaN
// FloatToBFloat16 of `count` values, 16 at a time with AVX512-BF16 where the CPU has it
// (which reads float32 subnormals as zero).
void FloatsToBFloat16(const float* values, int64_t count, uint16_t* out);

// Decodes little-endian `bytes` of `dtype` (a float type) into float32 values.
// `field` names the source in error messages.
absl::StatusOr<std::vector<float>> DecodeFloats(absl::string_view bytes, DType dtype,
                                                absl::string_view field);
// Encodes float32 values as little-endian bytes of `dtype` (a float type).
std::string EncodeFloats(absl::Span<const float> values, DType dtype);

}  // namespace attention::core

#endif  // ATTENTION_CORE_DTYPE_H_

#include "core/dtype.h"

#include <cstring>
#include <iterator>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/half_bits.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace attention::core {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "wire tensors are little-endian; a big-endian port must byte-swap");

constexpr bool InDTypeOrder() {
  for (size_t i = 0; i < std::size(kDTypes); ++i) {
    if (static_cast<size_t>(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(InDTypeOrder(), "kDTypes is indexed by DType");

const DTypeInfo& Info(DType dtype) { return kDTypes[static_cast<size_t>(dtype)]; }

const DTypeInfo* FindDType(absl::string_view name, const char* DTypeInfo::*column) {
  for (const DTypeInfo& info : kDTypes) {
    if (name == info.*column) return &info;
  }
  return nullptr;
}

int64_t ElementSize(DType dtype) { return Info(dtype).size; }

absl::string_view DTypeName(DType dtype) { return Info(dtype).name; }

float HalfToFloat(uint16_t bits) { return HalfBitsToFloat(bits); }

uint16_t FloatToHalf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t abs_bits = bits & 0x7fffffff;
  if (abs_bits > 0x7f800000) return sign | 0x7e00;   // NaN
  if (abs_bits >= 0x477ff000) return sign | 0x7c00;  // rounds to >= 65520: inf
  if (abs_bits < 0x38800000) {                       // below the smallest normal half
    if (abs_bits < 0x33000000) return sign;          // rounds to zero
    const uint32_t exponent = abs_bits >> 23;
    const uint32_t mantissa = (abs_bits & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - exponent;  // 14..24
    uint32_t half = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (half & 1))) ++half;
    return sign | static_cast<uint16_t>(half);
  }
  uint32_t half = ((abs_bits >> 13) - (112u << 10));
  const uint32_t remainder = abs_bits & 0x1fff;
  if (remainder > 0x1000 || (remainder == 0x1000 && (half & 1))) ++half;
  return sign | static_cast<uint16_t>(half);
}

float BFloat16ToFloat(uint16_t bits) { return BFloat16BitsToFloat(bits); }

uint16_t FloatToBFloat16(float value) { return FloatToBFloat16Bits(value); }

absl::StatusOr<std::vector<float>> DecodeFloats(absl::string_view bytes, DType dtype,
                                                absl::string_view field) {
  if (dtype == DType::kBool) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype is BOOL; expected FLOAT32, FLOAT16 or BFLOAT16"));
  }
  const int64_t size = ElementSize(dtype);
  if (static_cast<int64_t>(bytes.size()) % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".raw_data has ", bytes.size(),
                                                   " bytes, not a multiple of ", size));
  }
  std::vector<float> values(bytes.size() / size);
  if (dtype == DType::kFloat32) {
    std::memcpy(values.data(), bytes.data(), bytes.size());
    return values;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t bits;
    std::memcpy(&bits, bytes.data() + 2 * i, 2);
    values[i] = dtype == DType::kFloat16 ? HalfToFloat(bits) : BFloat16ToFloat(bits);
  }
  return values;
}

namespace {

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bf16"))) void FloatsToBFloat16Avx512(const float* values,
                                                                          int64_t count,
                                                                          uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(values + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)rounded);
  }
  for (; i < count; ++i) out[i] = FloatToBFloat16(values[i]);
}
#endif

}  // namespace

void FloatsToBFloat16(const float* values, int64_t count, uint16_t* out) {
#if defined(__x86_64__)
  static const bool has_avx512_bf16 =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  if (has_avx512_bf16) {
    FloatsToBFloat16Avx512(values, count, out);
    return;
  }
#endif
  // The inline bit operations, which vectorize (not a call per element): hosts without
  // AVX512-BF16 round every bf16 answer here.
  for (int64_t i = 0; i < count; ++i) out[i] = FloatToBFloat16Bits(values[i]);
}

std::string EncodeFloats(absl::Span<const float> values, DType dtype) {
  std::string bytes(values.size() * ElementSize(dtype), '\0');
  if (dtype == DType::kFloat32) {
    std::memcpy(bytes.data(), values.data(), bytes.size());
    return bytes;
  }
  if (dtype == DType::kBFloat16) {
    // Raw bytes are little-endian (asserted above) and heap-aligned for uint16_t.
    FloatsToBFloat16(values.data(), static_cast<int64_t>(values.size()),
                     reinterpret_cast<uint16_t*>(bytes.data()));
    return bytes;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t bits = FloatToHalf(values[i]);
    std::memcpy(bytes.data() + 2 * i, &bits, 2);
  }
  return bytes;
}

}  // namespace attention::core

// 16-bit float bits to float32, for the host and CUDA devices alike (core/dtype.cc decodes
// the wire with these; the CUDA backend converts 16-bit inputs on the device with them).
#ifndef ATTENTION_CORE_HALF_BITS_H_
#define ATTENTION_CORE_HALF_BITS_H_

#include <cstdint>
#include <cstring>

#include "core/host_device.h"

namespace attention::core {

ATTENTION_HOST_DEVICE inline float FloatFromBits(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof(value));
  return value;
}

// IEEE binary16: exact (every half is a float).
ATTENTION_HOST_DEVICE inline float HalfBitsToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  uint32_t exponent = (bits >> 10) & 0x1f;
  uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0x1f) return FloatFromBits(sign | 0x7f800000 | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return FloatFromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return FloatFromBits(sign);  // signed zero
  exponent = 113;  // subnormal: normalise
  while ((mantissa & 0x400) == 0) {
    mantissa <<= 1;
    --exponent;
  }
  return FloatFromBits(sign | (exponent << 23) | ((mantissa & 0x3ff) << 13));
}

// bfloat16: the top half of a float32.
ATTENTION_HOST_DEVICE inline float BFloat16BitsToFloat(uint16_t bits) {
  return FloatFromBits(static_cast<uint32_t>(bits) << 16);
}

// float32 to bfloat16 bits, to nearest even; NaN stays NaN (quiet).
ATTENTION_HOST_DEVICE inline uint16_t FloatToBFloat16Bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// True for NaN or an infinity, from the 16-bit pattern (exponent bits all ones).
ATTENTION_HOST_DEVICE inline bool HalfBitsNonFinite(uint16_t bits, bool bfloat16) {
  const uint16_t exponent = bfloat16 ? 0x7f80 : 0x7c00;
  return (bits & exponent) == exponent;
}

// Whether any of `bits` is NaN or infinite: an OR over all of them, which vectorizes (a
// loop that stops at the first one does not); only a tensor that fails is searched again.
inline bool AnyHalfBitsNonFinite(const uint16_t* bits, size_t count, bool bfloat16) {
  uint32_t any = 0;
  for (size_t i = 0; i < count; ++i)
    any |= static_cast<uint32_t>(HalfBitsNonFinite(bits[i], bfloat16));
  return any != 0;
}

}  // namespace attention::core

#endif  // ATTENTION_CORE_HALF_BITS_H_

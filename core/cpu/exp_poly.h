// The CPU kernels' exp for softmax: exp(x) for x <= 0, within 2 ulp of std::exp; below -87,
// and -inf, it gives exactly 0. 2^n * P(f) with n = round(x / ln2), f = x - n ln2 in two
// FMAs (Cody-Waite: ln2 as a float alone put n's rounding, up to 2.6e-7, into f) and a
// degree-6 polynomial. attention_cpu.cc's AVX2 and AVX-512 versions share these constants;
// ExpOfNonPositive is the same in plain C++ that compilers vectorize.
#ifndef ATTENTION_CORE_CPU_EXP_POLY_H_
#define ATTENTION_CORE_CPU_EXP_POLY_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace attention::core {

inline constexpr float kExpLowest = -87.0f;
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2High = 0.693147182464599609375f;  // float(ln 2)
inline constexpr float kLn2Low = -1.904654299957768e-09f;    // ln 2 - kLn2High
// A degree-6 polynomial fitted to exp's relative error on [-ln2/2, ln2/2] (iteratively
// reweighted least squares): 1.2 ulp when evaluated in float, where Taylor's degree 6 erred
// 3.5 ulp and its degree 7 cost one more FMA for 1.1.
inline constexpr float kExpCoefficients[] = {1.383680850e-03f,
                                             8.374815807e-03f,
                                             4.166822508e-02f,
                                             1.666641980e-01f,
                                             4.999999106e-01f,
                                             1.0f,
                                             1.0f};
inline constexpr int kExpTerms = sizeof(kExpCoefficients) / sizeof(kExpCoefficients[0]);
static_assert(kExpTerms == 7, "ExpOfNonPositive spells out 7 terms");

// exp(x) for kExpLowest <= x <= 0, or NaN (which stays NaN, so a read of poisoned memory
// shows in the result). Branch-free so that a loop of it vectorizes; clamp in a loop of its
// own first: a clamp here let GCC fold the clamped case to a constant and branch around the
// FMAs, which no compiler vectorizes.
__attribute__((always_inline)) inline float ExpOfClamped(float x) {
  // Round to nearest by the 1.5 * 2^23 trick: a plain add, unlike std::nearbyint.
  constexpr float kRoundShift = 12582912.0f;
  const float shifted = x * kLog2e + kRoundShift;  // n sits in the low mantissa bits
  const float n = shifted - kRoundShift;
  const float f = std::fma(n, -kLn2Low, std::fma(n, -kLn2High, x));
  // Horner spelled out: a loop here kept GCC from vectorizing the caller's loop.
  const float* k = kExpCoefficients;
  const float p = std::fma(
      std::fma(std::fma(std::fma(std::fma(std::fma(k[0], f, k[1]), f, k[2]), f, k[3]), f, k[4]), f,
               k[5]),
      f, k[6]);
  // 2^n built from `shifted`'s bits in unsigned arithmetic, so that a NaN (whose bits are
  // no number) stays defined behaviour and still yields NaN through p.
  uint32_t shifted_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  const uint32_t exponent_bits = (shifted_bits - 0x4B400000u + 127u) << 23;
  float power;
  std::memcpy(&power, &exponent_bits, sizeof(power));
  return p * power;
}

// exp(x) for x <= 0; below kExpLowest, and for -inf, exp(kExpLowest) = 1.6e-38, which a
// softmax sum of at least 1 cannot tell from 0.
__attribute__((always_inline)) inline float ExpOfNonPositive(float x) {
  return ExpOfClamped(std::max(x, kExpLowest));  // std::max keeps a NaN x
}

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_EXP_POLY_H_

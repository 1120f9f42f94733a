// An in-register 16 x 16 transpose of 32-bit elements, for the CPU backend's packing of
// float32 panels (core/cpu/gemm.cc) and bf16 pair panels (core/cpu/gemm_bf16.cc).
#ifndef ATTENTION_CORE_CPU_TRANSPOSE_AVX512_H_
#define ATTENTION_CORE_CPU_TRANSPOSE_AVX512_H_

#if defined(__x86_64__)
#include <immintrin.h>

namespace attention::core {

// Transposes 16 rows of 16 floats in registers: row[j][k] becomes row[k][j]. Four rounds of
// 16 shuffles: pairs of rows, then quads within each 128-bit lane, then 128-bit lanes.
// (GCC 12 takes the shuffles' undefined pass-through operand for an uninitialised read.)
#pragma GCC diagnostic push
#if !defined(__clang__)  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx512f"))) inline void Transpose16x16(__m512 row[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(row[i], row[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(row[i], row[i + 1]);
  }
  // u[4g + m], lane L: element 4L + m of rows 4g..4g+3.
  __m512 u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_shuffle_ps(t[g], t[g + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 even_lanes_low = _mm512_shuffle_f32x4(u[m], u[4 + m], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 odd_lanes_low = _mm512_shuffle_f32x4(u[m], u[4 + m], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 even_lanes_high =
        _mm512_shuffle_f32x4(u[8 + m], u[12 + m], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 odd_lanes_high =
        _mm512_shuffle_f32x4(u[8 + m], u[12 + m], _MM_SHUFFLE(3, 1, 3, 1));
    row[m] = _mm512_shuffle_f32x4(even_lanes_low, even_lanes_high, _MM_SHUFFLE(2, 0, 2, 0));
    row[4 + m] = _mm512_shuffle_f32x4(odd_lanes_low, odd_lanes_high, _MM_SHUFFLE(2, 0, 2, 0));
    row[8 + m] = _mm512_shuffle_f32x4(even_lanes_low, even_lanes_high, _MM_SHUFFLE(3, 1, 3, 1));
    row[12 + m] = _mm512_shuffle_f32x4(odd_lanes_low, odd_lanes_high, _MM_SHUFFLE(3, 1, 3, 1));
  }
}
#pragma GCC diagnostic pop

}  // namespace attention::core

#endif  // defined(__x86_64__)
#endif  // ATTENTION_CORE_CPU_TRANSPOSE_AVX512_H_

#include "core/cpu/attention_cpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <cblas.h>

#include "absl/strings/str_cat.h"
#include "core/cpu/amx_tiles.h"
#include "core/cpu/exp_poly.h"
#include "core/cpu/gemm.h"
#include "core/cpu/gemm_bf16.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace attention::core {
namespace {

// Softmax row helpers. The AVX2+FMA versions are chosen at run time when the CPU has them;
// the portable versions are the fallback (and what non-x86 builds compile).
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) float HorizontalSum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

// exp(x - shift) in place for x - shift <= 0 with core/cpu/exp_poly.h's polynomial. Returns
// the sum.
__attribute__((target("avx2,fma"))) float ExpAndSumAvx2(float* values, int64_t count,
                                                        float shift) {
  const __m256 shift_v = _mm256_set1_ps(shift), lowest = _mm256_set1_ps(kExpLowest);
  const __m256 log2e = _mm256_set1_ps(kLog2e);
  const __m256 minus_ln2_high = _mm256_set1_ps(-kLn2High);
  const __m256 minus_ln2_low = _mm256_set1_ps(-kLn2Low);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(values + j), shift_v);
    const __m256 in_range = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ);
    const __m256 clamped = _mm256_max_ps(x, lowest);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, log2e),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_fmadd_ps(n, minus_ln2_low, _mm256_fmadd_ps(n, minus_ln2_high, clamped));
    __m256 p = _mm256_set1_ps(kExpCoefficients[0]);
    for (int c = 1; c < kExpTerms; ++c) {
      p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpCoefficients[c]));
    }
    const __m256i exponent =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(exponent)), in_range);
    _mm256_storeu_ps(values + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = HorizontalSum(sum);
  for (; j < count; ++j) {
    values[j] = std::exp(values[j] - shift);
    total += values[j];
  }
  return total;
}

// The same exp, 16 lanes at a time; a last partial vector is masked instead of left to
// std::exp (causal rows end anywhere).
// (GCC 12 takes the reductions' and masked loads' undefined pass-through operands for
// uninitialised reads.)
#pragma GCC diagnostic push
#if !defined(__clang__)  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
__attribute__((target("avx512f"))) inline __m512 ExpAvx512(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(kExpLowest);
  const __mmask16 in_range = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ);
  const __m512 clamped = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Low),
                                   _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2High), clamped));
  __m512 p = _mm512_set1_ps(kExpCoefficients[0]);
  for (int c = 1; c < kExpTerms; ++c) {
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpCoefficients[c]));
  }
  const __m512i exponent =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(in_range, p, _mm512_castsi512_ps(exponent));
}

__attribute__((target("avx512f"))) float ExpAndSumAvx512(float* values, int64_t count,
                                                         float shift) {
  const __m512 shift_v = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) {
    const __m512 e = ExpAvx512(_mm512_sub_ps(_mm512_loadu_ps(values + j), shift_v));
    _mm512_storeu_ps(values + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < count) {
    const __mmask16 live = static_cast<__mmask16>((1u << (count - j)) - 1);
    const __m512 e =
        ExpAvx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, values + j), shift_v));
    _mm512_mask_storeu_ps(values + j, live, e);
    sum = _mm512_mask_add_ps(sum, live, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// exp(scale * x - shift) of `count` scores (one rounding; scale 1 is x - shift) rounded to
// bf16 into `out` (zeros up to `width`), for the values product of a bf16 layer; returns the
// float32 sum of the exps. One pass where ExpAndSum, normalizing and rounding would take three.
__attribute__((target("avx512f,avx512bf16"))) float ExpToBf16AndSumAvx512(
    const float* values, int64_t count, int64_t width, float scale, float shift, uint16_t* out) {
  const __m512 shift_v = _mm512_set1_ps(shift);
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) {
    const __m512 e = ExpAvx512(_mm512_fmsub_ps(_mm512_loadu_ps(values + j), scale_v, shift_v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), (__m256i)_mm512_cvtneps_pbh(e));
    sum = _mm512_add_ps(sum, e);
  }
  if (j < count) {
    const __mmask16 live = static_cast<__mmask16>((1u << (count - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        live,
        ExpAvx512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, values + j), scale_v, shift_v)));
    alignas(32) uint16_t last[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(last), (__m256i)_mm512_cvtneps_pbh(e));
    std::copy_n(last, count - j, out + j);
    sum = _mm512_add_ps(sum, e);
    j = count;
  }
  std::fill(out + j, out + width, uint16_t{0});
  return _mm512_reduce_add_ps(sum);
}

__attribute__((target("avx512f"))) float RowMaxAvx512(const float* values, int64_t count) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = lowest, m1 = lowest;  // two chains: one would wait out the max's latency
  int64_t j = 0;
  for (; j + 32 <= count; j += 32) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(values + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(values + j + 16));
  }
  for (; j + 16 <= count; j += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(values + j));
  if (j < count) {
    const __mmask16 live = static_cast<__mmask16>((1u << (count - j)) - 1);
    m1 = _mm512_max_ps(m1, _mm512_mask_loadu_ps(lowest, live, values + j));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}
#pragma GCC diagnostic pop

__attribute__((target("avx2,fma"))) float RowMaxAvx2(const float* values, int64_t count) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(values + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float result = *std::max_element(lanes, lanes + 8);
  for (; j < count; ++j) result = std::max(result, values[j]);
  return result;
}

const bool kHasAvx2Fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
constexpr bool kHasAvx2Fma = false;
float ExpAndSumAvx2(float*, int64_t, float) { return 0.0f; }
float RowMaxAvx2(const float*, int64_t) { return 0.0f; }
float ExpAndSumAvx512(float*, int64_t, float) { return 0.0f; }
float ExpToBf16AndSumAvx512(const float*, int64_t, int64_t, float, float, uint16_t*) {
  return 0.0f;
}
float RowMaxAvx512(const float*, int64_t) { return 0.0f; }
#endif

float ExpAndSum(float* values, int64_t count, float shift) {
  if (BestSimdLevel() == SimdLevel::kAvx512) return ExpAndSumAvx512(values, count, shift);
  if (kHasAvx2Fma) return ExpAndSumAvx2(values, count, shift);
  float sum = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    values[j] = std::exp(values[j] - shift);
    sum += values[j];
  }
  return sum;
}

float RowMax(const float* values, int64_t count) {
  if (BestSimdLevel() == SimdLevel::kAvx512) return RowMaxAvx512(values, count);
  if (kHasAvx2Fma) return RowMaxAvx2(values, count);
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) m = std::max(m, values[j]);
  return m;
}

void ScaleRow(float* values, int64_t count, float factor) {
  for (int64_t j = 0; j < count; ++j) values[j] *= factor;
}

int64_t QueryBlocks(const AttentionDims& d) {
  const int64_t rows = QueryBlockRows(d.kv_len);
  return (d.q_len + rows - 1) / rows;
}

// Keys per step of the online softmax: long key ranges are processed in blocks this size, so
// the scores of one query block never exceed rows x kKeyBlock floats.
constexpr int64_t kKeyBlock = 1024;

// Up to this many keys, a head's two GEMMs run on the microkernel (core/cpu/gemm.h), which
// reads the queries and probabilities in place where OpenBLAS would pack them too; so every
// block of the online softmax does. attention_bench's BM_AttentionCpu against OpenBLAS per
// CPU second: 1.15 at 1024 keys with the wide AVX-512 tiles on Intel (two FMA ports); on
// Zen 4 the wide tiles at 1024 keys were 1.09 x the same code with 512 here, on Zen 3 (AVX2)
// 1.02, within the noise.
constexpr int64_t kTinyHeadKeys = kKeyBlock;

// The packed keys or values of one head (float32, or bf16 panels), reused by this thread's
// next head (the scores GEMM and the values GEMM take turns with it).
template <typename T>
T* HeadPanels(int64_t elements) {
  thread_local std::vector<T> panels;
  panels.resize(elements);
  return panels.data();
}

// The rounded query rows or probabilities of one head's products in bf16, reused by this
// thread's next head.
uint16_t* Bf16Rows(const float* rows_in, int64_t rows, int64_t width, int64_t stride) {
  thread_local std::vector<uint16_t> rounded;
  rounded.resize(rows * width);
  for (int64_t r = 0; r < rows; ++r) {
    RoundToBf16(rows_in + r * stride, width, rounded.data() + r * width);
  }
  return rounded.data();
}

// One head's rows of Q, K or V from `row` on, `stride` elements apart: float32, or (a
// problem's *_bf16 sources) already rounded to bf16; the other pointer is null.
struct HeadRows {
  const float* f32;
  const uint16_t* bf16;
  int64_t stride;
};
HeadRows RowsOf(const float* f32, const uint16_t* bf16, const HeadLayout& layout, int64_t b,
                int64_t head, int64_t row) {
  const int64_t offset = layout.Offset(b, head, row);
  return {f32 == nullptr ? nullptr : f32 + offset, bf16 == nullptr ? nullptr : bf16 + offset,
          layout.row_stride};
}

// bf16 panels of `depth` x `columns` rows of K (transposed: depth_stride 1) or V.
uint16_t* Bf16HeadPanels(const HeadRows& rows, int64_t depth, int64_t columns, bool transposed) {
  uint16_t* panels = HeadPanels<uint16_t>(Bf16PanelElements(depth, columns));
  const int64_t depth_stride = transposed ? 1 : rows.stride;
  const int64_t column_stride = transposed ? rows.stride : 1;
  if (rows.bf16 != nullptr) {
    PackBf16Panels(rows.bf16, depth, columns, depth_stride, column_stride, panels);
  } else {
    PackBf16Panels(rows.f32, depth, columns, depth_stride, column_stride, panels);
  }
  return panels;
}

// scores[rows, keys] = scale * Q K^T against `keys` keys; in bf16 products with `bf16` (up
// to kTinyHeadKeys keys, which every online block is; the only path of bf16 sources).
void ScoresGemm(const HeadRows& query, int64_t rows, const HeadRows& key, int64_t keys,
                int64_t head_dim, float scale, float* scores, bool bf16, Bf16Kernel kernel) {
  if (bf16 && keys <= kTinyHeadKeys) {
    const bool rounded = query.bf16 != nullptr;
    const uint16_t* a = rounded ? query.bf16 : Bf16Rows(query.f32, rows, head_dim, query.stride);
    const uint16_t* panels = Bf16HeadPanels(key, head_dim, keys, /*transposed=*/true);
    GemmBf16Panels(kernel, a, rounded ? query.stride : head_dim, rows, panels, head_dim, keys, 0,
                   PanelCount(keys), scale, nullptr, scores, keys);
    return;
  }
  if (keys > kTinyHeadKeys) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, head_dim, scale, query.f32,
                query.stride, key.f32, key.stride, 0.0f, scores, keys);
    return;
  }
  float* panels = HeadPanels<float>(PanelFloats(head_dim, keys));
  PackTransposed(key.f32, keys, head_dim, key.stride, panels);
  GemmPanels(BestSimdLevel(), query.f32, query.stride, rows, panels, head_dim, keys, 0,
             PanelCount(keys), scale, nullptr, scores, keys);
}

// ValuesGemm's bf16 products, for probabilities already rounded to bf16 (up to kTinyHeadKeys).
void ValuesGemmBf16(const uint16_t* probabilities, int64_t rows, int64_t keys,
                    const HeadRows& value, int64_t v_head_dim, bool accumulate, float* out,
                    int64_t out_stride, Bf16Kernel kernel) {
  const uint16_t* panels = Bf16HeadPanels(value, keys, v_head_dim, /*transposed=*/false);
  GemmBf16Panels(kernel, probabilities, keys, rows, panels, keys, v_head_dim, 0,
                 PanelCount(v_head_dim), 1.0f, nullptr, out, out_stride, accumulate);
}

// out[rows, v_head_dim] = P V, or += with `accumulate`, for probabilities P [rows, keys].
void ValuesGemm(const float* probabilities, int64_t rows, int64_t keys, const HeadRows& value,
                int64_t v_head_dim, bool accumulate, float* out, int64_t out_stride, bool bf16,
                Bf16Kernel kernel) {
  if (bf16 && keys <= kTinyHeadKeys) {
    ValuesGemmBf16(Bf16Rows(probabilities, rows, keys, keys), rows, keys, value, v_head_dim,
                   accumulate, out, out_stride, kernel);
    return;
  }
  if (keys > kTinyHeadKeys) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, v_head_dim, keys, 1.0f,
                probabilities, keys, value.f32, value.stride, accumulate ? 1.0f : 0.0f, out,
                out_stride);
    return;
  }
  float* panels = HeadPanels<float>(PanelFloats(keys, v_head_dim));
  PackRows(value.f32, keys, v_head_dim, value.stride, panels);
  GemmPanels(BestSimdLevel(), probabilities, keys, rows, panels, keys, v_head_dim, 0,
             PanelCount(v_head_dim), 1.0f, nullptr, out, out_stride, accumulate);
}

// Zeroes `rows` rows of `width` floats `stride` apart.
void ZeroRows(float* out, int64_t rows, int64_t stride, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) std::fill(out + r * stride, out + r * stride + width, 0.0f);
}

// Query i's scaled scores against keys [first_key, first_key + keys) in `row`, as the
// scores GEMM left them: adds the element masks and zeroes the entries past i's key limit.
// Returns how many leading entries take part in the softmax.
int64_t MaskScoreRow(const AttentionProblem& p, int64_t b, int64_t h, int64_t i,
                     int64_t first_key, int64_t keys, float* row) {
  const MaskView mask = p.options->View(p.dims);
  const int64_t valid = std::clamp<int64_t>(mask.KeyLimit(b, i) - first_key, 0, keys);
  std::fill(row + valid, row + keys, 0.0f);
  if (mask.HasElementMasks()) {
    for (int64_t j = 0; j < valid; ++j) row[j] += mask.ScoreBias(b, h, i, first_key + j);
  }
  return valid;
}

// Dropout of query i's probabilities for keys [first_key, first_key + count), in place:
// kept ones are scaled by 1 / (1 - p).
void DropOutRow(const AttentionOptions& options, int64_t b, int64_t h, int64_t i,
                int64_t first_key, int64_t count, float* row) {
  if (options.dropout_p <= 0.0f) return;
  const float keep_scale = 1.0f / (1.0f - options.dropout_p);
  for (int64_t j = 0; j < count; ++j) {
    row[j] = DropoutKeeps(options.dropout_seed, options.dropout_p, b, h, i, first_key + j)
                 ? row[j] * keep_scale
                 : 0.0f;
  }
}

// Where row i of head h of sequence b keeps its log-sum-exp (the problem asks for it).
float* LogSumExpAt(const AttentionProblem& p, int64_t b, int64_t h, int64_t i) {
  return p.log_sum_exp + p.log_sum_exp_layout.Offset(b, h, i);
}

// Flash-style pass for one query block over `key_count` keys in blocks of kKeyBlock: a
// running row maximum and sum rescale what is already accumulated in `out`, so no row of
// scores longer than kKeyBlock is ever held. Used when no attention weights are returned.
void AttendBlockOnline(const AttentionProblem& p, Bf16Kernel kernel, int64_t b, int64_t h,
                       int64_t first_row, int64_t rows, int64_t key_count, float* out,
                       int64_t out_stride) {
  const AttentionOptions& options = *p.options;
  const AttentionDims& d = p.dims;
  const int64_t hk = KvHead(d, h);
  thread_local std::vector<float> scores;
  thread_local std::vector<OnlineSoftmaxRow> softmax;
  scores.resize(rows * kKeyBlock);
  softmax.assign(rows, OnlineSoftmaxRow{});
  ZeroRows(out, rows, out_stride, d.v_head_dim);
  for (int64_t first_key = 0; first_key < key_count; first_key += kKeyBlock) {
    const int64_t keys = std::min(kKeyBlock, key_count - first_key);
    ScoresGemm(RowsOf(p.query, p.query_bf16, p.query_layout, b, h, first_row), rows,
               RowsOf(p.key, p.key_bf16, p.key_layout, b, hk, first_key), keys, d.head_dim,
               options.Scale(d), scores.data(), p.bf16_products, kernel);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = first_row + r;
      float* row = scores.data() + r * keys;
      const int64_t valid = MaskScoreRow(p, b, h, i, first_key, keys, row);
      const float block_max = RowMax(row, valid);
      if (block_max == -std::numeric_limits<float>::infinity()) {
        std::fill(row, row + valid, 0.0f);  // nothing to attend in this block
        continue;
      }
      // Earlier blocks were exponentiated against the old maximum: rescale them.
      const float correction = softmax[r].Rescale(block_max);
      if (correction != 1.0f) ScaleRow(out + r * out_stride, d.v_head_dim, correction);
      // The sum before dropout normalizes.
      softmax[r].sum += ExpAndSum(row, valid, softmax[r].max);
      DropOutRow(options, b, h, i, first_key, valid, row);
    }
    ValuesGemm(scores.data(), rows, keys,
               RowsOf(p.value, p.value_bf16, p.value_layout, b, hk, first_key), d.v_head_dim,
               /*accumulate=*/true, out, out_stride, p.bf16_products, kernel);
  }
  for (int64_t r = 0; r < rows; ++r) {
    // A fully masked row has sum 0 and an all-zero accumulator: it stays zeros.
    ScaleRow(out + r * out_stride, d.v_head_dim, softmax[r].InverseSum());
    if (p.log_sum_exp != nullptr) {
      *LogSumExpAt(p, b, h, first_row + r) = softmax[r].sum > 0.0f
                                                 ? softmax[r].max + std::log(softmax[r].sum)
                                                 : -std::numeric_limits<float>::infinity();
    }
  }
}

// Query rows [first_row, first_row + rows) of head h of sequence b into float32 `out`
// (rows `out_stride` apart).
void AttendRows(const AttentionProblem& p, Bf16Kernel kernel, int64_t b, int64_t h,
                int64_t first_row, int64_t rows, float* out, int64_t out_stride) {
  const AttentionOptions& options = *p.options;
  const AttentionDims& d = p.dims;
  const float scale = options.Scale(d);
  const int64_t hk = KvHead(d, h);
  // Keys past the last row's causal frontier are never attended: skip them entirely.
  const int64_t key_count = options.KeyLimit(d, b, first_row + rows - 1);
  float* weights =
      p.weights == nullptr ? nullptr
                           : p.weights + ((b * d.num_heads + h) * d.q_len + first_row) * d.kv_len;
  if (weights != nullptr) std::fill(weights, weights + rows * d.kv_len, 0.0f);
  if (key_count == 0) {
    ZeroRows(out, rows, out_stride, d.v_head_dim);
    for (int64_t r = 0; p.log_sum_exp != nullptr && r < rows; ++r) {
      *LogSumExpAt(p, b, h, first_row + r) = -std::numeric_limits<float>::infinity();
    }
    return;
  }
  if (weights == nullptr && key_count > kKeyBlock) {
    AttendBlockOnline(p, kernel, b, h, first_row, rows, key_count, out, out_stride);
    return;
  }
  // One pass over all keys: the whole row of scores is needed when weights are returned,
  // and short rows need no second pass anyway.
  thread_local std::vector<float> scores;
  scores.resize(rows * key_count);
  // bf16 products without weights or dropout: the exps go to bf16 as they are computed and
  // the output rows are normalized instead (v_head_dim columns, not key_count).
  const bool exps_in_bf16 = p.bf16_products && weights == nullptr && options.dropout_p <= 0.0f &&
                            key_count <= kTinyHeadKeys;
  // Unscaled scores where no mask adds to them: the exp scales them, and the products'
  // sums go to `scores` as they are (AMX stores its tiles there, no pass of its own).
  const float exp_scale =
      exps_in_bf16 && scale > 0.0f && !options.View(d).HasElementMasks() ? scale : 1.0f;
  ScoresGemm(RowsOf(p.query, p.query_bf16, p.query_layout, b, h, first_row), rows,
             RowsOf(p.key, p.key_bf16, p.key_layout, b, hk, 0), key_count, d.head_dim,
             scale / exp_scale, scores.data(), p.bf16_products, kernel);
  thread_local std::vector<uint16_t> exps_bf16;
  thread_local std::vector<float> inverse_sums;
  if (exps_in_bf16) {
    exps_bf16.resize(rows * key_count);
    inverse_sums.assign(rows, 0.0f);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = first_row + r;
    float* row = scores.data() + r * key_count;
    const int64_t limit = MaskScoreRow(p, b, h, i, 0, key_count, row);
    const float max_score = RowMax(row, limit);
    if (max_score == -std::numeric_limits<float>::infinity()) {
      std::fill(row, row + limit, 0.0f);  // fully masked row: zeros, never NaN
      if (exps_in_bf16) std::fill_n(exps_bf16.data() + r * key_count, key_count, uint16_t{0});
      if (p.log_sum_exp != nullptr) *LogSumExpAt(p, b, h, i) = max_score;
      continue;
    }
    if (exps_in_bf16) {
      const float shift = exp_scale * max_score;  // the scaled maximum: exp_scale > 0
      const float sum = ExpToBf16AndSumAvx512(row, limit, key_count, exp_scale, shift,
                                              exps_bf16.data() + r * key_count);
      if (p.log_sum_exp != nullptr) *LogSumExpAt(p, b, h, i) = shift + std::log(sum);
      inverse_sums[r] = 1.0f / sum;
      continue;
    }
    const float sum = ExpAndSum(row, limit, max_score);
    if (p.log_sum_exp != nullptr) *LogSumExpAt(p, b, h, i) = max_score + std::log(sum);
    ScaleRow(row, limit, 1.0f / sum);
    DropOutRow(options, b, h, i, 0, limit, row);
    if (weights != nullptr) std::copy(row, row + key_count, weights + r * d.kv_len);
  }
  const HeadRows value = RowsOf(p.value, p.value_bf16, p.value_layout, b, hk, 0);
  if (exps_in_bf16) {
    ValuesGemmBf16(exps_bf16.data(), rows, key_count, value, d.v_head_dim, /*accumulate=*/false,
                   out, out_stride, kernel);
    for (int64_t r = 0; r < rows; ++r)
      ScaleRow(out + r * out_stride, d.v_head_dim, inverse_sums[r]);
    return;
  }
  ValuesGemm(scores.data(), rows, key_count, value, d.v_head_dim, /*accumulate=*/false, out,
             out_stride, p.bf16_products, kernel);
}

// One (sequence b, head h, query block) of a problem.
void AttendBlock(const AttentionProblem& p, Bf16Kernel kernel, int64_t b, int64_t h,
                 int64_t block) {
  const AttentionDims& d = p.dims;
  const int64_t block_rows = QueryBlockRows(d.kv_len);
  const int64_t first_row = block * block_rows;
  const int64_t rows = std::min(block_rows, d.q_len - first_row);
  const int64_t offset = p.output_layout.Offset(b, h, first_row);
  const int64_t stride = p.output_layout.row_stride;
  if (p.output_bf16 == nullptr) {
    AttendRows(p, kernel, b, h, first_row, rows, p.output + offset, stride);
    return;
  }
  // Rows answered in bf16: attended in float32 here, in cache, then rounded once.
  thread_local std::vector<float> attended;
  attended.resize(rows * d.v_head_dim);
  AttendRows(p, kernel, b, h, first_row, rows, attended.data(), d.v_head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    RoundToBf16(attended.data() + r * d.v_head_dim, d.v_head_dim,
                p.output_bf16 + offset + r * stride);
  }
}

}  // namespace

void AttentionBlockedCpu(absl::Span<const AttentionProblem> problems, ThreadPool& pool,
                         Bf16Kernel bf16_kernel) {
  std::vector<int64_t> first_task(problems.size() + 1, 0);
  for (size_t k = 0; k < problems.size(); ++k) {
    const AttentionDims& d = problems[k].dims;
    first_task[k + 1] = first_task[k] + d.batch * d.num_heads * QueryBlocks(d);
  }
  const auto run_task = [&](int64_t task) {
    const size_t k =
        std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
    const AttentionProblem& p = problems[k];
    const int64_t blocks = QueryBlocks(p.dims);
    const int64_t local = task - first_task[k];
    AttendBlock(p, bf16_kernel, local / (blocks * p.dims.num_heads),
                (local / blocks) % p.dims.num_heads, local % blocks);
  };
  // A lone short request's attention is a few microseconds of work: waking the pool's
  // threads for it costs more than it saves.
  double multiply_adds = 0;
  for (const AttentionProblem& p : problems) {
    const AttentionDims& d = p.dims;
    multiply_adds += static_cast<double>(d.batch * d.num_heads * d.q_len) * d.kv_len *
                     (d.head_dim + d.v_head_dim);
  }
  constexpr double kSerialMultiplyAdds = 1 << 20;
  if (multiply_adds < kSerialMultiplyAdds) {
    for (int64_t task = 0; task < first_task.back(); ++task) run_task(task);
    return;
  }
  pool.ParallelFor(first_task.back(), run_task);
}

const char* Bf16ProductsName(Bf16Kernel kernel) {
  return kernel == Bf16Kernel::kPortable ? "float32" : Bf16KernelName(kernel);
}

absl::StatusOr<Bf16Kernel> ParseBf16Products(absl::string_view name) {
  for (const Bf16Kernel kernel :
       {Bf16Kernel::kAmx, Bf16Kernel::kAvx512Bf16, Bf16Kernel::kPortable}) {
    if (name == Bf16ProductsName(kernel)) return kernel;
  }
  return absl::InvalidArgumentError(absl::StrCat("bf16 attention kernel \"", name.substr(0, 64),
                                                 "\" is not one of amx, avx512_bf16, float32"));
}

bool CpuSupportsBf16Products(Bf16Kernel kernel) {
  // AMX hosts have AVX512-BF16 too (AmxTilesUsable checks): the softmax's bf16 exps use it.
  return kernel == Bf16Kernel::kPortable || CpuSupports(kernel);
}

namespace {

struct ProductsCalibration {
  Bf16Kernel fastest = Bf16Kernel::kPortable;
  std::string report;
};

// Times each kernel on one head of S2's shape as a BFLOAT16 layer attends it: bf16 Q, K and
// V for bf16 products, float32 ones for float32 products.
ProductsCalibration CalibrateProducts() {
  SdpaInput input;
  input.dims.q_len = 256;
  input.dims.kv_len = 512;
  input.dims.head_dim = input.dims.v_head_dim = 64;
  input.options.need_weights = NeedWeights::kNone;
  const AttentionDims& d = input.dims;
  std::mt19937 rng(39);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> q(d.q_len * d.head_dim), k(d.kv_len * d.head_dim), v(d.kv_len * d.head_dim);
  for (std::vector<float>* x : {&q, &k, &v}) {
    for (float& value : *x) value = uniform(rng);
  }
  std::vector<uint16_t> q16(q.size()), k16(k.size()), v16(v.size());
  RoundToBf16(q.data(), static_cast<int64_t>(q.size()), q16.data(), Bf16Kernel::kPortable);
  RoundToBf16(k.data(), static_cast<int64_t>(k.size()), k16.data(), Bf16Kernel::kPortable);
  RoundToBf16(v.data(), static_cast<int64_t>(v.size()), v16.data(), Bf16Kernel::kPortable);
  std::vector<float> out(d.q_len * d.v_head_dim);
  ThreadPool one_thread(1);
  ProductsCalibration calibration;
  double best_gflops = 0;
  for (const Bf16Kernel kernel :
       {Bf16Kernel::kAmx, Bf16Kernel::kAvx512Bf16, Bf16Kernel::kPortable}) {
    if (!CpuSupportsBf16Products(kernel)) continue;
    AttentionProblem problem =
        SdpaProblem<float>(input, q.data(), k.data(), v.data(), out.data(), nullptr);
    if (kernel != Bf16Kernel::kPortable) {
      problem.bf16_products = true;
      problem.query = problem.key = problem.value = nullptr;
      problem.query_bf16 = q16.data();
      problem.key_bf16 = k16.data();
      problem.value_bf16 = v16.data();
    }
    AttentionBlockedCpu({&problem, 1}, one_thread, kernel);  // buffers and pages
    double seconds = std::numeric_limits<double>::max();
    for (int run = 0; run < 3; ++run) {
      const auto start = std::chrono::steady_clock::now();
      AttentionBlockedCpu({&problem, 1}, one_thread, kernel);
      seconds = std::min(
          seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    const double gflops = 2.0 * d.q_len * d.kv_len * (d.head_dim + d.v_head_dim) / seconds / 1e9;
    absl::StrAppend(&calibration.report, calibration.report.empty() ? "" : ", ",
                    Bf16ProductsName(kernel), " ", static_cast<int64_t>(gflops),
                    calibration.report.empty() ? " GFLOPS" : "");
    if (gflops > best_gflops) {
      best_gflops = gflops;
      calibration.fastest = kernel;
    }
  }
  if (!CpuSupports(Bf16Kernel::kAmx) && CpuSupports(Bf16Kernel::kAvx512Bf16)) {
    absl::StrAppend(&calibration.report, "; no amx: ", AmxUnavailableReason());
  }
  return calibration;
}

const ProductsCalibration& ProductsMeasuredOnce() {
  static const ProductsCalibration calibration = CalibrateProducts();
  return calibration;
}

}  // namespace

Bf16Kernel FastestBf16Products() { return ProductsMeasuredOnce().fastest; }

std::string Bf16ProductsReport() { return ProductsMeasuredOnce().report; }

}  // namespace attention::core

#include "core/cpu/paged_attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cpu/exp_poly.h"
#include "core/cpu/gemm.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cpu/paged_decode_split.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace attention::core {
namespace {

using kv_cache::BlockId;
using kv_cache::KvLayout;
using paged_decode::FirstVisibleKey;
using paged_decode::kNegativeInfinity;
using paged_decode::kStateAccumulator;
using paged_decode::kStateMax;
using paged_decode::kStateSum;
using paged_decode::StateFloats;

// Keys per tile of the portable and AVX2 split: a tile's float32 keys and values of one head
// (Llama's 128 + 128 dims: 32 KiB) stay in L1/L2 while every query row of the group reads them.
constexpr int64_t kTileKeys = 32;
// bfloat16 tiles are widened into float32 scratch that every row then reads: 16 keys keep
// that scratch (16 KiB at Llama's dims) in L1 beside the bf16 rows. Zen 3, BM_PagedDecode
// bf16, alternated 3 rounds: 32k B=8 178-185 -> 146-159 ms, 4k B=8 20.1-26.2 -> 18.0-18.7 ms
// (float32 KV: 23.5 ms).
constexpr int64_t kBFloat16TileKeys = 16;

// The row operations in plain C++, always inlined into the AVX2 wrappers below so that the
// compiler vectorizes them there; the portable build runs them as they are. Sums use 8
// lanes because a compiler may not reorder a single float accumulator.
#define PAGED_INLINE __attribute__((always_inline)) inline

// scores[j] = scale * query . key_j for `count` keys `key_stride` floats apart.
PAGED_INLINE void ScoresGeneric(const float* query, const float* keys, int64_t key_stride,
                                int64_t count, int64_t dim, float scale, float* scores) {
  for (int64_t j = 0; j < count; ++j) {
    const float* key = keys + j * key_stride;
    float lanes[8] = {};
    int64_t c = 0;
    for (; c + 8 <= dim; c += 8) {
      for (int l = 0; l < 8; ++l) lanes[l] += query[c + l] * key[c + l];
    }
    float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (; c < dim; ++c) sum += query[c] * key[c];
    scores[j] = sum * scale;
  }
}

// acc += sum_j weights[j] * value_j.
PAGED_INLINE void AccumulateGeneric(float* __restrict acc, const float* __restrict weights,
                                    const float* __restrict values, int64_t value_stride,
                                    int64_t count, int64_t dim) {
  for (int64_t j = 0; j < count; ++j) {
    const float weight = weights[j];
    const float* value = values + j * value_stride;
    for (int64_t c = 0; c < dim; ++c) acc[c] += weight * value[c];
  }
}

PAGED_INLINE float MaxGeneric(const float* values, int64_t count) {
  float lanes[8];
  std::fill_n(lanes, 8, kNegativeInfinity);
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] = values[j + l] > lanes[l] ? values[j + l] : lanes[l];
  }
  float result = *std::max_element(lanes, lanes + 8);
  for (; j < count; ++j) result = std::max(result, values[j]);
  return result;
}

// values[j] = exp(values[j] - shift) for values <= shift; returns their sum.
PAGED_INLINE float ExpAndSumGeneric(float* values, int64_t count, float shift) {
  for (int64_t j = 0; j < count; ++j) values[j] = std::max(values[j] - shift, kExpLowest);
  for (int64_t j = 0; j < count; ++j) values[j] = ExpOfClamped(values[j]);
  float lanes[8] = {};
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] += values[j + l];
  }
  float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
              ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; j < count; ++j) sum += values[j];
  return sum;
}

// `count` bfloat16 values to float32.
PAGED_INLINE void WidenBFloat16Generic(const uint16_t* __restrict source, int64_t count,
                                       float* __restrict destination) {
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(source[i]) << 16;
    std::memcpy(&destination[i], &bits, sizeof(float));
  }
}

// Key `key` of `sequence` and its value for `kv_head`: a head's rows run on contiguously to
// the end of the key's block.
struct KvRows {
  const char* keys;
  const char* values;
};
KvRows KvRowsAt(const PagedDecodeBatch& batch, const PagedDecodeSequence& sequence, int64_t kv_head,
                int64_t key) {
  const int64_t tokens_per_block = batch.tokens_per_block, slot = key % tokens_per_block;
  const int64_t element_bytes = batch.layout.ElementBytes();
  const char* block = static_cast<const char*>(batch.storage.data) +
                      sequence.block_table[key / tokens_per_block] * batch.storage.block_bytes;
  return {
      block + kv_cache::KeyOffset(batch.layout, tokens_per_block, slot, kv_head) * element_bytes,
      block + kv_cache::ValueOffset(batch.layout, tokens_per_block, slot, kv_head) * element_bytes};
}

struct RowKernels {
  void (*scores)(const float*, const float*, int64_t, int64_t, int64_t, float, float*);
  void (*accumulate)(float*, const float*, const float*, int64_t, int64_t, int64_t);
  // The same for two rows at once, each key and value read once for both; each row's
  // arithmetic is the single-row kernel's, so a row's result does not depend on its pair.
  void (*scores_pair)(const float*, const float*, const float*, int64_t, int64_t, int64_t, float,
                      float*, float*);
  void (*accumulate_pair)(float*, float*, const float*, const float*, const float*, int64_t,
                          int64_t, int64_t);
  float (*max)(const float*, int64_t);
  float (*exp_and_sum)(float*, int64_t, float);
  void (*widen_bfloat16)(const uint16_t*, int64_t, float*);
};

// One copy of the generic kernels per target: the dot products and value sums, and the
// softmax and widening steps. AVX-512 CPUs run AttendSplitAvx512 below instead (the AVX2
// kernels serve one without AVX512BW).
// NOLINTBEGIN(bugprone-macro-parentheses): Target is a function attribute, not a value.
#define PAGED_ROW_KERNELS(Suffix, Target)                                                \
  Target void Scores##Suffix(const float* q, const float* k, int64_t ks, int64_t count,  \
                             int64_t dim, float scale, float* out) {                     \
    ScoresGeneric(q, k, ks, count, dim, scale, out);                                     \
  }                                                                                      \
  Target void Accumulate##Suffix(float* acc, const float* w, const float* v, int64_t vs, \
                                 int64_t count, int64_t dim) {                           \
    AccumulateGeneric(acc, w, v, vs, count, dim);                                        \
  }
#define PAGED_SOFTMAX_KERNELS(Suffix, Target)                                     \
  Target float Max##Suffix(const float* values, int64_t count) {                  \
    return MaxGeneric(values, count);                                             \
  }                                                                               \
  Target float ExpAndSum##Suffix(float* values, int64_t count, float shift) {     \
    return ExpAndSumGeneric(values, count, shift);                                \
  }                                                                               \
  Target void WidenBFloat16##Suffix(const uint16_t* s, int64_t count, float* d) { \
    WidenBFloat16Generic(s, count, d);                                            \
  }
// NOLINTEND(bugprone-macro-parentheses)

PAGED_ROW_KERNELS(Portable, )
PAGED_SOFTMAX_KERNELS(Portable, )
void ScoresPairPortable(const float* q0, const float* q1, const float* keys, int64_t key_stride,
                        int64_t count, int64_t dim, float scale, float* s0, float* s1) {
  ScoresGeneric(q0, keys, key_stride, count, dim, scale, s0);
  ScoresGeneric(q1, keys, key_stride, count, dim, scale, s1);
}
void AccumulatePairPortable(float* acc0, float* acc1, const float* w0, const float* w1,
                            const float* values, int64_t value_stride, int64_t count, int64_t dim) {
  AccumulateGeneric(acc0, w0, values, value_stride, count, dim);
  AccumulateGeneric(acc1, w1, values, value_stride, count, dim);
}
#if defined(__x86_64__)
PAGED_SOFTMAX_KERNELS(Avx2, __attribute__((target("avx2,fma"))))
#define PAGED_AVX2 __attribute__((target("avx2,fma")))

// scores[0..3] = scale * the sums of sums[0..3]'s lanes: lane pairs, then quads ([k0 k1 k2 k3]
// in each 128-bit half), then the halves added.
PAGED_AVX2 inline void ReduceFourScores(const __m256* sums, float scale, float* scores) {
  const __m256 pairs =
      _mm256_hadd_ps(_mm256_hadd_ps(sums[0], sums[1]), _mm256_hadd_ps(sums[2], sums[3]));
  const __m128 total = _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
  _mm_storeu_ps(scores, _mm_mul_ps(total, _mm_set1_ps(scale)));
}

// The AVX2 dot products: four keys at a time, each query chunk loaded once for the four,
// their sums reduced together (the generic loop reduced 8 lanes per key). Scored in the
// same order for every split, so results do not depend on the thread count.
PAGED_AVX2 void ScoresAvx2(const float* query, const float* keys, int64_t key_stride, int64_t count,
                           int64_t dim, float scale, float* scores) {
  if (dim % 8 != 0) return ScoresGeneric(query, keys, key_stride, count, dim, scale, scores);
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const float* key = keys + j * key_stride;
    __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                      _mm256_setzero_ps()};
    for (int64_t c = 0; c < dim; c += 8) {
      const __m256 q = _mm256_loadu_ps(query + c);
      for (int k = 0; k < 4; ++k) {
        sums[k] = _mm256_fmadd_ps(q, _mm256_loadu_ps(key + k * key_stride + c), sums[k]);
      }
    }
    ReduceFourScores(sums, scale, scores + j);
  }
  ScoresGeneric(query, keys + j * key_stride, key_stride, count - j, dim, scale, scores + j);
}

// acc += sum_j weights[j] * value_j, 32 columns at a time held in registers across the
// keys (the generic loop loaded and stored the accumulators for every key); per column the
// same products in the same order.
PAGED_AVX2 void AccumulateAvx2(float* __restrict acc, const float* __restrict weights,
                               const float* __restrict values, int64_t value_stride, int64_t count,
                               int64_t dim) {
  constexpr int64_t kColumns = 32;
  const int64_t whole = dim / kColumns * kColumns;
  for (int64_t c = 0; c < whole; c += kColumns) {
    __m256 sums[4];
    for (int v = 0; v < 4; ++v) sums[v] = _mm256_loadu_ps(acc + c + 8 * v);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 weight = _mm256_set1_ps(weights[j]);
      const float* value = values + j * value_stride + c;
      for (int v = 0; v < 4; ++v) {
        sums[v] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + 8 * v), sums[v]);
      }
    }
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + c + 8 * v, sums[v]);
  }
  if (whole < dim) {
    AccumulateGeneric(acc + whole, weights, values + whole, value_stride, count, dim - whole);
  }
}

// ScoresAvx2 for two query rows, each key chunk loaded once for both: per row the same
// products, sums and reduction as ScoresAvx2.
PAGED_AVX2 void ScoresPairAvx2(const float* q0, const float* q1, const float* keys,
                               int64_t key_stride, int64_t count, int64_t dim, float scale,
                               float* s0, float* s1) {
  if (dim % 8 != 0) {
    ScoresGeneric(q0, keys, key_stride, count, dim, scale, s0);
    ScoresGeneric(q1, keys, key_stride, count, dim, scale, s1);
    return;
  }
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const float* key = keys + j * key_stride;
    __m256 sums0[4], sums1[4];
    for (int k = 0; k < 4; ++k) sums0[k] = sums1[k] = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 8) {
      const __m256 a = _mm256_loadu_ps(q0 + c), b = _mm256_loadu_ps(q1 + c);
      for (int k = 0; k < 4; ++k) {
        const __m256 key_chunk = _mm256_loadu_ps(key + k * key_stride + c);
        sums0[k] = _mm256_fmadd_ps(a, key_chunk, sums0[k]);
        sums1[k] = _mm256_fmadd_ps(b, key_chunk, sums1[k]);
      }
    }
    ReduceFourScores(sums0, scale, s0 + j);
    ReduceFourScores(sums1, scale, s1 + j);
  }
  ScoresGeneric(q0, keys + j * key_stride, key_stride, count - j, dim, scale, s0 + j);
  ScoresGeneric(q1, keys + j * key_stride, key_stride, count - j, dim, scale, s1 + j);
}

// AccumulateAvx2 for two rows, each value chunk loaded once for both: 32 columns of each
// row in registers across the keys; per column the same products in the same order.
PAGED_AVX2 void AccumulatePairAvx2(float* __restrict acc0, float* __restrict acc1,
                                   const float* __restrict w0, const float* __restrict w1,
                                   const float* __restrict values, int64_t value_stride,
                                   int64_t count, int64_t dim) {
  constexpr int64_t kColumns = 32;
  const int64_t whole = dim / kColumns * kColumns;
  for (int64_t c = 0; c < whole; c += kColumns) {
    __m256 sums0[4], sums1[4];
    for (int v = 0; v < 4; ++v) {
      sums0[v] = _mm256_loadu_ps(acc0 + c + 8 * v);
      sums1[v] = _mm256_loadu_ps(acc1 + c + 8 * v);
    }
    for (int64_t j = 0; j < count; ++j) {
      const __m256 weight0 = _mm256_set1_ps(w0[j]), weight1 = _mm256_set1_ps(w1[j]);
      const float* value = values + j * value_stride + c;
      for (int v = 0; v < 4; ++v) {
        const __m256 chunk = _mm256_loadu_ps(value + 8 * v);
        sums0[v] = _mm256_fmadd_ps(weight0, chunk, sums0[v]);
        sums1[v] = _mm256_fmadd_ps(weight1, chunk, sums1[v]);
      }
    }
    for (int v = 0; v < 4; ++v) {
      _mm256_storeu_ps(acc0 + c + 8 * v, sums0[v]);
      _mm256_storeu_ps(acc1 + c + 8 * v, sums1[v]);
    }
  }
  if (whole < dim) {
    AccumulateGeneric(acc0 + whole, w0, values + whole, value_stride, count, dim - whole);
    AccumulateGeneric(acc1 + whole, w1, values + whole, value_stride, count, dim - whole);
  }
}
#endif

RowKernels Kernels(SimdLevel level) {
#if defined(__x86_64__)
  if (level == SimdLevel::kAvx2 || level == SimdLevel::kAvx512) {
    return {ScoresAvx2, AccumulateAvx2, ScoresPairAvx2,   AccumulatePairAvx2,
            MaxAvx2,    ExpAndSumAvx2,  WidenBFloat16Avx2};
  }
#endif
  return {ScoresPortable, AccumulatePortable, ScoresPairPortable,   AccumulatePairPortable,
          MaxPortable,    ExpAndSumPortable,  WidenBFloat16Portable};
}

// The keys of one KV head in [key_begin, key_end) of one sequence, for every query row of
// its group: rows r = i * group + g (query i, head kv_head * group + g). Writes one state
// per row to `states`.
void AttendSplit(const RowKernels& kernels, const PagedDecodeBatch& batch,
                 const PagedDecodeSequence& sequence, int64_t kv_head, int64_t key_begin,
                 int64_t key_end, float* states) {
  const KvLayout& layout = batch.layout;
  const int64_t key_dim = layout.key_dim, value_dim = layout.value_dim;
  const int64_t group = batch.num_heads / layout.num_kv_heads;
  const int64_t n = sequence.num_queries, rows = n * group, state_floats = StateFloats(layout);
  const int64_t tokens_per_block = batch.tokens_per_block;
  const bool bfloat16 = layout.dtype == DType::kBFloat16;
  const int64_t element_bytes = layout.ElementBytes();

  thread_local std::vector<float> scratch;
  scratch.resize(kTileKeys * (key_dim + value_dim + 2));
  float* tile_keys = scratch.data();
  float* tile_values = tile_keys + kTileKeys * key_dim;
  float* scores = tile_values + kTileKeys * value_dim;  // two rows' scores
  float* pair_scores = scores + kTileKeys;

  for (int64_t r = 0; r < rows; ++r) {
    float* state = states + r * state_floats;
    state[kStateMax] = kNegativeInfinity;
    state[kStateSum] = 0.0f;
    std::fill_n(state + kStateAccumulator, value_dim, 0.0f);
  }
  // A tile: up to kTileKeys keys of one block, from `first`.
  struct Tile {
    const char* keys;
    const char* values;
    int64_t count;
  };
  const auto tile_at = [&](int64_t first) {
    const KvRows rows = KvRowsAt(batch, sequence, kv_head, first);
    return Tile{rows.keys, rows.values,
                std::min({key_end - first, tokens_per_block - first % tokens_per_block,
                          bfloat16 ? kBFloat16TileKeys : kTileKeys})};
  };
  const bool in_pairs = n > 1;
  // Keys before the window of the first query are seen by none.
  for (int64_t first = std::max(key_begin, FirstVisibleKey(batch, sequence.length - n));
       first < key_end;) {
    const Tile tile = tile_at(first);
    const int64_t count = tile.count;
    // The next tile's bytes, requested while this one computes: the hardware prefetchers
    // alone left the loads waiting on memory most of the time.
    if (first + count < key_end) {
      const Tile next = tile_at(first + count);
      for (int64_t offset = 0; offset < next.count * key_dim * element_bytes; offset += 64) {
        __builtin_prefetch(next.keys + offset, 0, 2);  // to L2
      }
      for (int64_t offset = 0; offset < next.count * value_dim * element_bytes; offset += 64) {
        __builtin_prefetch(next.values + offset, 0, 2);
      }
    }
    const char* key_bytes = tile.keys;
    const char* value_bytes = tile.values;
    const float* keys = reinterpret_cast<const float*>(key_bytes);
    const float* values = reinterpret_cast<const float*>(value_bytes);
    if (bfloat16) {  // widened once per tile, read by every row of the group
      kernels.widen_bfloat16(reinterpret_cast<const uint16_t*>(key_bytes), count * key_dim,
                             tile_keys);
      kernels.widen_bfloat16(reinterpret_cast<const uint16_t*>(value_bytes), count * value_dim,
                             tile_values);
      keys = tile_keys, values = tile_values;
    }
    for (int64_t i = 0; i < n; ++i) {
      // Bottom-right causal: query i sits at position L - n + i and sees [lo, hi) of the tile.
      const int64_t position = sequence.length - n + i;
      const int64_t lo = std::max<int64_t>(0, FirstVisibleKey(batch, position) - first);
      const int64_t visible = std::min(count, position + 1 - first) - lo;
      if (visible <= 0) continue;
      const float* visible_keys = keys + lo * key_dim;
      const float* visible_values = values + lo * value_dim;
      const auto query_of = [&](int64_t g) {
        return sequence.query + (i * batch.num_heads + kv_head * group + g) * key_dim;
      };
      const auto state_of = [&](int64_t g) { return states + (i * group + g) * state_floats; };
      // One row's scores (exponentiated in place) folded into its state.
      const auto fold = [&](float* row_scores, float* state) {
        const float new_max = std::max(state[kStateMax], kernels.max(row_scores, visible));
        const float correction = ExpOfNonPositive(state[kStateMax] - new_max);  // 0 at first
        const float sum = kernels.exp_and_sum(row_scores, visible, new_max);
        state[kStateMax] = new_max;
        state[kStateSum] = state[kStateSum] * correction + sum;
        if (correction != 1.0f) {
          for (int64_t c = 0; c < value_dim; ++c) state[kStateAccumulator + c] *= correction;
        }
      };
      // Rows in pairs, each tile read once for both, where the tile serves many rows (a
      // group of forks, several queries); an odd row alone. One query's group row by row:
      // pairs read 0.35-0.43 of the same-memory roof there against 0.45-0.50 (Zen 3, B=8).
      int64_t g = 0;
      for (; in_pairs && g + 2 <= group; g += 2) {
        float* first_state = state_of(g);
        float* second_state = state_of(g + 1);
        kernels.scores_pair(query_of(g), query_of(g + 1), visible_keys, key_dim, visible, key_dim,
                            batch.scale, scores, pair_scores);
        fold(scores, first_state);
        fold(pair_scores, second_state);
        kernels.accumulate_pair(first_state + kStateAccumulator, second_state + kStateAccumulator,
                                scores, pair_scores, visible_values, value_dim, visible, value_dim);
      }
      for (; g < group; ++g) {
        float* state = state_of(g);
        kernels.scores(query_of(g), visible_keys, key_dim, visible, key_dim, batch.scale, scores);
        fold(scores, state);
        kernels.accumulate(state + kStateAccumulator, scores, visible_values, value_dim, visible,
                           value_dim);
      }
    }
    first += count;
  }
}

// Query rows [first_row, first_row + count) of `kv_head`'s group, one after another into
// `queries`: row r = i * group + g is query i's head kv_head * group + g.
void GatherQueryRows(const PagedDecodeBatch& batch, const PagedDecodeSequence& sequence,
                     int64_t kv_head, int64_t first_row, int64_t count, float* queries) {
  const int64_t key_dim = batch.layout.key_dim;
  const int64_t group = batch.num_heads / batch.layout.num_kv_heads;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t i = (first_row + r) / group, g = (first_row + r) % group;
    std::copy_n(sequence.query + (i * batch.num_heads + kv_head * group + g) * key_dim, key_dim,
                queries + r * key_dim);
  }
}

// `count` rows of `keys` scores exponentiated in place (less their max), each row's max and
// sum of exps into its state.
void ExpScoresIntoStates(const RowKernels& kernels, float* scores, int64_t count, int64_t keys,
                         float* states, int64_t state_floats) {
  for (int64_t r = 0; r < count; ++r) {
    float* row_scores = scores + r * keys;
    float* state = states + r * state_floats;
    state[kStateMax] = kernels.max(row_scores, keys);
    state[kStateSum] = kernels.exp_and_sum(row_scores, keys, state[kStateMax]);
  }
}

// A split every row of `sequence` sees whole (a shared prefix's), as the matrix products it
// is once many rows read it: the split's keys and values of `kv_head` packed from their
// blocks into panels (bfloat16 widened), S = scale * Q K^T and the unnormalized P V on
// `level`'s GEMM microkernel, the softmax between them on the row kernels. Writes one state
// per row to `states` as AttendSplit does, within FlashAttention's rule of it (not bitwise).
void AttendWholeSplitAsGemm(const RowKernels& kernels, SimdLevel level,
                            const PagedDecodeBatch& batch, const PagedDecodeSequence& sequence,
                            int64_t kv_head, int64_t key_begin, int64_t key_end, float* states) {
  const KvLayout& layout = batch.layout;
  const int64_t key_dim = layout.key_dim, value_dim = layout.value_dim;
  const int64_t group = batch.num_heads / layout.num_kv_heads;
  const int64_t n = sequence.num_queries, rows = n * group, keys = key_end - key_begin;
  const int64_t element_bytes = layout.ElementBytes();
  thread_local std::vector<float> scratch;
  constexpr int64_t kChunk = kPanelWidth;  // keys gathered at a time: one panel of K^T
  // Query rows a pass takes: its scores (1 MiB at 1,024 keys) stay in L2/L3, and scratch is
  // bounded whatever the group.
  constexpr int64_t kRowBlock = 256;
  const int64_t block_rows = std::min(rows, kRowBlock);
  scratch.resize(PanelFloats(key_dim, keys) + PanelFloats(keys, value_dim) + kChunk * key_dim +
                 block_rows * (key_dim + keys));
  float* key_panels = scratch.data();
  float* value_panels = key_panels + PanelFloats(key_dim, keys);
  float* chunk_keys = value_panels + PanelFloats(keys, value_dim);
  float* queries = chunk_keys + kChunk * key_dim;
  float* scores = queries + block_rows * key_dim;
  const bool bfloat16 = layout.dtype == DType::kBFloat16;
  float widened[kPanelWidth];
  for (int64_t key = key_begin; key < key_end; ++key) {
    const int64_t index = key - key_begin;
    const KvRows at = KvRowsAt(batch, sequence, kv_head, key);
    const char* key_bytes = at.keys;
    const char* value_bytes = at.values;
    float* key_row = chunk_keys + (index % kChunk) * key_dim;
    if (bfloat16) {
      kernels.widen_bfloat16(reinterpret_cast<const uint16_t*>(key_bytes), key_dim, key_row);
    } else {
      std::memcpy(key_row, key_bytes, key_dim * sizeof(float));
    }
    // The value row into each panel of V's columns.
    for (int64_t column = 0; column < value_dim; column += kPanelWidth) {
      const int64_t width = std::min(kPanelWidth, value_dim - column);
      float* row = value_panels + (column * keys + index * kPanelWidth);
      const char* source = value_bytes + column * element_bytes;
      if (bfloat16) {
        kernels.widen_bfloat16(reinterpret_cast<const uint16_t*>(source), width, widened);
        source = reinterpret_cast<const char*>(widened);
      }
      std::memcpy(row, source, width * sizeof(float));
      std::fill(row + width, row + kPanelWidth, 0.0f);
    }
    if (index % kChunk == kChunk - 1 || key + 1 == key_end) {
      const int64_t first = index / kChunk * kChunk;
      PackTransposed(chunk_keys, index - first + 1, key_dim, key_dim, key_panels + first * key_dim,
                     level);
    }
  }
  const int64_t state_floats = StateFloats(layout);
  for (int64_t first_row = 0; first_row < rows; first_row += block_rows) {
    const int64_t count = std::min(block_rows, rows - first_row);
    GatherQueryRows(batch, sequence, kv_head, first_row, count, queries);
    GemmPanels(level, queries, key_dim, count, key_panels, key_dim, keys, 0, PanelCount(keys),
               batch.scale, nullptr, scores, keys);
    float* block_states = states + first_row * state_floats;
    ExpScoresIntoStates(kernels, scores, count, keys, block_states, state_floats);
    GemmPanels(level, scores, keys, count, value_panels, keys, value_dim, 0, PanelCount(value_dim),
               1.0f, nullptr, block_states + kStateAccumulator, state_floats);
  }
}

// The same split in bf16 products, for bf16 KV where those are the host's faster products
// (FastestBf16Products: AMX tiles, AVX512-BF16): the keys and values stay bf16, gathered
// from their blocks and packed into bf16 panels; the query rows and the exps are rounded to
// bf16 as a BFLOAT16 layer's attention rounds them, and the softmax stays in float32.
// Within the bf16 rule of AttendSplit.
void AttendWholeSplitAsBf16Gemm(const RowKernels& kernels, Bf16Kernel kernel,
                                const PagedDecodeBatch& batch, const PagedDecodeSequence& sequence,
                                int64_t kv_head, int64_t key_begin, int64_t key_end,
                                float* states) {
  const KvLayout& layout = batch.layout;
  const int64_t key_dim = layout.key_dim, value_dim = layout.value_dim;
  const int64_t group = batch.num_heads / layout.num_kv_heads;
  const int64_t rows = sequence.num_queries * group, keys = key_end - key_begin;
  constexpr int64_t kRowBlock = 256;  // as AttendWholeSplitAsGemm's passes
  const int64_t block_rows = std::min(rows, kRowBlock);
  thread_local std::vector<uint16_t> bf16_scratch;
  thread_local std::vector<float> float_scratch;
  bf16_scratch.resize(keys * (key_dim + value_dim) + Bf16PanelElements(key_dim, keys) +
                      Bf16PanelElements(keys, value_dim) + block_rows * (key_dim + keys));
  uint16_t* gathered_keys = bf16_scratch.data();               // [keys][dk]
  uint16_t* gathered_values = gathered_keys + keys * key_dim;  // [keys][dv]
  uint16_t* key_panels = gathered_values + keys * value_dim;
  uint16_t* value_panels = key_panels + Bf16PanelElements(key_dim, keys);
  uint16_t* rounded_queries = value_panels + Bf16PanelElements(keys, value_dim);
  uint16_t* rounded_exps = rounded_queries + block_rows * key_dim;
  float_scratch.resize(block_rows * (key_dim + keys));
  float* queries = float_scratch.data();
  float* scores = queries + block_rows * key_dim;
  // A head's rows run on to the end of their block: one copy per block.
  for (int64_t key = key_begin; key < key_end;) {
    const KvRows at = KvRowsAt(batch, sequence, kv_head, key);
    const int64_t run =
        std::min(key_end - key, batch.tokens_per_block - key % batch.tokens_per_block);
    std::memcpy(gathered_keys + (key - key_begin) * key_dim, at.keys,
                run * key_dim * sizeof(uint16_t));
    std::memcpy(gathered_values + (key - key_begin) * value_dim, at.values,
                run * value_dim * sizeof(uint16_t));
    key += run;
  }
  PackBf16Panels(gathered_keys, key_dim, keys, /*depth_stride=*/1, /*column_stride=*/key_dim,
                 key_panels, kernel);
  PackBf16Panels(gathered_values, keys, value_dim, /*depth_stride=*/value_dim,
                 /*column_stride=*/1, value_panels, kernel);
  const int64_t state_floats = StateFloats(layout);
  for (int64_t first_row = 0; first_row < rows; first_row += block_rows) {
    const int64_t count = std::min(block_rows, rows - first_row);
    GatherQueryRows(batch, sequence, kv_head, first_row, count, queries);
    RoundToBf16(queries, count * key_dim, rounded_queries, kernel);
    GemmBf16Panels(kernel, rounded_queries, key_dim, count, key_panels, key_dim, keys, 0,
                   PanelCount(keys), batch.scale, nullptr, scores, keys);
    float* block_states = states + first_row * state_floats;
    ExpScoresIntoStates(kernels, scores, count, keys, block_states, state_floats);
    RoundToBf16(scores, count * keys, rounded_exps, kernel);
    GemmBf16Panels(kernel, rounded_exps, keys, count, value_panels, keys, value_dim, 0,
                   PanelCount(value_dim), 1.0f, nullptr, block_states + kStateAccumulator,
                   state_floats);
  }
}

// The splits of one (sequence, KV head): states [split][row][state], merged in split order.
struct HeadWork {
  int64_t sequence, kv_head, num_splits, states_offset;
};

void MergeSplits(const PagedDecodeBatch& batch, const HeadWork& work, const float* states) {
  const PagedDecodeSequence& sequence = batch.sequences[work.sequence];
  const int64_t value_dim = batch.layout.value_dim, state_floats = StateFloats(batch.layout);
  const int64_t group = batch.num_heads / batch.layout.num_kv_heads;
  const int64_t rows = sequence.num_queries * group;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = work.kv_head * group + r % group;
    const int64_t out_index = (r / group) * batch.num_heads + head;
    float max = kNegativeInfinity;
    for (int64_t s = 0; s < work.num_splits; ++s) {
      const float* state = states + (s * rows + r) * state_floats;
      if (state[kStateSum] != 0.0f) max = std::max(max, state[kStateMax]);  // 0: saw no key
    }
    float* out = sequence.output + out_index * value_dim;
    std::fill_n(out, value_dim, 0.0f);
    float sum = 0.0f;
    for (int64_t s = 0; s < work.num_splits; ++s) {
      const float* state = states + (s * rows + r) * state_floats;
      if (state[kStateSum] == 0.0f) continue;
      const float weight = std::exp(state[kStateMax] - max);
      sum += state[kStateSum] * weight;
      for (int64_t c = 0; c < value_dim; ++c) out[c] += state[kStateAccumulator + c] * weight;
    }
    for (int64_t c = 0; c < value_dim; ++c) out[c] /= sum;
    if (sequence.log_sum_exp != nullptr) sequence.log_sum_exp[out_index] = max + std::log(sum);
  }
}

// A group of forks' query rows as one sequence for the splits they share: every member's
// queries in group order, placed so that each sees every shared key. A split over these
// rows computes each row as the member's own split would (rows are independent and the
// tiles the same), so the results do not depend on whether a sequence was grouped.
struct SharedPrefix {
  SharedPrefix(const PagedDecodeBatch& batch, SharedPrefixGroup group) : found(std::move(group)) {
    const int64_t row_floats = batch.num_heads * batch.layout.key_dim;
    for (const int64_t b : found.sequences) {
      const PagedDecodeSequence& member = batch.sequences[b];
      queries.insert(queries.end(), member.query, member.query + member.num_queries * row_floats);
      rows.num_queries += member.num_queries;
    }
    rows.block_table = batch.sequences[found.sequences.front()].block_table;
    rows.query = queries.data();
    rows.length = found.shared_keys - 1 + rows.num_queries;  // the first row sits at key S - 1
  }
  SharedPrefixGroup found;
  std::vector<float> queries;
  PagedDecodeSequence rows;
};

}  // namespace

absl::Status PagedDecodeCpu(const PagedDecodeBatch& batch, ThreadPool& pool, SimdLevel level,
                            SharedPrefixes shared_prefixes,
                            std::optional<Bf16Kernel> bf16_products) {
  if (absl::Status status = ValidatePagedDecodeBatch(batch, /*check_block_ids=*/true);
      !status.ok()) {
    return status;
  }
  if (!CpuSupports(level)) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged decode: this CPU cannot run ", SimdLevelName(level)));
  }
  if (bf16_products.has_value() && !CpuSupports(*bf16_products)) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged decode: this CPU cannot run ", Bf16KernelName(*bf16_products)));
  }
  const RowKernels kernels = Kernels(level);
#if defined(__x86_64__)
  const bool avx512 = level == SimdLevel::kAvx512 && paged_decode::CpuSupportsAvx512Bw();
#endif
  const int64_t group = batch.num_heads / batch.layout.num_kv_heads;
  const int64_t num_kv_heads = batch.layout.num_kv_heads;
  const int64_t state_floats = StateFloats(batch.layout);
  // Forks of one prefix: each of its splits is attended once for every query row of the
  // group (SharedPrefix below), so each sequence starts its own splits after it.
  std::vector<SharedPrefix> shared;
  std::vector<int64_t> own_keys_from(batch.sequences.size(), 0);
  if (shared_prefixes != SharedPrefixes::kReadPerFork) {
    for (SharedPrefixGroup& found : FindSharedPrefixes(batch, kPagedSplitKeys)) {
      for (const int64_t b : found.sequences) own_keys_from[b] = found.shared_keys;
      if (batch.stats != nullptr) {
        batch.stats->shared_blocks +=
            (found.shared_keys + batch.tokens_per_block - 1) / batch.tokens_per_block;
        batch.stats->keys_not_reread +=
            found.shared_keys * static_cast<int64_t>(found.sequences.size() - 1);
      }
      shared.push_back(SharedPrefix(batch, std::move(found)));
    }
  }
  // Units of work: (sequence, KV head, split of kPagedSplitKeys keys), in that order.
  std::vector<HeadWork> heads;
  struct Split {
    int64_t head_work, key_begin, key_end;
  };
  std::vector<Split> splits;
  int64_t state_total = 0;
  for (size_t b = 0; b < batch.sequences.size(); ++b) {
    const PagedDecodeSequence& sequence = batch.sequences[b];
    const int64_t num_splits = (sequence.length + kPagedSplitKeys - 1) / kPagedSplitKeys;
    const int64_t rows = sequence.num_queries * group;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      heads.push_back({static_cast<int64_t>(b), h, num_splits, state_total});
      // Splits wholly before the first query's window are not run; their states stay empty
      // (a sum of 0 is skipped by the merge).
      const int64_t first_split =
          std::max(FirstVisibleKey(batch, sequence.length - sequence.num_queries),
                   own_keys_from[b]) /
          kPagedSplitKeys;
      for (int64_t s = first_split; s < num_splits; ++s) {
        splits.push_back({static_cast<int64_t>(heads.size()) - 1, s * kPagedSplitKeys,
                          std::min(sequence.length, (s + 1) * kPagedSplitKeys)});
      }
      state_total += num_splits * rows * state_floats;
    }
  }
  // The shared units: (group, KV head, split), run first as the largest.
  struct SharedSplit {
    int64_t group, kv_head, key_begin;
  };
  std::vector<SharedSplit> shared_splits;
  for (size_t g = 0; g < shared.size(); ++g) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t key = 0; key < shared[g].found.shared_keys; key += kPagedSplitKeys) {
        shared_splits.push_back({static_cast<int64_t>(g), h, key});
      }
    }
  }
  std::vector<float> states(state_total);
  // One split of `sequence` (a batch sequence, or a group's rows) into `split_states`.
  const auto attend_split = [&](const PagedDecodeSequence& sequence, int64_t kv_head,
                                int64_t key_begin, int64_t key_end, float* split_states) {
#if defined(__x86_64__)
    if (avx512) {
      paged_decode::AttendSplitAvx512(batch, sequence, kv_head, key_begin, key_end, split_states);
      return;
    }
#endif
    AttendSplit(kernels, batch, sequence, kv_head, key_begin, key_end, split_states);
  };
  const int64_t num_shared = static_cast<int64_t>(shared_splits.size());
  pool.ParallelFor(num_shared + static_cast<int64_t>(splits.size()), [&](int64_t index) {
    if (index < num_shared) {
      const SharedSplit& unit = shared_splits[index];
      const SharedPrefix& prefix = shared[unit.group];
      thread_local std::vector<float> group_states;
      group_states.resize(prefix.rows.num_queries * group * state_floats);
      const bool as_products = shared_prefixes == SharedPrefixes::kAsProducts &&
                               prefix.rows.num_queries * group >= kSharedPrefixGemmRows;
      if (as_products && bf16_products.has_value() && batch.layout.dtype == DType::kBFloat16) {
        AttendWholeSplitAsBf16Gemm(kernels, *bf16_products, batch, prefix.rows, unit.kv_head,
                                   unit.key_begin, unit.key_begin + kPagedSplitKeys,
                                   group_states.data());
      } else if (as_products) {
        AttendWholeSplitAsGemm(kernels, level, batch, prefix.rows, unit.kv_head, unit.key_begin,
                               unit.key_begin + kPagedSplitKeys, group_states.data());
      } else {
        attend_split(prefix.rows, unit.kv_head, unit.key_begin, unit.key_begin + kPagedSplitKeys,
                     group_states.data());
      }
      // Each member's rows, into its own states of this split.
      const int64_t split_index = unit.key_begin / kPagedSplitKeys;
      const float* member_states = group_states.data();
      for (const int64_t b : prefix.found.sequences) {
        const HeadWork& work = heads[b * num_kv_heads + unit.kv_head];
        const int64_t rows = batch.sequences[b].num_queries * group;
        std::copy_n(member_states, rows * state_floats,
                    states.data() + work.states_offset + split_index * rows * state_floats);
        member_states += rows * state_floats;
      }
      return;
    }
    const Split& split = splits[index - num_shared];
    const HeadWork& work = heads[split.head_work];
    const PagedDecodeSequence& sequence = batch.sequences[work.sequence];
    const int64_t rows = sequence.num_queries * group;
    const int64_t split_index = split.key_begin / kPagedSplitKeys;
    attend_split(sequence, work.kv_head, split.key_begin, split.key_end,
                 states.data() + work.states_offset + split_index * rows * state_floats);
  });
  pool.ParallelFor(static_cast<int64_t>(heads.size()), [&](int64_t index) {
    MergeSplits(batch, heads[index], states.data() + heads[index].states_offset);
  });
  return absl::OkStatus();
}

}  // namespace attention::core

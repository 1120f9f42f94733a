// The paged decode kernel's AVX-512 split (paged_decode_split.h): chunks of 64 keys, scored
// 16 at a time (one score per lane) and each key and value row read from memory once for a
// block of up to 4 query rows of the group.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/cpu/exp_poly.h"
#include "core/cpu/paged_decode_split.h"
#if defined(__x86_64__)
#include <immintrin.h>

namespace attention::core::paged_decode {
namespace {

using kv_cache::KvLayout;

// (GCC 12 takes the reductions' and masked loads' undefined pass-through operands for
// uninitialised reads.)
#pragma GCC diagnostic push
#if !defined(__clang__)  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#define PAGED_AVX512 __attribute__((target("avx512f,avx512bw")))
#define PAGED_AVX512_INLINE __attribute__((target("avx512f,avx512bw"), always_inline)) inline

constexpr int kLanes = 16;
// Keys per chunk: all their scores, then all their values, so each streams in a long run.
constexpr int64_t kChunkKeys = 64;
// Each load prefetches two lines: the same line of the row kPrefetchRows ahead in the order
// keys and values are read in, to L1 (T0), and of the row a chunk ahead (the next chunk's
// key or value at the same index), to L2 (T1). The far one keeps more DRAM reads in flight
// than L1's miss buffers allow; the near one then finds its line in L2. At 32k f32 this ran
// 0.72-0.74 of the same-memory roof against 0.69-0.73 with T0 alone at 32 rows (alternated,
// 6 rounds; the access pattern without compute reads 0.93-0.95 of it, without prefetching
// the kernel 0.23-0.39). Alone, T0 beat T1 at 4k (L3-resident); T1 alone was no better.
constexpr int64_t kPrefetchRows = 8;
// Value columns per pass over a tile: 4 float32 registers.
constexpr int64_t kValueColumnsPerPass = 64;

PAGED_AVX512_INLINE __mmask16 FirstLanes16(int64_t count) {
  if (count >= 16) return 0xffff;
  return count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}
PAGED_AVX512_INLINE __mmask32 FirstLanes32(int64_t count) {
  if (count >= 32) return 0xffffffffu;
  return count <= 0 ? 0 : (1u << count) - 1;
}

// KV elements per register load, and the float32 registers one load widens to.
template <bool kBFloat16>
struct KvChunk {
  static constexpr int64_t kElements = kBFloat16 ? 32 : 16;
  static constexpr int kRegisters = kBFloat16 ? 2 : 1;
};

// Elements [column, column + kElements) of a KV row (zero past `dim`) as float32: a
// bfloat16 load widens to its even elements, then its odd ones (a shift and a mask, since
// bfloat16 is float32's upper half), so queries and accumulators are kept in that order.
template <bool kBFloat16>
struct KvChunkMask {
  using Type = std::conditional_t<kBFloat16, __mmask32, __mmask16>;
};
template <bool kBFloat16>
PAGED_AVX512_INLINE typename KvChunkMask<kBFloat16>::Type ChunkMask(int64_t column, int64_t dim) {
  if constexpr (kBFloat16) {
    return FirstLanes32(dim - column);
  } else {
    return FirstLanes16(dim - column);
  }
}
template <bool kBFloat16>
PAGED_AVX512_INLINE void LoadKvChunk(const char* row, int64_t column,
                                     typename KvChunkMask<kBFloat16>::Type mask, __m512* out) {
  if constexpr (kBFloat16) {
    const __m512i raw = _mm512_maskz_loadu_epi16(mask, row + 2 * column);
    out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    out[1] = _mm512_castsi512_ps(
        _mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
  } else {
    out[0] = _mm512_maskz_loadu_ps(mask, row + 4 * column);
  }
}

// Where column c of a KV row sits in the widened order of LoadKvChunk.
template <bool kBFloat16>
int64_t WidenedColumn(int64_t c) {
  if constexpr (kBFloat16) {
    const int64_t within = c % 32;
    return c - within + (within % 2) * 16 + within / 2;
  } else {
    return c;
  }
}

// Lane i = the horizontal sum of in[i]: a transpose-add tree (45 instructions for 16 sums,
// where 16 separate reductions take 16 dependent shuffle chains).
PAGED_AVX512_INLINE __m512 HorizontalSums16(const __m512* in) {
  __m512 pairs[8];  // per 128-bit lane: in[2k] in positions 0 and 2, in[2k + 1] in 1 and 3
  for (int k = 0; k < 8; ++k) {
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(in[2 * k], in[2 * k + 1]),
                             _mm512_unpackhi_ps(in[2 * k], in[2 * k + 1]));
  }
  __m512 quads[4];  // per 128-bit lane: partial sums of in[4m .. 4m + 3]
  for (int m = 0; m < 4; ++m) {
    const __m512d a = _mm512_castps_pd(pairs[2 * m]), b = _mm512_castps_pd(pairs[2 * m + 1]);
    quads[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xee));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                       _mm512_shuffle_f32x4(low, high, 0xdd));
}

// exp(x) for x <= 0 as ExpOfNonPositive (exp_poly.h), 16 lanes; a NaN stays NaN.
PAGED_AVX512_INLINE __m512 ExpOfNonPositiveAvx512(__m512 x) {
  constexpr float kRoundShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(kExpLowest), x);  // NaN: the 2nd operand
  const __m512 shifted =
      _mm512_fmadd_ps(clamped, _mm512_set1_ps(kLog2e), _mm512_set1_ps(kRoundShift));
  const __m512 n = _mm512_sub_ps(shifted, _mm512_set1_ps(kRoundShift));
  const __m512 f = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Low),
                                   _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2High), clamped));
  __m512 p = _mm512_set1_ps(kExpCoefficients[0]);
  for (int c = 1; c < kExpTerms; ++c)
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpCoefficients[c]));
  const __m512i exponent = _mm512_slli_epi32(
      _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_set1_epi32(0x4B400000 - 127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

// scores[r] lane j = query row r . key j for kRows rows (`query_stride` floats apart, in
// widened order, zero-padded) and 16 keys. Each key chunk is loaded once for all rows; the
// 16 (row, key) dot-product registers of 16 / kRows keys reduce in one tree. kPrefetch:
// each load of key k's line prefetches the same line of prefetch_rows[k] (to L1) and of
// far_rows[k] (to L2).
template <int kRows, bool kBFloat16, bool kPrefetch>
PAGED_AVX512_INLINE void ScoreTile(const float* queries, int64_t query_stride,
                                   const char* const* keys, int64_t dim,
                                   const char* const* prefetch_rows, const char* const* far_rows,
                                   __m512* scores) {
  using Chunk = KvChunk<kBFloat16>;
  constexpr int kKeysPerTree = kLanes / kRows;
  __m512 trees[kRows];  // lane r * kKeysPerTree + k: row r, key t * kKeysPerTree + k
  for (int t = 0; t < kRows; ++t) {
    __m512 dots[kLanes];
    for (__m512& dot : dots) dot = _mm512_setzero_ps();
    for (int64_t c = 0; c < dim; c += Chunk::kElements) {
      const auto mask = ChunkMask<kBFloat16>(c, dim);
#pragma GCC unroll 16
      for (int k = 0; k < kKeysPerTree; ++k) {
        __m512 key[Chunk::kRegisters];
        LoadKvChunk<kBFloat16>(keys[t * kKeysPerTree + k], c, mask, key);
        if constexpr (kPrefetch) {
          __builtin_prefetch(prefetch_rows[t * kKeysPerTree + k] + c * (kBFloat16 ? 2 : 4), 0, 3);
          __builtin_prefetch(far_rows[t * kKeysPerTree + k] + c * (kBFloat16 ? 2 : 4), 0, 2);
        }
#pragma GCC unroll 4
        for (int r = 0; r < kRows; ++r) {
          for (int v = 0; v < Chunk::kRegisters; ++v) {
            const __m512 query = _mm512_loadu_ps(queries + r * query_stride + c + 16 * v);
            dots[r * kKeysPerTree + k] = _mm512_fmadd_ps(query, key[v], dots[r * kKeysPerTree + k]);
          }
        }
      }
    }
    trees[t] = HorizontalSums16(dots);
  }
  if constexpr (kRows == 1) {
    scores[0] = trees[0];
  } else if constexpr (kRows == 2) {  // 256-bit halves: row 0's, then row 1's
    scores[0] = _mm512_shuffle_f32x4(trees[0], trees[1], 0x44);
    scores[1] = _mm512_shuffle_f32x4(trees[0], trees[1], 0xee);
  } else {  // 128-bit quarters: a 4 x 4 transpose
    static_assert(kRows == 4, "tiles take 1, 2 or 4 rows");
    const __m512 t0 = _mm512_shuffle_f32x4(trees[0], trees[1], 0x44);
    const __m512 t1 = _mm512_shuffle_f32x4(trees[0], trees[1], 0xee);
    const __m512 t2 = _mm512_shuffle_f32x4(trees[2], trees[3], 0x44);
    const __m512 t3 = _mm512_shuffle_f32x4(trees[2], trees[3], 0xee);
    scores[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
    scores[1] = _mm512_shuffle_f32x4(t0, t2, 0xdd);
    scores[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
    scores[3] = _mm512_shuffle_f32x4(t1, t3, 0xdd);
  }
}

// Row r's accumulators (`accumulator_stride` floats apart, widened order) = themselves *
// corrections[r] + the sum over keys j in [lo, hi) of weights[r * kChunkKeys + j] * value
// j. Each value chunk is loaded once for all rows. kPrefetch: each load of value j's line
// prefetches the same line of prefetch_rows[j] (to L1) and of far_rows[j] (to L2).
template <int kRows, bool kBFloat16, bool kPrefetch>
PAGED_AVX512_INLINE void AccumulateChunk(float* accumulators, int64_t accumulator_stride,
                                         const float* corrections, const float* weights,
                                         const char* const* values, int64_t lo, int64_t hi,
                                         int64_t dim, const char* const* prefetch_rows,
                                         const char* const* far_rows) {
  using Chunk = KvChunk<kBFloat16>;
  constexpr int kLoads = 4 / Chunk::kRegisters;
  for (int64_t c = 0; c < dim; c += kValueColumnsPerPass) {
    __m512 acc[kRows][4];
    for (int r = 0; r < kRows; ++r) {
      const __m512 correction = _mm512_set1_ps(corrections[r]);
      for (int v = 0; v < 4; ++v) {
        acc[r][v] = _mm512_mul_ps(
            _mm512_loadu_ps(accumulators + r * accumulator_stride + c + 16 * v), correction);
      }
    }
    typename KvChunkMask<kBFloat16>::Type masks[kLoads];  // the pass's columns, past `dim` zero
    for (int l = 0; l < kLoads; ++l) masks[l] = ChunkMask<kBFloat16>(c + l * Chunk::kElements, dim);
    for (int64_t j = lo; j < hi; ++j) {
      __m512 value[4];
      for (int l = 0; l < kLoads; ++l) {
        LoadKvChunk<kBFloat16>(values[j], c + l * Chunk::kElements, masks[l],
                               value + l * Chunk::kRegisters);
        if constexpr (kPrefetch) {
          __builtin_prefetch(prefetch_rows[j] + (c + l * Chunk::kElements) * (kBFloat16 ? 2 : 4), 0,
                             3);
          __builtin_prefetch(far_rows[j] + (c + l * Chunk::kElements) * (kBFloat16 ? 2 : 4), 0, 2);
        }
      }
      for (int r = 0; r < kRows; ++r) {
        const __m512 weight = _mm512_set1_ps(weights[r * kChunkKeys + j]);
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(weight, value[v], acc[r][v]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < 4; ++v) {
        _mm512_storeu_ps(accumulators + r * accumulator_stride + c + 16 * v, acc[r][v]);
      }
    }
  }
}

// The running softmax of one split: per row, its max, its sum of exps, and its weighted
// values (widened order, padded to whole passes), and the queries in widened order.
struct SplitRows {
  float* queries;
  int64_t query_stride;
  float* accumulators;
  int64_t accumulator_stride;
  float* maxima;
  float* sums;
};

// Rows [row, row + kRows) (one query's) over a chunk of `count` keys, of which they see [lo,
// hi): every key's score first, then one online-softmax rescale per row, then the weighted
// values, so that the keys and then the values stream from memory in long runs.
template <int kRows, bool kBFloat16, bool kPrefetch>
PAGED_AVX512_INLINE void AttendChunkRows(const SplitRows& split, int64_t row, float scale,
                                         const char* const* stream, int64_t lo, int64_t hi,
                                         int64_t key_dim, int64_t value_dim) {
  const char* const* keys = stream;
  const char* const* values = stream + kChunkKeys;
  constexpr int kTiles = kChunkKeys / kLanes;
  const int64_t tiles = (hi + kLanes - 1) / kLanes;
  __m512 scores[kTiles][kRows];
  for (int64_t t = lo / kLanes; t < tiles; ++t) {
    ScoreTile<kRows, kBFloat16, kPrefetch>(
        split.queries + row * split.query_stride, split.query_stride, keys + t * kLanes, key_dim,
        keys + kPrefetchRows + t * kLanes, keys + 2 * kChunkKeys + t * kLanes, scores[t]);
  }
  alignas(64) float weights[kRows * kChunkKeys];
  float corrections[kRows];
  const __m512 scale_vector = _mm512_set1_ps(scale);
  for (int r = 0; r < kRows; ++r) {
    __m512 tile_max = _mm512_set1_ps(kNegativeInfinity);
    for (int64_t t = lo / kLanes; t < tiles; ++t) {
      const __mmask16 visible =
          FirstLanes16(hi - t * kLanes) & static_cast<__mmask16>(~FirstLanes16(lo - t * kLanes));
      scores[t][r] = _mm512_mask_mul_ps(_mm512_set1_ps(kNegativeInfinity), visible, scores[t][r],
                                        scale_vector);
      tile_max = _mm512_max_ps(tile_max, scores[t][r]);
    }
    float& max = split.maxima[row + r];
    const float new_max = std::max(max, _mm512_reduce_max_ps(tile_max));
    corrections[r] = ExpOfNonPositive(max - new_max);  // 0 at first
    const __m512 shift = _mm512_set1_ps(new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = lo / kLanes; t < tiles; ++t) {
      const __mmask16 visible =
          FirstLanes16(hi - t * kLanes) & static_cast<__mmask16>(~FirstLanes16(lo - t * kLanes));
      const __m512 exps =
          _mm512_maskz_mov_ps(visible, ExpOfNonPositiveAvx512(_mm512_sub_ps(scores[t][r], shift)));
      sum = _mm512_add_ps(sum, exps);
      _mm512_store_ps(weights + r * kChunkKeys + t * kLanes, exps);
    }
    split.sums[row + r] = split.sums[row + r] * corrections[r] + _mm512_reduce_add_ps(sum);
    max = new_max;
  }
  AccumulateChunk<kRows, kBFloat16, kPrefetch>(
      split.accumulators + row * split.accumulator_stride, split.accumulator_stride, corrections,
      weights, values, lo, hi, value_dim, values + kPrefetchRows, values + 2 * kChunkKeys);
}

// Rows [row, row + 4, 2 or 1) of the `left` rows of one query's group; returns how many.
template <bool kBFloat16, bool kPrefetch>
PAGED_AVX512_INLINE int64_t AttendChunkRowBlock(const SplitRows& split, int64_t row, int64_t left,
                                                float scale, const char* const* stream, int64_t lo,
                                                int64_t hi, int64_t key_dim, int64_t value_dim) {
  if (left >= 4) {
    AttendChunkRows<4, kBFloat16, kPrefetch>(split, row, scale, stream, lo, hi, key_dim, value_dim);
    return 4;
  }
  if (left >= 2) {
    AttendChunkRows<2, kBFloat16, kPrefetch>(split, row, scale, stream, lo, hi, key_dim, value_dim);
    return 2;
  }
  AttendChunkRows<1, kBFloat16, kPrefetch>(split, row, scale, stream, lo, hi, key_dim, value_dim);
  return 1;
}

// AttendSplitAvx512 for float32 or bfloat16 KV.
template <bool kBFloat16>
PAGED_AVX512 void AttendSplitAvx512Of(const PagedDecodeBatch& batch,
                                      const PagedDecodeSequence& sequence, int64_t kv_head,
                                      int64_t key_begin, int64_t key_end, float* states) {
  using Chunk = KvChunk<kBFloat16>;
  const KvLayout& layout = batch.layout;
  const int64_t key_dim = layout.key_dim, value_dim = layout.value_dim;
  const int64_t group = batch.num_heads / layout.num_kv_heads;
  const int64_t n = sequence.num_queries, rows = n * group;
  const int64_t tokens_per_block = batch.tokens_per_block;
  const int64_t element_bytes = layout.ElementBytes();

  SplitRows split;
  split.query_stride = (key_dim + Chunk::kElements - 1) / Chunk::kElements * Chunk::kElements;
  split.accumulator_stride =
      (value_dim + kValueColumnsPerPass - 1) / kValueColumnsPerPass * kValueColumnsPerPass;
  thread_local std::vector<float> scratch;
  scratch.assign(rows * (split.query_stride + split.accumulator_stride + 2), 0.0f);
  split.queries = scratch.data();
  split.accumulators = split.queries + rows * split.query_stride;
  split.maxima = split.accumulators + rows * split.accumulator_stride;
  split.sums = split.maxima + rows;
  std::fill_n(split.maxima, rows, kNegativeInfinity);
  for (int64_t r = 0; r < rows; ++r) {  // row r = i * group + g: query i, head kv_head * group + g
    const float* query =
        sequence.query + ((r / group) * batch.num_heads + kv_head * group + r % group) * key_dim;
    for (int64_t c = 0; c < key_dim; ++c) {
      split.queries[r * split.query_stride + WidenedColumn<kBFloat16>(c)] = query[c];
    }
  }

  // Keys before the window of the first query are seen by none.
  const int64_t start = std::max(key_begin, FirstVisibleKey(batch, sequence.length - n));
  int64_t block_index = start / tokens_per_block, slot = start % tokens_per_block;
  // The rows of the chunk from `first`; lanes past `key_end` repeat its last key.
  const auto chunk_rows = [&](int64_t first, const char** keys, const char** values) {
    const int64_t count = std::min<int64_t>(kChunkKeys, key_end - first);
    for (int64_t j = 0; j < count; ++j) {  // a chunk may cross blocks
      const char* block = static_cast<const char*>(batch.storage.data) +
                          sequence.block_table[block_index] * batch.storage.block_bytes;
      keys[j] =
          block + kv_cache::KeyOffset(layout, tokens_per_block, slot, kv_head) * element_bytes;
      values[j] =
          block + kv_cache::ValueOffset(layout, tokens_per_block, slot, kv_head) * element_bytes;
      if (++slot == tokens_per_block) slot = 0, ++block_index;
    }
    for (int64_t j = count; j < kChunkKeys; ++j)
      keys[j] = keys[count - 1], values[j] = values[count - 1];
  };
  // The rows in the order they are read: this chunk's keys and values, then the next's.
  const char* stream[4 * kChunkKeys];
  if (start < key_end) chunk_rows(start, stream, stream + kChunkKeys);
  for (int64_t first = start; first < key_end; first += kChunkKeys) {
    const int64_t count = std::min<int64_t>(kChunkKeys, key_end - first);
    if (first + count < key_end) {
      chunk_rows(first + count, stream + 2 * kChunkKeys, stream + 3 * kChunkKeys);
    } else {  // the last chunk prefetches itself, harmlessly
      std::copy_n(stream, 2 * kChunkKeys, stream + 2 * kChunkKeys);
    }
    bool prefetched = false;
    for (int64_t i = 0; i < n; ++i) {
      // Bottom-right causal: query i sits at position L - n + i and sees [lo, hi) of the chunk.
      const int64_t position = sequence.length - n + i;
      const int64_t lo = std::max<int64_t>(0, FirstVisibleKey(batch, position) - first);
      const int64_t hi = std::min(count, position + 1 - first);
      if (hi <= lo) continue;
      for (int64_t g = 0; g < group;) {
        // The first row block of a chunk prefetches; the others find the bytes in cache.
        g += prefetched ? AttendChunkRowBlock<kBFloat16, false>(split, i * group + g, group - g,
                                                                batch.scale, stream, lo, hi,
                                                                key_dim, value_dim)
                        : AttendChunkRowBlock<kBFloat16, true>(split, i * group + g, group - g,
                                                               batch.scale, stream, lo, hi, key_dim,
                                                               value_dim);
        prefetched = true;
      }
    }
    std::copy_n(stream + 2 * kChunkKeys, 2 * kChunkKeys, stream);
  }

  const int64_t state_floats = StateFloats(layout);
  for (int64_t r = 0; r < rows; ++r) {
    float* state = states + r * state_floats;
    state[kStateMax] = split.maxima[r];
    state[kStateSum] = split.sums[r];
    const float* accumulator = split.accumulators + r * split.accumulator_stride;
    for (int64_t c = 0; c < value_dim; ++c) {
      state[kStateAccumulator + c] = accumulator[WidenedColumn<kBFloat16>(c)];
    }
  }
}

}  // namespace

void AttendSplitAvx512(const PagedDecodeBatch& batch, const PagedDecodeSequence& sequence,
                       int64_t kv_head, int64_t key_begin, int64_t key_end, float* states) {
  (batch.layout.dtype == DType::kBFloat16
       ? AttendSplitAvx512Of<true>
       : AttendSplitAvx512Of<false>)(batch, sequence, kv_head, key_begin, key_end, states);
}

bool CpuSupportsAvx512Bw() {
  static const bool supported =
      CpuSupports(SimdLevel::kAvx512) && __builtin_cpu_supports("avx512bw");
  return supported;
}
#pragma GCC diagnostic pop

}  // namespace attention::core::paged_decode

#endif  // defined(__x86_64__)

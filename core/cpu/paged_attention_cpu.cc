#include "core/cpu/paged_attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cpu/exp_poly.h"
#include "core/cpu/gemm.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace attention::core {
namespace {

using kv_cache::BlockId;
using kv_cache::KvLayout;

// Keys per tile: a tile's float32 keys and values of one head (Llama's 128 + 128 dims: 32
// KiB) stay in L1/L2 while every query row of the group reads them.
constexpr int64_t kTileKeys = 32;
constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

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

struct RowKernels {
  void (*scores)(const float*, const float*, int64_t, int64_t, int64_t, float, float*);
  void (*accumulate)(float*, const float*, const float*, int64_t, int64_t, int64_t);
  float (*max)(const float*, int64_t);
  float (*exp_and_sum)(float*, int64_t, float);
  void (*widen_bfloat16)(const uint16_t*, int64_t, float*);
};

// One copy of the generic kernels per target: the dot products and value sums, and the
// softmax and widening steps (AVX-512 takes only the latter; its others are by hand).
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
#if defined(__x86_64__)
PAGED_ROW_KERNELS(Avx2, __attribute__((target("avx2,fma"))))
PAGED_SOFTMAX_KERNELS(Avx2, __attribute__((target("avx2,fma"))))
PAGED_SOFTMAX_KERNELS(Avx512, __attribute__((target("avx512f,avx2,fma"))))

// (GCC 12 takes the reductions' undefined pass-through operands for uninitialised reads.)
#pragma GCC diagnostic push
#if !defined(__clang__)  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
// AVX-512 dot products and value sums by hand: four keys (or four column registers) at a
// time, so four FMA chains run in parallel; masked loads take the last partial register.
__attribute__((target("avx512f"))) inline __mmask16 ColumnMask(int64_t remaining) {
  if (remaining >= 16) return 0xffff;
  return remaining <= 0 ? 0 : static_cast<__mmask16>((1u << remaining) - 1);
}

__attribute__((target("avx512f"))) void ScoresAvx512(const float* query, const float* keys,
                                                     int64_t key_stride, int64_t count, int64_t dim,
                                                     float scale, float* scores) {
  const int64_t full = dim / 16 * 16;
  const __mmask16 tail = ColumnMask(dim - full);
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const float* k0 = keys + j * key_stride;
    const float* k1 = k0 + key_stride;
    const float* k2 = k1 + key_stride;
    const float* k3 = k2 + key_stride;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t c = 0; c < full; c += 16) {
      const __m512 q = _mm512_loadu_ps(query + c);
      a0 = _mm512_fmadd_ps(q, _mm512_loadu_ps(k0 + c), a0);
      a1 = _mm512_fmadd_ps(q, _mm512_loadu_ps(k1 + c), a1);
      a2 = _mm512_fmadd_ps(q, _mm512_loadu_ps(k2 + c), a2);
      a3 = _mm512_fmadd_ps(q, _mm512_loadu_ps(k3 + c), a3);
    }
    if (tail != 0) {
      const __m512 q = _mm512_maskz_loadu_ps(tail, query + full);
      a0 = _mm512_fmadd_ps(q, _mm512_maskz_loadu_ps(tail, k0 + full), a0);
      a1 = _mm512_fmadd_ps(q, _mm512_maskz_loadu_ps(tail, k1 + full), a1);
      a2 = _mm512_fmadd_ps(q, _mm512_maskz_loadu_ps(tail, k2 + full), a2);
      a3 = _mm512_fmadd_ps(q, _mm512_maskz_loadu_ps(tail, k3 + full), a3);
    }
    scores[j] = _mm512_reduce_add_ps(a0) * scale;
    scores[j + 1] = _mm512_reduce_add_ps(a1) * scale;
    scores[j + 2] = _mm512_reduce_add_ps(a2) * scale;
    scores[j + 3] = _mm512_reduce_add_ps(a3) * scale;
  }
  for (; j < count; ++j) {
    const float* k0 = keys + j * key_stride;
    __m512 a0 = _mm512_setzero_ps();
    for (int64_t c = 0; c < full; c += 16) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(query + c), _mm512_loadu_ps(k0 + c), a0);
    }
    if (tail != 0) {
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, query + full),
                           _mm512_maskz_loadu_ps(tail, k0 + full), a0);
    }
    scores[j] = _mm512_reduce_add_ps(a0) * scale;
  }
}

__attribute__((target("avx512f"))) void AccumulateAvx512(float* acc, const float* weights,
                                                         const float* values, int64_t value_stride,
                                                         int64_t count, int64_t dim) {
  for (int64_t c = 0; c < dim; c += 64) {
    const __mmask16 m0 = ColumnMask(dim - c), m1 = ColumnMask(dim - c - 16),
                    m2 = ColumnMask(dim - c - 32), m3 = ColumnMask(dim - c - 48);
    __m512 a0 = _mm512_maskz_loadu_ps(m0, acc + c), a1 = _mm512_maskz_loadu_ps(m1, acc + c + 16),
           a2 = _mm512_maskz_loadu_ps(m2, acc + c + 32),
           a3 = _mm512_maskz_loadu_ps(m3, acc + c + 48);
    for (int64_t j = 0; j < count; ++j) {
      const __m512 w = _mm512_set1_ps(weights[j]);
      const float* v = values + j * value_stride + c;
      a0 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m0, v), a0);
      a1 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m1, v + 16), a1);
      a2 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m2, v + 32), a2);
      a3 = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m3, v + 48), a3);
    }
    _mm512_mask_storeu_ps(acc + c, m0, a0);
    _mm512_mask_storeu_ps(acc + c + 16, m1, a1);
    _mm512_mask_storeu_ps(acc + c + 32, m2, a2);
    _mm512_mask_storeu_ps(acc + c + 48, m3, a3);
  }
}
#pragma GCC diagnostic pop
#endif

RowKernels Kernels(SimdLevel level) {
#if defined(__x86_64__)
  if (level == SimdLevel::kAvx512) {
    return {ScoresAvx512, AccumulateAvx512, MaxAvx512, ExpAndSumAvx512, WidenBFloat16Avx512};
  }
  if (level == SimdLevel::kAvx2) {
    return {ScoresAvx2, AccumulateAvx2, MaxAvx2, ExpAndSumAvx2, WidenBFloat16Avx2};
  }
#endif
  return {ScoresPortable, AccumulatePortable, MaxPortable, ExpAndSumPortable,
          WidenBFloat16Portable};
}

// A query row's partial softmax over some keys: running max, sum of exp(score - max), and
// the values weighted by those exps.
constexpr int64_t kStateMax = 0, kStateSum = 1, kStateAccumulator = 2;
int64_t StateFloats(const KvLayout& layout) { return layout.value_dim + kStateAccumulator; }

// The first key a query at `position` sees.
int64_t FirstVisibleKey(const PagedDecodeBatch& batch, int64_t position) {
  return batch.sliding_window > 0 ? std::max<int64_t>(0, position - batch.sliding_window + 1) : 0;
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
  scratch.resize(kTileKeys * (key_dim + value_dim + 1));
  float* tile_keys = scratch.data();
  float* tile_values = tile_keys + kTileKeys * key_dim;
  float* scores = tile_values + kTileKeys * value_dim;

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
    const int64_t slot = first % tokens_per_block;
    const char* block = static_cast<const char*>(batch.storage.data) +
                        sequence.block_table[first / tokens_per_block] * batch.storage.block_bytes;
    const int64_t key = kv_cache::KeyOffset(layout, tokens_per_block, slot, kv_head);
    const int64_t value = kv_cache::ValueOffset(layout, tokens_per_block, slot, kv_head);
    return Tile{block + key * element_bytes, block + value * element_bytes,
                std::min({key_end - first, tokens_per_block - slot, kTileKeys})};
  };
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
      for (int64_t g = 0; g < group; ++g) {
        const float* query = sequence.query + (i * batch.num_heads + kv_head * group + g) * key_dim;
        float* state = states + (i * group + g) * state_floats;
        kernels.scores(query, visible_keys, key_dim, visible, key_dim, batch.scale, scores);
        const float new_max = std::max(state[kStateMax], kernels.max(scores, visible));
        const float correction = ExpOfNonPositive(state[kStateMax] - new_max);  // 0 at first
        const float sum = kernels.exp_and_sum(scores, visible, new_max);
        state[kStateMax] = new_max;
        state[kStateSum] = state[kStateSum] * correction + sum;
        if (correction != 1.0f) {
          for (int64_t c = 0; c < value_dim; ++c) state[kStateAccumulator + c] *= correction;
        }
        kernels.accumulate(state + kStateAccumulator, scores, visible_values, value_dim, visible,
                           value_dim);
      }
    }
    first += count;
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

}  // namespace

absl::Status PagedDecodeCpu(const PagedDecodeBatch& batch, ThreadPool& pool, SimdLevel level) {
  if (absl::Status status = ValidatePagedDecodeBatch(batch, /*check_block_ids=*/true);
      !status.ok()) {
    return status;
  }
  if (!CpuSupports(level)) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged decode: this CPU cannot run ", SimdLevelName(level)));
  }
  const RowKernels kernels = Kernels(level);
  const int64_t group = batch.num_heads / batch.layout.num_kv_heads;
  const int64_t state_floats = StateFloats(batch.layout);
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
    for (int64_t h = 0; h < batch.layout.num_kv_heads; ++h) {
      heads.push_back({static_cast<int64_t>(b), h, num_splits, state_total});
      // Splits wholly before the first query's window are not run; their states stay empty
      // (a sum of 0 is skipped by the merge).
      const int64_t first_split =
          FirstVisibleKey(batch, sequence.length - sequence.num_queries) / kPagedSplitKeys;
      for (int64_t s = first_split; s < num_splits; ++s) {
        splits.push_back({static_cast<int64_t>(heads.size()) - 1, s * kPagedSplitKeys,
                          std::min(sequence.length, (s + 1) * kPagedSplitKeys)});
      }
      state_total += num_splits * rows * state_floats;
    }
  }
  std::vector<float> states(state_total);
  pool.ParallelFor(static_cast<int64_t>(splits.size()), [&](int64_t index) {
    const Split& split = splits[index];
    const HeadWork& work = heads[split.head_work];
    const PagedDecodeSequence& sequence = batch.sequences[work.sequence];
    const int64_t rows = sequence.num_queries * group;
    const int64_t split_index = split.key_begin / kPagedSplitKeys;
    AttendSplit(kernels, batch, sequence, work.kv_head, split.key_begin, split.key_end,
                states.data() + work.states_offset + split_index * rows * state_floats);
  });
  pool.ParallelFor(static_cast<int64_t>(heads.size()), [&](int64_t index) {
    MergeSplits(batch, heads[index], states.data() + heads[index].states_offset);
  });
  return absl::OkStatus();
}

}  // namespace attention::core

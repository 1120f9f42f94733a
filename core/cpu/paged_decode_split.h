// What the paged decode kernel's splits share: paged_attention_cpu.cc runs the portable and
// AVX2 splits and merges every split's states, paged_attention_avx512.cc is the AVX-512
// split. Internal to those two files.
#ifndef ATTENTION_CORE_CPU_PAGED_DECODE_SPLIT_H_
#define ATTENTION_CORE_CPU_PAGED_DECODE_SPLIT_H_

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/cpu/paged_attention_cpu.h"

namespace attention::core::paged_decode {

inline constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// A query row's partial softmax over some keys: running max, sum of exp(score - max), and
// the values weighted by those exps.
inline constexpr int64_t kStateMax = 0, kStateSum = 1, kStateAccumulator = 2;
inline int64_t StateFloats(const kv_cache::KvLayout& layout) {
  return layout.value_dim + kStateAccumulator;
}

// The first key a query at `position` sees.
inline int64_t FirstVisibleKey(const PagedDecodeBatch& batch, int64_t position) {
  return batch.sliding_window > 0 ? std::max<int64_t>(0, position - batch.sliding_window + 1) : 0;
}

#if defined(__x86_64__)
// Whether this CPU runs AttendSplitAvx512: AVX-512 with AVX512BW (the bfloat16 tails'
// 16-bit masked loads).
bool CpuSupportsAvx512Bw();

// The keys of one KV head in [key_begin, key_end) of one sequence, for every query row of
// its group (rows r = i * group + g: query i, head kv_head * group + g), in chunks of 64
// keys scored 16 at a time, each key and value row read once for a block of up to 4 rows.
// Writes one state per row to `states`.
void AttendSplitAvx512(const PagedDecodeBatch& batch, const PagedDecodeSequence& sequence,
                       int64_t kv_head, int64_t key_begin, int64_t key_end, float* states);
#endif

}  // namespace attention::core::paged_decode

#endif  // ATTENTION_CORE_CPU_PAGED_DECODE_SPLIT_H_

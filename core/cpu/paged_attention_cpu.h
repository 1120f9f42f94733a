// Decode attention on the CPU over a paged KV cache (core/kv_cache/block_pool.h): each
// sequence's n new queries attend to its L cached keys, the n new ones included, with
// bottom-right causal alignment (query i, at position p = L - n + i, sees keys 0..p, or only
// the last W of them, p - W + 1..p, under a sliding window of W keys).
//
// Bandwidth-bound by design: each KV head is read once for all query heads of its GQA
// group, and long contexts are split across threads at fixed absolute key boundaries
// (kPagedSplitKeys) whose partial softmax states merge in a fixed order, so results are
// bitwise the same for any thread count and any batch composition.
//
// Steps of many queries (prefill chunks) are compute-bound: PagedAttentionCpu
// (core/cpu/paged_prefill_cpu.h) sends those to the blocked flash-style kernel instead.
#ifndef ATTENTION_CORE_CPU_PAGED_ATTENTION_CPU_H_
#define ATTENTION_CORE_CPU_PAGED_ATTENTION_CPU_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/cpu/gemm.h"
#include "core/cpu/thread_pool.h"
#include "core/kv_cache/block_pool.h"

namespace attention::core {

// Keys per unit of work: one thread attends one KV head over one such range.
inline constexpr int64_t kPagedSplitKeys = 1024;

// The KV storage of a pool: block b is the bytes [b * block_bytes, (b + 1) * block_bytes).
struct PagedKvStorage {
  const void* data = nullptr;
  int64_t block_bytes = 0;
  int64_t num_blocks = 0;
};

// One sequence of a batch, for one layer.
struct PagedDecodeSequence {
  absl::Span<const kv_cache::BlockId> block_table;  // this layer's blocks, >= ceil(L / tpb)
  int64_t length = 0;                               // L, the new tokens included
  int64_t num_queries = 0;                          // n, 1..L
  const float* query = nullptr;                     // [n][H][dk]
  float* output = nullptr;                          // [n][H][dv]
  float* log_sum_exp = nullptr;  // [n][H] (natural log of the scaled scores), or null
};

// Sequences sharing one KV layout, one storage and one head count.
struct PagedDecodeBatch {
  PagedKvStorage storage;
  kv_cache::KvLayout layout;
  int64_t tokens_per_block = 0;
  int64_t num_heads = 0;  // H, a multiple of layout.num_kv_heads
  float scale = 1.0f;
  int64_t sliding_window = 0;  // W keys seen by each query, its own included; 0: all
  absl::Span<const PagedDecodeSequence> sequences;
};

// The checks of a batch every backend makes on the host: INVALID_ARGUMENT naming the field
// when it is malformed (see PagedDecodeCpu). `check_block_ids`: the block tables are host
// memory, so each id is checked against the storage (a GPU's live on the device).
absl::Status ValidatePagedDecodeBatch(const PagedDecodeBatch& batch, bool check_block_ids);

// INVALID_ARGUMENT naming the field when the batch is malformed (n < 1, n > L, a block
// table too short or naming a block outside the storage, heads not a multiple of the KV
// heads, a negative window); otherwise computes every sequence's output. `level` picks the SIMD
// code (tests run each level the CPU supports).
absl::Status PagedDecodeCpu(const PagedDecodeBatch& batch, ThreadPool& pool,
                            SimdLevel level = BestSimdLevel());

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_PAGED_ATTENTION_CPU_H_

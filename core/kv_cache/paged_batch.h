// The request of every paged decode kernel (the CPU's, core/cpu/paged_attention_cpu.h, and
// CUDA's, core/cuda/paged_decode.h): sequences whose n new queries attend to their L cached
// keys in a paged pool (block_pool.h), and the checks every backend makes on the host.
#ifndef ATTENTION_CORE_KV_CACHE_PAGED_BATCH_H_
#define ATTENTION_CORE_KV_CACHE_PAGED_BATCH_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/kv_cache/block_pool.h"

namespace attention::core {

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

// What a kernel shared while attending a batch (see FindSharedPrefixes); it adds to these.
struct PagedAttendStats {
  int64_t shared_blocks = 0;    // blocks of shared prefixes, each read once for its group
  int64_t keys_not_reread = 0;  // keys a group's other members would have read again
};

// Sequences sharing one KV layout, one storage and one head count.
struct PagedDecodeBatch {
  PagedKvStorage storage;
  kv_cache::KvLayout layout;
  int64_t tokens_per_block = 0;
  int64_t num_heads = 0;  // H, a multiple of layout.num_kv_heads
  float scale = 1.0f;
  int64_t sliding_window = 0;  // W keys seen by each query, its own included; 0: all
  // Over bfloat16 KV: the step of a BFLOAT16 layer, whose products may round the queries and
  // the probabilities to bf16 (within the bf16 rule, as the layer's own attention does), so
  // a GPU may run it on cuDNN. Unset, kernels compute in float32 on the widened KV.
  bool bf16_products = false;
  absl::Span<const PagedDecodeSequence> sequences;
  PagedAttendStats* stats = nullptr;  // when set, what the kernel shared is added to it
};

// The checks of a batch every backend makes on the host: INVALID_ARGUMENT naming the field
// when it is malformed (see PagedDecodeCpu). `check_block_ids`: the block tables are host
// memory, so each id is checked against the storage (a GPU's live on the device).
absl::Status ValidatePagedDecodeBatch(const PagedDecodeBatch& batch, bool check_block_ids);

// Sequences of a batch whose leading keys sit in the same physical blocks (forks of one
// prefix) and are seen whole by every query of each: a kernel reads those keys once for the
// whole group instead of once per sequence.
struct SharedPrefixGroup {
  std::vector<int64_t> sequences;  // indices into batch.sequences, at least 2, ascending
  int64_t shared_keys = 0;         // keys [0, shared_keys): a positive multiple of unit_keys
};

// The groups of `batch` sharing whole units of `unit_keys` keys (a kernel's split, so that
// each unit is computed as it would be for one sequence): sequences are grouped by their
// first block, and a group shares the units that every member holds in the same blocks as
// its first member and that each member's first query sees whole. A sequence is in at most
// one group; a tree of forks shares what all its members share. None under a sliding window.
std::vector<SharedPrefixGroup> FindSharedPrefixes(const PagedDecodeBatch& batch, int64_t unit_keys);

}  // namespace attention::core

#endif  // ATTENTION_CORE_KV_CACHE_PAGED_BATCH_H_

// The bookkeeping of a paged KV cache (vLLM's PagedAttention): which fixed-size blocks of
// one pool each sequence's keys and values live in. Host-only logic, no storage: the
// backend that owns the bytes copies and poisons blocks when this pool says so.
//
// The pool is sized in bytes at start-up and cut into blocks of `block_bytes`, so sequences
// of different shapes share it. A sequence of layout (H_kv, dk, dv, dtype) keeps
// tokens_per_block = block_bytes / (H_kv * (dk + dv) * elem_size) tokens of one layer in a
// block: the keys first, K [H_kv][t][dk], then the values, V [H_kv][t][dv]. Head-major, so
// that a decode kernel reading one KV head streams contiguous bytes: token-major
// ([t][H_kv][d]) put one head's consecutive tokens 4 KiB apart at Llama-3-8B's shapes, a
// page per token: paged_decode_bench read float32 KV at 41% of the machine's read bandwidth
// at 32k tokens that way, 53% head-major, all else equal.
//
// Admission control (TensorRT-LLM's GUARANTEED_NO_EVICT): Reserve and Fork promise every
// block a sequence may need to grow to its reservation, copy-on-write copies included, so
// EnsureCapacity within the reservation never fails. The promise is
//   allocated blocks + growth still owed + copies still owed <= blocks_total,
// where a block shared by r holders, p of which end inside it (a partial tail they may
// write), owes min(p, r - 1) copies: the last writer keeps the original.
#ifndef ATTENTION_CORE_KV_CACHE_BLOCK_POOL_H_
#define ATTENTION_CORE_KV_CACHE_BLOCK_POOL_H_

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/dtype.h"

namespace attention::core::kv_cache {

inline constexpr int64_t kDefaultBlockBytes = 256 << 10;

using BlockId = int32_t;
using SequenceId = int64_t;

// The shape of one layer's KV cache: float32 or bfloat16 storage.
struct KvLayout {
  int64_t num_kv_heads = 1;
  int64_t key_dim = 1;    // dk
  int64_t value_dim = 1;  // dv
  DType dtype = DType::kFloat32;

  int64_t ElementBytes() const { return ElementSize(dtype); }
  // Bytes of one token's keys and values in one layer, for a layout TokensPerBlock accepted
  // (any other may overflow).
  int64_t TokenBytes() const { return num_kv_heads * (key_dim + value_dim) * ElementBytes(); }
};

// Tokens of `layout` one block holds; INVALID_ARGUMENT naming the numbers when the layout
// is malformed or a token does not fit a block (checked without overflow for any values).
absl::StatusOr<int64_t> TokensPerBlock(const KvLayout& layout, int64_t block_bytes);

// Where a block's tokens are, in elements of the KV dtype from the block's start.
inline int64_t KeyOffset(const KvLayout& layout, int64_t tokens_per_block, int64_t token,
                         int64_t head) {
  return (head * tokens_per_block + token) * layout.key_dim;
}
inline int64_t ValueOffset(const KvLayout& layout, int64_t tokens_per_block, int64_t token,
                           int64_t head) {
  return tokens_per_block * layout.num_kv_heads * layout.key_dim +
         (head * tokens_per_block + token) * layout.value_dim;
}

// A copy-on-write the storage must do before writing: every byte of block `from` to `to`.
struct BlockCopy {
  BlockId from, to;
  friend bool operator==(const BlockCopy& a, const BlockCopy& b) {
    return a.from == b.from && a.to == b.to;
  }
};

// One sequence: its layout, how far it is written and reserved, and per layer the physical
// blocks of its tokens (token t of layer l is slot t % tokens_per_block of
// block_tables[l][t / tokens_per_block]).
struct KvSequence {
  KvLayout layout;
  int64_t tokens_per_block = 0;
  int64_t num_layers = 0;
  int64_t length = 0;
  int64_t reserved_tokens = 0;
  std::vector<std::vector<BlockId>> block_tables;  // [layer][ceil(length / tokens_per_block)]
};

struct KvPoolCounters {
  int64_t blocks_total = 0;
  int64_t blocks_free = 0;       // not held by any sequence
  int64_t blocks_reserved = 0;   // free, but promised to sequences for growth and copies
  int64_t blocks_available = 0;  // free and not promised: what Reserve and Fork may take
  int64_t blocks_shared = 0;     // held by more than one sequence
  int64_t sequences = 0;
};

// Thread-compatible: the caller locks.
class KvBlockPool {
 public:
  // floor(pool_bytes / block_bytes) blocks; INVALID_ARGUMENT unless there is at least one.
  static absl::StatusOr<KvBlockPool> Create(int64_t pool_bytes,
                                            int64_t block_bytes = kDefaultBlockBytes);

  int64_t block_bytes() const { return block_bytes_; }
  KvPoolCounters Counters() const;

  // A new empty sequence whose `num_layers` layers may grow to `reserved_tokens` tokens.
  // RESOURCE_EXHAUSTED naming the blocks and tokens needed and available when the pool
  // cannot promise them.
  absl::StatusOr<SequenceId> Reserve(const KvLayout& layout, int64_t num_layers,
                                     int64_t reserved_tokens);

  // Makes tokens [0, length) of every layer writable: allocates blocks, and copies a shared
  // partial tail block first (returned, one per layer, for the storage to do before it
  // writes). No-op when length <= the sequence's length; OUT_OF_RANGE past the reservation.
  absl::StatusOr<std::vector<BlockCopy>> EnsureCapacity(SequenceId id, int64_t length);

  // A new sequence sharing the first `tokens` tokens of `source` (0..its length) by
  // reference, with a reservation of `reserved_tokens` >= tokens.
  absl::StatusOr<SequenceId> Fork(SequenceId source, int64_t tokens, int64_t reserved_tokens);

  // Back to `tokens` (<= length) tokens: blocks past it are released; those no longer held
  // are appended to `freed`. RESOURCE_EXHAUSTED (nothing changed) in the one case that
  // needs new promises: rolling back into blocks still shared with another sequence, whose
  // regrowth would need copies and blocks the pool cannot promise.
  absl::Status Truncate(SequenceId id, int64_t tokens, std::vector<BlockId>* freed);

  // Ends the sequence; blocks no longer held are appended to `freed`.
  absl::Status Release(SequenceId id, std::vector<BlockId>* freed);

  // A sequence as a snapshot held it (server/sessions/session_snapshot.h): its block tables
  // name the snapshot's blocks, which `placed` maps to this pool's. A snapshot block not yet
  // placed takes a free block, added to `placed` for the storage to fill. INVALID_ARGUMENT
  // when the tables do not fit its layout and length, RESOURCE_EXHAUSTED (nothing changed)
  // when the pool cannot promise its blocks and growth.
  absl::StatusOr<SequenceId> Adopt(const KvSequence& sequence,
                                   absl::flat_hash_map<int64_t, BlockId>& placed);

  // NOT_FOUND for an unknown id. The pointer is valid until the next call that changes the
  // pool.
  absl::StatusOr<const KvSequence*> Find(SequenceId id) const;

 private:
  struct BlockState {
    int32_t holders = 0;          // sequences referencing the block
    int32_t partial_holders = 0;  // of which end inside it
  };
  // A change of one block's holders and partial holders.
  struct BlockDelta {
    BlockId block;
    int32_t holders = 0, partial_holders = 0;
  };

  KvBlockPool(int64_t block_bytes, int64_t num_blocks);

  static int64_t CopiesOwed(const BlockState& state);
  static int64_t BlocksFor(int64_t tokens, int64_t tokens_per_block) {
    return tokens / tokens_per_block + (tokens % tokens_per_block != 0);  // cannot overflow
  }
  // Blocks a sequence still needs to reach its reservation, over all layers.
  static int64_t GrowthOwed(const KvSequence& sequence);
  int64_t Committed() const { return allocated_ + growth_owed_ + copies_owed_; }
  absl::StatusOr<KvSequence*> FindMutable(SequenceId id);
  // The change of Committed() that `deltas` would make.
  int64_t CommittedChange(absl::Span<const BlockDelta> deltas) const;
  // Applies one change, keeping the counters; a block no longer held goes back to the free
  // list and to `freed`.
  void Apply(const BlockDelta& delta, std::vector<BlockId>* freed);
  // The deltas of `sequence`'s tail block in each layer when it ends inside one.
  void AddTailDeltas(const KvSequence& sequence, int32_t sign,
                     std::vector<BlockDelta>* deltas) const;
  absl::Status Exhausted(absl::string_view what, int64_t blocks_needed,
                         int64_t tokens_per_block) const;

  int64_t block_bytes_;
  std::vector<BlockState> blocks_;
  std::vector<BlockId> free_list_;  // LIFO
  int64_t allocated_ = 0;           // blocks with holders
  int64_t growth_owed_ = 0;
  int64_t copies_owed_ = 0;
  int64_t shared_ = 0;
  SequenceId next_id_ = 1;
  std::unordered_map<SequenceId, KvSequence> sequences_;
};

}  // namespace attention::core::kv_cache

#endif  // ATTENTION_CORE_KV_CACHE_BLOCK_POOL_H_

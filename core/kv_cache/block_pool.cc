#include "core/kv_cache/block_pool.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attention::core::kv_cache {

absl::StatusOr<int64_t> TokensPerBlock(const KvLayout& layout, int64_t block_bytes) {
  if (layout.num_kv_heads < 1 || layout.key_dim < 1 || layout.value_dim < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV layout needs num_kv_heads, key_dim and value_dim >= 1; got ",
                     layout.num_kv_heads, ", ", layout.key_dim, ", ", layout.value_dim));
  }
  if (layout.dtype != DType::kFloat32 && layout.dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV dtype must be float32 or bfloat16, not ", DTypeName(layout.dtype)));
  }
  int64_t token_bytes = 0;
  const bool overflows = __builtin_add_overflow(layout.key_dim, layout.value_dim, &token_bytes) ||
                         __builtin_mul_overflow(token_bytes, layout.num_kv_heads, &token_bytes) ||
                         __builtin_mul_overflow(token_bytes, layout.ElementBytes(), &token_bytes);
  const int64_t tokens = overflows ? 0 : block_bytes / token_bytes;
  if (tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "one token of KV layout num_kv_heads ", layout.num_kv_heads, " x (key_dim ", layout.key_dim,
        " + value_dim ", layout.value_dim, ") x ", layout.ElementBytes(),
        " bytes = ", overflows ? std::string("more than 2^63") : absl::StrCat(token_bytes),
        " bytes does not fit a KV block of ", block_bytes, " bytes"));
  }
  return tokens;
}

absl::StatusOr<KvBlockPool> KvBlockPool::Create(int64_t pool_bytes, int64_t block_bytes) {
  if (block_bytes < 1 || pool_bytes < block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV pool of ", pool_bytes, " bytes holds no block of ", block_bytes, " bytes"));
  }
  const int64_t num_blocks = pool_bytes / block_bytes;
  if (num_blocks > std::numeric_limits<BlockId>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV pool of ", num_blocks, " blocks exceeds the block id's range"));
  }
  return KvBlockPool(block_bytes, num_blocks);
}

KvBlockPool::KvBlockPool(int64_t block_bytes, int64_t num_blocks)
    : block_bytes_(block_bytes), blocks_(num_blocks) {
  // Lowest ids on top, so a fresh pool hands out blocks 0, 1, 2...
  free_list_.reserve(num_blocks);
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_list_.push_back(static_cast<BlockId>(b));
}

KvPoolCounters KvBlockPool::Counters() const {
  KvPoolCounters counters;
  counters.blocks_total = static_cast<int64_t>(blocks_.size());
  counters.blocks_free = counters.blocks_total - allocated_;
  counters.blocks_reserved = growth_owed_ + copies_owed_;
  counters.blocks_available = counters.blocks_total - Committed();
  counters.blocks_shared = shared_;
  counters.sequences = static_cast<int64_t>(sequences_.size());
  return counters;
}

int64_t KvBlockPool::CopiesOwed(const BlockState& state) {
  if (state.partial_holders == 0) return 0;
  return std::min(state.partial_holders, state.holders - 1);
}

int64_t KvBlockPool::GrowthOwed(const KvSequence& sequence) {
  return sequence.num_layers * (BlocksFor(sequence.reserved_tokens, sequence.tokens_per_block) -
                                BlocksFor(sequence.length, sequence.tokens_per_block));
}

absl::StatusOr<KvSequence*> KvBlockPool::FindMutable(SequenceId id) {
  const auto it = sequences_.find(id);
  if (it == sequences_.end()) {
    return absl::NotFoundError(absl::StrCat("no KV sequence ", id));
  }
  return &it->second;
}

absl::StatusOr<const KvSequence*> KvBlockPool::Find(SequenceId id) const {
  return const_cast<KvBlockPool*>(this)->FindMutable(id);
}

int64_t KvBlockPool::CommittedChange(absl::Span<const BlockDelta> deltas) const {
  int64_t change = 0;
  for (const BlockDelta& delta : deltas) {
    const BlockState before = blocks_[delta.block];
    const BlockState after{before.holders + delta.holders,
                           before.partial_holders + delta.partial_holders};
    change += CopiesOwed(after) - CopiesOwed(before);
    change += (after.holders > 0) - (before.holders > 0);
  }
  return change;
}

void KvBlockPool::Apply(const BlockDelta& delta, std::vector<BlockId>* freed) {
  BlockState& state = blocks_[delta.block];
  const BlockState before = state;
  state.holders += delta.holders;
  state.partial_holders += delta.partial_holders;
  copies_owed_ += CopiesOwed(state) - CopiesOwed(before);
  allocated_ += (state.holders > 0) - (before.holders > 0);
  shared_ += (state.holders > 1) - (before.holders > 1);
  if (before.holders > 0 && state.holders == 0) {
    free_list_.push_back(delta.block);
    if (freed != nullptr) freed->push_back(delta.block);
  }
}

void KvBlockPool::AddTailDeltas(const KvSequence& sequence, int32_t sign,
                                std::vector<BlockDelta>* deltas) const {
  if (sequence.length % sequence.tokens_per_block == 0) return;  // ends on a block boundary
  const int64_t tail = sequence.length / sequence.tokens_per_block;
  for (const std::vector<BlockId>& table : sequence.block_tables) {
    deltas->push_back({table[tail], 0, sign});
  }
}

absl::Status KvBlockPool::Exhausted(absl::string_view what, int64_t blocks_needed,
                                    int64_t tokens_per_block) const {
  const KvPoolCounters counters = Counters();
  return absl::ResourceExhaustedError(absl::StrCat(
      "KV pool cannot promise the ", blocks_needed, " blocks ", what, " needs: ",
      counters.blocks_available, " of ", counters.blocks_total, " blocks of ", block_bytes_,
      " bytes are available (", counters.blocks_free, " free, ", counters.blocks_reserved,
      " promised to other sequences), i.e. ", counters.blocks_available * tokens_per_block,
      " layer-tokens at ", tokens_per_block, " tokens per block"));
}

absl::StatusOr<SequenceId> KvBlockPool::Reserve(const KvLayout& layout, int64_t num_layers,
                                                int64_t reserved_tokens) {
  absl::StatusOr<int64_t> tokens_per_block = TokensPerBlock(layout, block_bytes_);
  if (!tokens_per_block.ok()) return tokens_per_block.status();
  if (num_layers < 1 || reserved_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("a KV reservation needs num_layers >= 1 and ",
                                                   "reserved_tokens >= 1; got ", num_layers,
                                                   " and ", reserved_tokens));
  }
  // Refused before anything is allocated; each factor is at most the pool's block count
  // (< 2^31) when multiplied, so the product cannot overflow.
  const int64_t total = static_cast<int64_t>(blocks_.size());
  const int64_t blocks_per_layer = BlocksFor(reserved_tokens, *tokens_per_block);
  const int64_t needed = num_layers <= total && blocks_per_layer <= total
                             ? num_layers * blocks_per_layer
                             : std::numeric_limits<int64_t>::max();
  if (needed > total - Committed()) {
    return Exhausted(
        absl::StrCat("a reservation of ", reserved_tokens, " tokens x ", num_layers, " layers"),
        needed, *tokens_per_block);
  }
  KvSequence sequence;
  sequence.layout = layout;
  sequence.tokens_per_block = *tokens_per_block;
  sequence.num_layers = num_layers;
  sequence.reserved_tokens = reserved_tokens;
  sequence.block_tables.resize(num_layers);
  growth_owed_ += needed;
  const SequenceId id = next_id_++;
  sequences_.emplace(id, std::move(sequence));
  return id;
}

absl::StatusOr<std::vector<BlockCopy>> KvBlockPool::EnsureCapacity(SequenceId id, int64_t length) {
  absl::StatusOr<KvSequence*> found = FindMutable(id);
  if (!found.ok()) return found.status();
  KvSequence& sequence = **found;
  std::vector<BlockCopy> copies;
  if (length <= sequence.length) return copies;
  if (length > sequence.reserved_tokens) {
    return absl::OutOfRangeError(absl::StrCat("KV sequence ", id, " cannot grow to ", length,
                                              " tokens: its reservation is ",
                                              sequence.reserved_tokens));
  }
  const int64_t tokens_per_block = sequence.tokens_per_block;
  std::vector<BlockDelta> tail;
  AddTailDeltas(sequence, -1, &tail);  // the old tail is about to be written past
  for (const BlockDelta& delta : tail) Apply(delta, nullptr);
  const int64_t old_blocks = BlocksFor(sequence.length, tokens_per_block);
  const int64_t new_blocks = BlocksFor(length, tokens_per_block);
  for (std::vector<BlockId>& table : sequence.block_tables) {
    // Copy-on-write: the new tokens go into the shared partial tail block.
    if (sequence.length % tokens_per_block != 0) {
      BlockId& block = table[sequence.length / tokens_per_block];
      if (blocks_[block].holders > 1) {
        if (free_list_.empty()) return absl::InternalError("KV pool promised a block it lacks");
        const BlockId copy = free_list_.back();
        free_list_.pop_back();
        Apply({copy, 1, 0}, nullptr);
        Apply({block, -1, 0}, nullptr);
        copies.push_back({block, copy});
        block = copy;
      }
    }
    for (int64_t b = old_blocks; b < new_blocks; ++b) {
      if (free_list_.empty()) return absl::InternalError("KV pool promised a block it lacks");
      table.push_back(free_list_.back());
      free_list_.pop_back();
      Apply({table.back(), 1, 0}, nullptr);
    }
  }
  growth_owed_ -= (new_blocks - old_blocks) * sequence.num_layers;
  sequence.length = length;
  tail.clear();
  AddTailDeltas(sequence, 1, &tail);
  for (const BlockDelta& delta : tail) Apply(delta, nullptr);
  return copies;
}

absl::StatusOr<SequenceId> KvBlockPool::Fork(SequenceId source_id, int64_t tokens,
                                             int64_t reserved_tokens) {
  absl::StatusOr<KvSequence*> found = FindMutable(source_id);
  if (!found.ok()) return found.status();
  const KvSequence& source = **found;
  if (tokens < 0 || tokens > source.length) {
    return absl::OutOfRangeError(absl::StrCat("cannot fork ", tokens, " tokens of KV sequence ",
                                              source_id, ", which has ", source.length));
  }
  if (reserved_tokens < std::max<int64_t>(tokens, 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a fork of ", tokens, " tokens needs a reservation of at least ",
                     std::max<int64_t>(tokens, 1), "; got ", reserved_tokens));
  }
  if (BlocksFor(reserved_tokens, source.tokens_per_block) > static_cast<int64_t>(blocks_.size())) {
    return Exhausted(absl::StrCat("a fork of ", tokens, " tokens reserving ", reserved_tokens),
                     BlocksFor(reserved_tokens, source.tokens_per_block), source.tokens_per_block);
  }
  KvSequence fork = source;
  fork.length = tokens;
  fork.reserved_tokens = reserved_tokens;
  const int64_t shared_blocks = BlocksFor(tokens, fork.tokens_per_block);
  const bool partial_tail = tokens % fork.tokens_per_block != 0;
  std::vector<BlockDelta> deltas;
  for (std::vector<BlockId>& table : fork.block_tables) {
    table.resize(shared_blocks);
    for (int64_t b = 0; b < shared_blocks; ++b) {
      deltas.push_back({table[b], 1, partial_tail && b == shared_blocks - 1 ? 1 : 0});
    }
  }
  const int64_t growth = GrowthOwed(fork);
  const int64_t needed = CommittedChange(deltas) + growth;
  if (Committed() + needed > static_cast<int64_t>(blocks_.size())) {
    return Exhausted(absl::StrCat("a fork of ", tokens, " tokens reserving ", reserved_tokens),
                     needed, fork.tokens_per_block);
  }
  for (const BlockDelta& delta : deltas) Apply(delta, nullptr);
  growth_owed_ += growth;
  const SequenceId id = next_id_++;
  sequences_.emplace(id, std::move(fork));
  return id;
}

absl::StatusOr<SequenceId> KvBlockPool::Adopt(const KvSequence& sequence,
                                              absl::flat_hash_map<int64_t, BlockId>& placed) {
  absl::StatusOr<int64_t> tokens_per_block = TokensPerBlock(sequence.layout, block_bytes_);
  if (!tokens_per_block.ok()) return tokens_per_block.status();
  const int64_t total = static_cast<int64_t>(blocks_.size());
  if (sequence.tokens_per_block != *tokens_per_block || sequence.num_layers < 1 ||
      sequence.length < 0 || sequence.reserved_tokens < std::max<int64_t>(sequence.length, 1) ||
      static_cast<int64_t>(sequence.block_tables.size()) != sequence.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("a KV sequence of ", sequence.num_layers, " layers (",
                     sequence.block_tables.size(), " block tables), ", sequence.length, " of ",
                     sequence.reserved_tokens, " reserved tokens at ", sequence.tokens_per_block,
                     " tokens per block does not fit a pool of ", block_bytes_,
                     "-byte blocks holding ", *tokens_per_block, " tokens of its layout"));
  }
  if (sequence.num_layers > total ||
      BlocksFor(sequence.reserved_tokens, sequence.tokens_per_block) > total) {
    return Exhausted(absl::StrCat("a restored sequence of ", sequence.num_layers, " layers x ",
                                  sequence.reserved_tokens, " reserved tokens"),
                     total + 1, sequence.tokens_per_block);
  }
  const int64_t blocks_per_layer = BlocksFor(sequence.length, sequence.tokens_per_block);
  // Free blocks for the snapshot blocks not yet placed, taken from the top of the free list.
  absl::flat_hash_map<int64_t, BlockId> fresh;
  for (const std::vector<BlockId>& table : sequence.block_tables) {
    if (static_cast<int64_t>(table.size()) != blocks_per_layer) {
      return absl::InvalidArgumentError(absl::StrCat("a KV block table of ", table.size(),
                                                     " blocks for ", sequence.length, " tokens at ",
                                                     sequence.tokens_per_block, " per block"));
    }
    for (const BlockId block : table) {
      if (block < 0) return absl::InvalidArgumentError(absl::StrCat("KV block ", block));
      if (placed.contains(block) || fresh.contains(block)) continue;
      const int64_t taken = static_cast<int64_t>(fresh.size());
      if (taken == static_cast<int64_t>(free_list_.size())) {
        return Exhausted("a restored sequence", taken + 1, sequence.tokens_per_block);
      }
      fresh.emplace(block, free_list_[free_list_.size() - 1 - taken]);
    }
  }
  KvSequence adopted = sequence;
  const bool partial_tail = sequence.length % sequence.tokens_per_block != 0;
  std::vector<BlockDelta> deltas;
  for (std::vector<BlockId>& table : adopted.block_tables) {
    for (int64_t b = 0; b < blocks_per_layer; ++b) {
      const auto here = placed.find(table[b]);
      table[b] = here != placed.end() ? here->second : fresh.at(table[b]);
      deltas.push_back({table[b], 1, partial_tail && b == blocks_per_layer - 1 ? 1 : 0});
    }
  }
  const int64_t growth = GrowthOwed(adopted);
  if (Committed() + CommittedChange(deltas) + growth > total) {
    return Exhausted(absl::StrCat("a restored sequence of ", sequence.length, " tokens reserving ",
                                  sequence.reserved_tokens),
                     CommittedChange(deltas) + growth, sequence.tokens_per_block);
  }
  free_list_.resize(free_list_.size() - fresh.size());
  placed.insert(fresh.begin(), fresh.end());
  for (const BlockDelta& delta : deltas) Apply(delta, nullptr);
  growth_owed_ += growth;
  const SequenceId id = next_id_++;
  sequences_.emplace(id, std::move(adopted));
  return id;
}

absl::Status KvBlockPool::Truncate(SequenceId id, int64_t tokens, std::vector<BlockId>* freed) {
  absl::StatusOr<KvSequence*> found = FindMutable(id);
  if (!found.ok()) return found.status();
  KvSequence& sequence = **found;
  if (tokens < 0 || tokens > sequence.length) {
    return absl::OutOfRangeError(absl::StrCat("cannot truncate KV sequence ", id, " to ", tokens,
                                              " tokens: it has ", sequence.length));
  }
  if (tokens == sequence.length) return absl::OkStatus();
  const int64_t tokens_per_block = sequence.tokens_per_block;
  const int64_t old_blocks = BlocksFor(sequence.length, tokens_per_block);
  const int64_t new_blocks = BlocksFor(tokens, tokens_per_block);
  const bool old_partial = sequence.length % tokens_per_block != 0;
  const bool new_partial = tokens % tokens_per_block != 0;
  std::vector<BlockDelta> deltas;
  for (const std::vector<BlockId>& table : sequence.block_tables) {
    for (int64_t b = new_blocks; b < old_blocks; ++b) {
      deltas.push_back({table[b], -1, old_partial && b == old_blocks - 1 ? -1 : 0});
    }
    // The tail block moves unless the old and new lengths end inside the same block.
    const bool same_tail = old_partial && new_partial && old_blocks == new_blocks;
    if (same_tail) continue;
    if (new_partial) deltas.push_back({table[new_blocks - 1], 0, 1});
  }
  const int64_t growth = (old_blocks - new_blocks) * sequence.num_layers;
  const int64_t needed = CommittedChange(deltas) + growth;
  if (needed > 0 && Committed() + needed > static_cast<int64_t>(blocks_.size())) {
    return Exhausted(absl::StrCat("rolling back into shared blocks to ", tokens, " tokens"), needed,
                     tokens_per_block);
  }
  for (const BlockDelta& delta : deltas) Apply(delta, freed);
  for (std::vector<BlockId>& table : sequence.block_tables) table.resize(new_blocks);
  growth_owed_ += growth;
  sequence.length = tokens;
  return absl::OkStatus();
}

absl::Status KvBlockPool::Release(SequenceId id, std::vector<BlockId>* freed) {
  absl::StatusOr<KvSequence*> found = FindMutable(id);
  if (!found.ok()) return found.status();
  KvSequence& sequence = **found;
  std::vector<BlockDelta> deltas;
  AddTailDeltas(sequence, -1, &deltas);
  for (const std::vector<BlockId>& table : sequence.block_tables) {
    for (const BlockId block : table) deltas.push_back({block, -1, 0});
  }
  for (const BlockDelta& delta : deltas) Apply(delta, freed);
  growth_owed_ -= GrowthOwed(sequence);
  sequences_.erase(id);
  return absl::OkStatus();
}

}  // namespace attention::core::kv_cache

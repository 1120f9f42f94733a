#include "core/kv_cache/paged_batch.h"

#include <algorithm>
#include <cstdint>
#include <map>

#include "absl/strings/str_cat.h"

namespace attention::core {

using kv_cache::BlockId;
using kv_cache::KvLayout;

absl::Status ValidatePagedDecodeBatch(const PagedDecodeBatch& batch, bool check_block_ids) {
  const KvLayout& layout = batch.layout;
  if (layout.dtype != DType::kFloat32 && layout.dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("paged decode: KV dtype must be float32 or ",
                                                   "bfloat16, not ", DTypeName(layout.dtype)));
  }
  if (layout.num_kv_heads < 1 || layout.key_dim < 1 || layout.value_dim < 1 ||
      batch.num_heads % layout.num_kv_heads != 0 || batch.num_heads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged decode: num_heads ", batch.num_heads, " must be a positive multiple of ",
        "num_kv_heads ", layout.num_kv_heads, ", and key_dim ", layout.key_dim, " and value_dim ",
        layout.value_dim, " positive"));
  }
  if (batch.sliding_window < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged decode: sliding_window ", batch.sliding_window, " must be >= 0 (0 for none)"));
  }
  if (batch.tokens_per_block < 1 ||
      batch.tokens_per_block * layout.TokenBytes() > batch.storage.block_bytes ||
      batch.storage.data == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "paged decode: tokens_per_block ", batch.tokens_per_block, " of ", layout.TokenBytes(),
        " bytes do not fit a storage block of ", batch.storage.block_bytes, " bytes"));
  }
  // Keys and values are read in place as elements of the KV dtype.
  const int64_t element = layout.ElementBytes();
  if (batch.storage.block_bytes % element != 0 ||
      reinterpret_cast<uintptr_t>(batch.storage.data) % element != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged decode: the storage and its blocks of ", batch.storage.block_bytes,
                     " bytes must be aligned to the KV element's ", element, " bytes"));
  }
  for (size_t b = 0; b < batch.sequences.size(); ++b) {
    const PagedDecodeSequence& sequence = batch.sequences[b];
    if (sequence.num_queries < 1 || sequence.num_queries > sequence.length) {
      return absl::InvalidArgumentError(
          absl::StrCat("paged decode: sequence ", b, " has num_queries ", sequence.num_queries,
                       " and length ", sequence.length, "; it needs 1 <= num_queries <= length"));
    }
    const int64_t blocks = (sequence.length + batch.tokens_per_block - 1) / batch.tokens_per_block;
    if (static_cast<int64_t>(sequence.block_table.size()) < blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("paged decode: sequence ", b, " of length ", sequence.length, " needs ",
                       blocks, " blocks of ", batch.tokens_per_block,
                       " tokens; its block table has ", sequence.block_table.size()));
    }
    for (int64_t i = 0; check_block_ids && i < blocks; ++i) {
      const BlockId block = sequence.block_table[i];
      if (block < 0 || block >= batch.storage.num_blocks) {
        return absl::InvalidArgumentError(
            absl::StrCat("paged decode: sequence ", b, " names block ", block, " at index ", i,
                         "; the storage has ", batch.storage.num_blocks));
      }
    }
    if (sequence.query == nullptr || sequence.output == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("paged decode: sequence ", b, " lacks its query or output"));
    }
  }
  return absl::OkStatus();
}

std::vector<SharedPrefixGroup> FindSharedPrefixes(const PagedDecodeBatch& batch,
                                                  int64_t unit_keys) {
  std::vector<SharedPrefixGroup> groups;
  if (batch.sliding_window > 0 || unit_keys < 1 || batch.tokens_per_block < 1) return groups;
  const int64_t tokens_per_block = batch.tokens_per_block;
  // Whole units every query of sequence b sees: its first query, at L - n, sees keys 0..L - n.
  const auto visible_units = [&](int64_t b) {
    const PagedDecodeSequence& sequence = batch.sequences[b];
    return (sequence.length - sequence.num_queries + 1) / unit_keys;
  };
  std::map<BlockId, std::vector<int64_t>> by_first_block;
  for (size_t b = 0; b < batch.sequences.size(); ++b) {
    if (visible_units(b) > 0) by_first_block[batch.sequences[b].block_table[0]].push_back(b);
  }
  for (const auto& [block, members] : by_first_block) {
    if (members.size() < 2) continue;
    const int64_t leader = members.front();
    const absl::Span<const BlockId> leader_table = batch.sequences[leader].block_table;
    SharedPrefixGroup group;
    group.sequences.push_back(leader);
    int64_t units = visible_units(leader);
    for (size_t m = 1; m < members.size(); ++m) {
      const absl::Span<const BlockId> table = batch.sequences[members[m]].block_table;
      // Blocks the first `wanted` units of both need, and how many of them are the same.
      const int64_t wanted = std::min(visible_units(leader), visible_units(members[m]));
      const int64_t blocks = std::min<int64_t>(
          {(wanted * unit_keys + tokens_per_block - 1) / tokens_per_block,
           static_cast<int64_t>(table.size()), static_cast<int64_t>(leader_table.size())});
      const int64_t same =
          std::mismatch(table.begin(), table.begin() + blocks, leader_table.begin()).first -
          table.begin();
      const int64_t common = std::min(wanted, same * tokens_per_block / unit_keys);
      if (common == 0) continue;
      group.sequences.push_back(members[m]);
      units = std::min(units, common);
    }
    if (group.sequences.size() < 2) continue;
    group.shared_keys = units * unit_keys;
    groups.push_back(std::move(group));
  }
  return groups;
}

}  // namespace attention::core

#include "core/kv_cache/paged_batch.h"

#include <cstdint>

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

}  // namespace attention::core

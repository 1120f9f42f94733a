#include "core/cpu/host_kv_storage.h"

#include <sys/mman.h>

#include <cstring>
#include <new>

namespace attention::core {
namespace {

using kv_cache::BlockId;
using kv_cache::KvLayout;

// Calls copy(block offset, row offset, bytes) for each KV head's keys and values of token
// slots [slot, slot + tokens): head-major in the block and in the rows alike.
template <typename Copy>
void ForEachHeadRun(const KvLayout& layout, int64_t tokens_per_block, int64_t slot, int64_t tokens,
                    Copy&& copy) {
  const int64_t element = layout.ElementBytes();
  for (int64_t h = 0; h < layout.num_kv_heads; ++h) {
    copy(/*is_key=*/true, kv_cache::KeyOffset(layout, tokens_per_block, slot, h) * element,
         h * tokens * layout.key_dim * element, tokens * layout.key_dim * element);
    copy(/*is_key=*/false, kv_cache::ValueOffset(layout, tokens_per_block, slot, h) * element,
         h * tokens * layout.value_dim * element, tokens * layout.value_dim * element);
  }
}

}  // namespace

HostKvStorage::HostKvStorage(int64_t num_blocks, int64_t block_bytes, ThreadPool& pool,
                             int64_t prefill_min_queries, std::optional<Bf16Kernel> bf16_products,
                             SharedPrefixes shared_prefixes)
    : KvStorage(num_blocks, block_bytes),
      pool_(pool),
      prefill_min_queries_(prefill_min_queries),
      bf16_products_(bf16_products),
      shared_prefixes_(shared_prefixes) {
  constexpr int64_t kHugePage = int64_t{2} << 20;
  const int64_t bytes = (num_blocks * block_bytes + kHugePage - 1) / kHugePage * kHugePage;
  bytes_.reset(static_cast<std::byte*>(std::aligned_alloc(kHugePage, bytes)));
  if (bytes_ == nullptr) throw std::bad_alloc();
  madvise(bytes_.get(), bytes, MADV_HUGEPAGE);  // advice only: failure changes nothing
}

absl::Status HostKvStorage::WriteTokens(BlockId block, const KvLayout& layout,
                                        int64_t tokens_per_block, int64_t slot, int64_t tokens,
                                        const void* keys, const void* values) {
  std::byte* const base = Block(block);
  ForEachHeadRun(layout, tokens_per_block, slot, tokens,
                 [&](bool is_key, int64_t block_offset, int64_t row_offset, int64_t bytes) {
                   const auto* rows = static_cast<const std::byte*>(is_key ? keys : values);
                   std::memcpy(base + block_offset, rows + row_offset, bytes);
                 });
  return absl::OkStatus();
}

absl::Status HostKvStorage::ReadTokens(BlockId block, const KvLayout& layout,
                                       int64_t tokens_per_block, int64_t slot, int64_t tokens,
                                       void* keys, void* values) const {
  const std::byte* const base = Block(block);
  ForEachHeadRun(layout, tokens_per_block, slot, tokens,
                 [&](bool is_key, int64_t block_offset, int64_t row_offset, int64_t bytes) {
                   auto* rows = static_cast<std::byte*>(is_key ? keys : values);
                   std::memcpy(rows + row_offset, base + block_offset, bytes);
                 });
  return absl::OkStatus();
}

absl::Status HostKvStorage::ReadBlock(BlockId block, void* bytes) const {
  std::memcpy(bytes, Block(block), block_bytes());
  return absl::OkStatus();
}

absl::Status HostKvStorage::WriteBlock(BlockId block, const void* bytes) {
  std::memcpy(Block(block), bytes, block_bytes());
  return absl::OkStatus();
}

absl::Status HostKvStorage::CopyBlock(BlockId from, BlockId to) {
  std::memcpy(Block(to), Block(from), block_bytes());
  return absl::OkStatus();
}

absl::Status HostKvStorage::Poison(BlockId block) {
  std::memset(Block(block), 0xff, block_bytes());
  return absl::OkStatus();
}

absl::Status HostKvStorage::Attend(const PagedDecodeBatch& batch) {
  PagedDecodeBatch here = batch;
  here.storage = {bytes_.get(), block_bytes(), num_blocks()};
  return PagedAttentionCpu(here, pool_, prefill_min_queries_, bf16_products_, shared_prefixes_);
}

}  // namespace attention::core

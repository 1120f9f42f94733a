// The CPU backend's KV storage: the pool's blocks in host memory, on huge pages where the
// kernel gives them, attended by the CPU paged kernels (PagedAttentionCpu: sequences of at
// least `prefill_min_queries` new tokens on the blocked flash-style kernel, the rest on the
// decode kernel; forks' shared prefixes as `shared_prefixes` says, over bf16 KV in
// `bf16_products`, see PagedDecodeCpu).
#ifndef ATTENTION_CORE_CPU_HOST_KV_STORAGE_H_
#define ATTENTION_CORE_CPU_HOST_KV_STORAGE_H_

#include <cstddef>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "core/cpu/gemm_bf16.h"
#include "core/cpu/paged_prefill_cpu.h"
#include "core/cpu/thread_pool.h"
#include "core/kv_cache/kv_storage.h"

namespace attention::core {

class HostKvStorage final : public kv_cache::KvStorage {
 public:
  // Throws std::bad_alloc when the memory cannot be had (as a vector would).
  HostKvStorage(int64_t num_blocks, int64_t block_bytes, ThreadPool& pool,
                int64_t prefill_min_queries = kPagedPrefillMinQueries,
                std::optional<Bf16Kernel> bf16_products = std::nullopt,
                SharedPrefixes shared_prefixes = SharedPrefixes::kReadOnce);

  const std::string& device() const override { return device_; }
  absl::Status WriteTokens(kv_cache::BlockId block, const kv_cache::KvLayout& layout,
                           int64_t tokens_per_block, int64_t slot, int64_t tokens, const void* keys,
                           const void* values) override;
  absl::Status ReadTokens(kv_cache::BlockId block, const kv_cache::KvLayout& layout,
                          int64_t tokens_per_block, int64_t slot, int64_t tokens, void* keys,
                          void* values) const override;
  absl::Status ReadBlock(kv_cache::BlockId block, void* bytes) const override;
  absl::Status WriteBlock(kv_cache::BlockId block, const void* bytes) override;
  absl::Status CopyBlock(kv_cache::BlockId from, kv_cache::BlockId to) override;
  absl::Status Poison(kv_cache::BlockId block) override;
  absl::Status Attend(const PagedDecodeBatch& batch) override;
  // Attend only reads the blocks, on the thread pool, which takes several callers at once.
  bool attends_concurrently() const override { return true; }

 private:
  std::byte* Block(kv_cache::BlockId block) const {
    return bytes_.get() + static_cast<int64_t>(block) * block_bytes();
  }

  struct Free {
    void operator()(std::byte* bytes) const { std::free(bytes); }
  };
  const std::string device_ = "cpu";
  ThreadPool& pool_;
  const int64_t prefill_min_queries_;
  const std::optional<Bf16Kernel> bf16_products_;
  const SharedPrefixes shared_prefixes_;
  // Left uninitialized, so pages are committed as sessions fill them; huge pages because a
  // decode step streams through blocks and 4 KiB pages cost TLB misses.
  std::unique_ptr<std::byte[], Free> bytes_;
};

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_HOST_KV_STORAGE_H_

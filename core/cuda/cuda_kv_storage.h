// The CUDA backend's KV storage: the pool's blocks in one GPU's memory, attended there by
// cuDNN's paged SDPA where it takes the step (cudnn_sdpa.h: bfloat16 layers' steps over
// bfloat16 KV) and by the CUDA paged decode kernel (paged_decode.h) otherwise. Every call
// is synchronous: the session table calls it under its lock, one at a time, with host
// memory in and out.
#ifndef ATTENTION_CORE_CUDA_CUDA_KV_STORAGE_H_
#define ATTENTION_CORE_CUDA_CUDA_KV_STORAGE_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "core/cuda/cudnn_sdpa.h"
#include "core/cuda/device_buffer.h"
#include "core/kv_cache/kv_storage.h"

namespace attention::core::cuda {

class CudaKvStorage final : public kv_cache::KvStorage {
 public:
  // RESOURCE_EXHAUSTED when the GPU cannot hold the blocks.
  static absl::StatusOr<std::unique_ptr<kv_cache::KvStorage>> Create(int device, int64_t num_blocks,
                                                                     int64_t block_bytes);
  ~CudaKvStorage() override;

  const std::string& device() const override { return name_; }
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
  std::map<std::string, int64_t> AttendCallsByPath() const override;

 private:
  CudaKvStorage(int device, int64_t num_blocks, int64_t block_bytes);
  char* Block(kv_cache::BlockId block) const {
    return blocks_ + static_cast<int64_t>(block) * block_bytes();
  }
  // Copies token slots between host rows and a block, keys and values, one 2D copy each
  // (a head's run of slots is contiguous in the block and in the rows).
  absl::Status CopyTokens(kv_cache::BlockId block, const kv_cache::KvLayout& layout,
                          int64_t tokens_per_block, int64_t slot, int64_t tokens, char* keys,
                          char* values, cudaMemcpyKind kind) const;

  const int device_;
  const std::string name_;
  char* blocks_ = nullptr;
  cudaStream_t stream_ = nullptr;
  // Attend's block tables, queries and outputs, laid out once per call (Arena).
  PinnedBuffer host_staging_;
  DeviceBuffer device_staging_;
  int sm_major_ = 0;
  CudnnPagedContext cudnn_;
  std::atomic<int64_t> cudnn_steps_{0}, kernel_steps_{0};
};

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_CUDA_KV_STORAGE_H_

// The bytes of a paged KV pool where a backend keeps memory (host memory for the CPU, device
// memory for a GPU), and the decode attention over them. The block pool (block_pool.h) says
// which blocks hold what; a KvStorage holds the blocks. Backend::CreateKvStorage makes one.
#ifndef ATTENTION_CORE_KV_CACHE_KV_STORAGE_H_
#define ATTENTION_CORE_KV_CACHE_KV_STORAGE_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "core/kv_cache/block_pool.h"
#include "core/kv_cache/paged_batch.h"

namespace attention::core::kv_cache {

// Thread-compatible: the session table serializes its calls, except that a storage whose
// attends_concurrently() is true may run Attend on several threads at once, beside writes
// to blocks those calls do not read.
class KvStorage {
 public:
  KvStorage(int64_t num_blocks, int64_t block_bytes)
      : num_blocks_(num_blocks), block_bytes_(block_bytes) {}
  virtual ~KvStorage() = default;

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_bytes() const { return block_bytes_; }
  // Where the blocks are: "cpu", "cuda:0".
  virtual const std::string& device() const = 0;

  // Token slots [slot, slot + tokens) of `block` (a block of `layout` holding
  // tokens_per_block tokens), every KV head: keys [Hkv][tokens][dk] and values
  // [Hkv][tokens][dv] in host memory, elements of the layout's dtype.
  virtual absl::Status WriteTokens(BlockId block, const KvLayout& layout, int64_t tokens_per_block,
                                   int64_t slot, int64_t tokens, const void* keys,
                                   const void* values) = 0;
  virtual absl::Status ReadTokens(BlockId block, const KvLayout& layout, int64_t tokens_per_block,
                                  int64_t slot, int64_t tokens, void* keys, void* values) const = 0;
  // Every byte of one block, from or to `bytes` (block_bytes of host memory): a session
  // snapshot's copy.
  virtual absl::Status ReadBlock(BlockId block, void* bytes) const = 0;
  virtual absl::Status WriteBlock(BlockId block, const void* bytes) = 0;
  // Every byte of block `from` to block `to` (a copy-on-write).
  virtual absl::Status CopyBlock(BlockId from, BlockId to) = 0;
  // Fills a freed block with all-ones bytes, a NaN in float32 and bfloat16 alike, so that a
  // read outside a block table shows.
  virtual absl::Status Poison(BlockId block) = 0;
  // The paged decode attention of `batch` (PagedDecodeCpu's semantics) over these blocks:
  // the storage field is this object's; queries, outputs, log-sum-exps and block tables
  // are host memory. Outputs are ready when it returns.
  virtual absl::Status Attend(const PagedDecodeBatch& batch) = 0;
  // Whether Attend may run on several threads at once (it then keeps no state of its own).
  virtual bool attends_concurrently() const { return false; }
  // Attend calls since start by the path that ran them, where a storage has several (a
  // GPU's: "cudnn", cuDNN's paged SDPA, and "kernels", the project's); empty otherwise.
  virtual std::map<std::string, int64_t> AttendCallsByPath() const { return {}; }

 private:
  const int64_t num_blocks_;
  const int64_t block_bytes_;
};

}  // namespace attention::core::kv_cache

#endif  // ATTENTION_CORE_KV_CACHE_KV_STORAGE_H_

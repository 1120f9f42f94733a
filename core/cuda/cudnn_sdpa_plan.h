// Which attention calls the CUDA backend hands to cuDNN's fused SDPA (issue 40), and how
// their graphs are keyed and cached: pure host-side logic, built into every configuration
// so that machines without a GPU test it. The plugin's cudnn_sdpa.cc builds and runs the
// graphs.
//
// A call runs on cuDNN when it is a BFLOAT16 layer's (its products already round Q, K, the
// probabilities and V to bf16), or a scaled dot-product attention call in BFLOAT16 or
// FLOAT16 (the same in that type, as PyTorch's SDPA on such tensors), and cuDNN can express
// all of it: no attention weights asked
// for, no dropout (the service's counter-based dropout is its own), head sizes that are
// multiples of 8 up to 128, and masks that are causal (bottom-right), a sliding window with
// causal (cuDNN's diagonal band), key lengths or right-padding key masks (cuDNN's padding
// lengths; not with causal, whose frontier the service aligns to the padded length), or none.
// Everything else stays on the project's kernels.
//
// Graphs are built for sequence-length buckets, not exact lengths: Q, K and V are packed
// into dense [B, H, bucket, d] bf16 buffers and the true lengths go in as cuDNN's padding
// sequence lengths, so one graph serves every length of its bucket (at most 1/8 of padding
// past 64) and a cache of kCudnnSdpaCachedGraphs graphs per stream covers a server's traffic.
#ifndef ATTENTION_CORE_CUDA_CUDNN_SDPA_PLAN_H_
#define ATTENTION_CORE_CUDA_CUDNN_SDPA_PLAN_H_

#include <cstdint>
#include <list>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "core/cuda/launch_plan.h"
#include "core/kv_cache/paged_batch.h"

namespace attention::core::cuda {

// Widest head cuDNN's SDPA is asked to take here (its documented limit for the forward pass
// on Ampere and Hopper at every cuDNN 9 version this project meets).
inline constexpr int64_t kCudnnSdpaMaxHeadDim = 128;
// Graphs kept per stream (least recently used evicted): each holds a compiled plan.
inline constexpr int kCudnnSdpaCachedGraphs = 64;
// cuDNN versions (cudnnGetVersion) from which bottom-right causal masks with padding
// sequence lengths are taken.
inline constexpr int64_t kCudnnSdpaMinVersion = 90500;

// One call, as the backend sees it before launching (DeviceAttentionProblem's facts).
struct CudnnSdpaCall {
  AttentionShape shape;
  bool bf16_products = false;  // a BFLOAT16 layer's call
  bool fp16_products = false;  // a FLOAT16 scaled dot-product attention call
  bool weights = false;        // attention weights asked for
  bool dropout = false;
  bool causal = false;
  int64_t sliding_window = 0;  // with causal; 0: none
  // Valid keys per sequence ([B]; see PrefixKeyLengths), or empty: all kv_len keys.
  std::vector<int64_t> key_lengths;
  bool other_masks = false;  // key padding that is no prefix, a keep or additive mask
};

// When key lengths and key padding (host memory; either may be null) leave each sequence of
// `batch` a prefix [0, n_b) of its `kv_len` keys, as a right-padded tokenizer mask does: true
// with `lengths` the n_b, cuDNN's padding lengths. False when some row keeps a key after one
// it drops.
bool PrefixKeyLengths(const int64_t* key_lengths, const uint8_t* key_padding_keep, int64_t batch,
                      int64_t kv_len, std::vector<int64_t>* lengths);

// Empty when cuDNN runs `call` on a GPU of compute capability `sm_major` with cuDNN
// `cudnn_version`; otherwise why not, naming the field.
std::string CudnnSdpaIneligibleReason(const CudnnSdpaCall& call, int sm_major,
                                      int64_t cudnn_version);

// The padded length a graph is built for: 64 at least, then the length rounded up to a
// multiple of a power of two that is at most 1/8 of it (so the padding is at most 1/8).
int64_t CudnnSdpaSequenceBucket(int64_t length);

// What a graph is built for.
struct CudnnSdpaGraphKey {
  int64_t batch = 0, num_heads = 0, num_kv_heads = 0, q_bucket = 0, kv_bucket = 0, head_dim = 0,
          v_head_dim = 0;
  bool causal = false;
  int64_t sliding_window = 0;
  uint32_t scale_bits = 0;  // the float scale's bits: the graph bakes it in
  bool fp16 = false;        // Q, K, V and O in fp16 (else bf16)
  // A session step over a paged pool (CudnnPagedKeyOf), 0 otherwise: the pool's blocks, the
  // elements from one block to the next, tokens per block, and each sequence's page-table
  // entries (kv_bucket = pages * tokens_per_block keys at most).
  int64_t num_blocks = 0, block_elements = 0, tokens_per_block = 0, pages = 0;

  bool paged() const { return pages > 0; }
  auto Tie() const {
    return std::tie(batch, num_heads, num_kv_heads, q_bucket, kv_bucket, head_dim, v_head_dim,
                    causal, sliding_window, scale_bits, fp16, num_blocks, block_elements,
                    tokens_per_block, pages);
  }
  bool operator<(const CudnnSdpaGraphKey& other) const { return Tie() < other.Tie(); }
  bool operator==(const CudnnSdpaGraphKey& other) const { return Tie() == other.Tie(); }
};
CudnnSdpaGraphKey CudnnSdpaKeyOf(const CudnnSdpaCall& call, float scale);

// A session step over the paged KV pool of a GPU (CudaKvStorage::Attend) on cuDNN's paged
// SDPA: sequences whose n new queries attend to their L cached keys through a page table of
// the pool's blocks, in place (a block holds, per KV head, tokens_per_block key rows and then
// as many value rows: two strided containers over the one pool). Taken for the steps of
// BFLOAT16 layers over bfloat16 KV (PagedDecodeBatch::bf16_products) with head sizes cuDNN
// takes, no log-sum-exps asked for, and no forks of one prefix in the batch (this project's
// kernel reads a shared prefix once for them all). Queries and answers travel as
// [batch][q_bucket][H][d] bf16 (cuDNN's BSHD strides), the batch padded to a power of two
// with one-key sequences whose answers are dropped.
struct CudnnPagedCall {
  int64_t num_heads = 1, num_kv_heads = 1, head_dim = 1, v_head_dim = 1;
  bool bf16_kv = false;          // the pool holds bfloat16 keys and values
  bool bf16_products = false;    // PagedDecodeBatch::bf16_products
  bool log_sum_exp = false;      // some sequence asks for its log-sum-exps
  bool shared_prefixes = false;  // forks of one prefix (FindSharedPrefixes) in the batch
  int64_t tokens_per_block = 1, block_bytes = 2, num_blocks = 1;
  uint64_t storage_address = 0;
  int64_t sliding_window = 0;
  std::vector<int64_t> lengths;      // L of each sequence
  std::vector<int64_t> num_queries;  // n of each sequence
};

// Empty when cuDNN runs `call` on a GPU of compute capability `sm_major` with cuDNN
// `cudnn_version`; otherwise why not, naming the field.
std::string CudnnPagedIneligibleReason(const CudnnPagedCall& call, int sm_major,
                                       int64_t cudnn_version);

// The graph of an eligible call: the batch padded to a power of two, q_bucket 1 for a batch
// of decode steps (cuDNN's decode path) or the bucket of the most queries, and the pages of
// the bucket of the longest sequence.
CudnnSdpaGraphKey CudnnPagedKeyOf(const CudnnPagedCall& call, float scale);

// Writes the int32 arrays a paged graph reads for `sequences` (block tables in host memory):
// their true query counts and lengths (cuDNN's padding sequence lengths, [key.batch] each)
// and their page tables ([key.batch][key.pages], entry p the block of keys
// [p * tpb, (p + 1) * tpb)). Padding sequences and pages past a sequence's end read block 0
// and are masked by the lengths.
void WriteCudnnPagedArrays(const CudnnSdpaGraphKey& key,
                           absl::Span<const PagedDecodeSequence> sequences, int32_t* q_lengths,
                           int32_t* kv_lengths, int32_t* page_table);

// Elements of a dense [batch, heads, bucket, dim] packed tensor.
inline int64_t CudnnSdpaPackedElements(int64_t batch, int64_t heads, int64_t bucket, int64_t dim) {
  return batch * heads * bucket * dim;
}

// A least-recently-used map of at most `capacity` entries; not thread-safe (one per stream).
template <typename Value>
class BoundedGraphCache {
 public:
  explicit BoundedGraphCache(int capacity) : capacity_(capacity) {}

  // The entry of `key`, now the most recently used; null when absent.
  Value* Find(const CudnnSdpaGraphKey& key) {
    auto found = entries_.find(key);
    if (found == entries_.end()) return nullptr;
    order_.splice(order_.begin(), order_, found->second.second);
    return &found->second.first;
  }

  // Adds `value` for `key` (absent), evicting the least recently used past capacity.
  Value& Add(const CudnnSdpaGraphKey& key, Value value) {
    order_.push_front(key);
    auto [entry, added] = entries_.emplace(key, std::make_pair(std::move(value), order_.begin()));
    if (static_cast<int>(entries_.size()) > capacity_) {
      entries_.erase(order_.back());
      order_.pop_back();
    }
    return entry->second.first;
  }

  int size() const { return static_cast<int>(entries_.size()); }

 private:
  const int capacity_;
  std::list<CudnnSdpaGraphKey> order_;  // most recently used first
  std::map<CudnnSdpaGraphKey, std::pair<Value, std::list<CudnnSdpaGraphKey>::iterator>> entries_;
};

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_CUDNN_SDPA_PLAN_H_

#include "core/cuda/cudnn_sdpa_plan.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

namespace attention::core::cuda {
namespace {

// Why cuDNN `cudnn_version` on a GPU of compute capability `sm_major` runs no SDPA, or "".
std::string DeviceIneligibleReason(int sm_major, int64_t cudnn_version) {
  if (cudnn_version < kCudnnSdpaMinVersion) {
    return "cuDNN " + std::to_string(cudnn_version) + " is older than " +
           std::to_string(kCudnnSdpaMinVersion);
  }
  if (sm_major < 8) {
    return "compute capability " + std::to_string(sm_major) + ".x: cuDNN's SDPA needs 8.0";
  }
  return "";
}

// Why cuDNN takes no call of these heads, or "".
std::string HeadsIneligibleReason(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t v_head_dim) {
  for (const auto& [name, dim] : {std::pair<const char*, int64_t>{"head_dim", head_dim},
                                  std::pair<const char*, int64_t>{"v_head_dim", v_head_dim}}) {
    if (dim % 8 != 0 || dim > kCudnnSdpaMaxHeadDim) {
      return std::string(name) + " " + std::to_string(dim) + ": cuDNN takes multiples of 8 up to " +
             std::to_string(kCudnnSdpaMaxHeadDim);
    }
  }
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) {
    return "num_heads " + std::to_string(num_heads) + " not a multiple of num_kv_heads " +
           std::to_string(num_kv_heads);
  }
  return "";
}

}  // namespace

std::string CudnnSdpaIneligibleReason(const CudnnSdpaCall& call, int sm_major,
                                      int64_t cudnn_version) {
  const AttentionShape& s = call.shape;
  if (std::string why = DeviceIneligibleReason(sm_major, cudnn_version); !why.empty()) return why;
  if (!call.bf16_products && !call.fp16_products) {
    return "compute precision float32: cuDNN's SDPA is bf16 or fp16";
  }
  if (call.weights) return "need_weights: cuDNN's SDPA returns no attention weights";
  if (call.dropout) return "dropout_p > 0: the service's dropout is its own";
  if (call.other_masks) {
    return "key padding that keeps a key after one it drops, or an attention mask: only causal, "
           "sliding-window, key-length and right-padding masks go to cuDNN";
  }
  if (!call.key_lengths.empty()) {
    if (call.causal) {
      return "key_lengths with causal: the frontier is aligned to kv_len, cuDNN's to each length";
    }
    for (int64_t b = 0; b < s.batch; ++b) {
      if (call.key_lengths[b] < 1) {
        return "key_lengths[" + std::to_string(b) + "] = " + std::to_string(call.key_lengths[b]) +
               ": rows with no key";
      }
    }
  }
  if (call.sliding_window > 0 && !call.causal) return "sliding_window without causal";
  if (call.causal && s.q_len > s.kv_len) {
    return "causal with q_len " + std::to_string(s.q_len) + " > kv_len " +
           std::to_string(s.kv_len) + ": rows with no key";
  }
  return HeadsIneligibleReason(s.num_heads, s.num_kv_heads, s.head_dim, s.v_head_dim);
}

bool PrefixKeyLengths(const int64_t* key_lengths, const uint8_t* key_padding_keep, int64_t batch,
                      int64_t kv_len, std::vector<int64_t>* lengths) {
  lengths->clear();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t limit = key_lengths == nullptr ? kv_len : std::min(key_lengths[b], kv_len);
    int64_t kept = limit;
    if (key_padding_keep != nullptr) {
      const uint8_t* row = key_padding_keep + b * kv_len;
      kept = std::find(row, row + limit, uint8_t{0}) - row;
      if (std::find(row + kept, row + limit, uint8_t{1}) != row + limit) return false;
    }
    lengths->push_back(kept);
  }
  return true;
}

int64_t CudnnSdpaSequenceBucket(int64_t length) {
  constexpr int64_t kSmallest = 64;
  if (length <= kSmallest) return kSmallest;
  int64_t step = 1;
  while (step * 16 <= length) step *= 2;  // the largest power of two <= length / 8
  return (length + step - 1) / step * step;
}

CudnnSdpaGraphKey CudnnSdpaKeyOf(const CudnnSdpaCall& call, float scale) {
  CudnnSdpaGraphKey key;
  key.batch = call.shape.batch;
  key.num_heads = call.shape.num_heads;
  key.num_kv_heads = call.shape.num_kv_heads;
  key.q_bucket = CudnnSdpaSequenceBucket(call.shape.q_len);
  key.kv_bucket = CudnnSdpaSequenceBucket(call.shape.kv_len);
  key.head_dim = call.shape.head_dim;
  key.v_head_dim = call.shape.v_head_dim;
  key.causal = call.causal;
  key.sliding_window = call.sliding_window;
  std::memcpy(&key.scale_bits, &scale, sizeof(scale));
  key.fp16 = call.fp16_products;
  return key;
}

std::string CudnnPagedIneligibleReason(const CudnnPagedCall& call, int sm_major,
                                       int64_t cudnn_version) {
  if (std::string why = DeviceIneligibleReason(sm_major, cudnn_version); !why.empty()) return why;
  if (!call.bf16_kv) return "float32 KV: cuDNN's SDPA is bf16 or fp16";
  if (!call.bf16_products) {
    return "a session that computes in float32 (no BFLOAT16 layer): cuDNN rounds the queries "
           "and probabilities to bf16";
  }
  if (call.log_sum_exp) return "log-sum-exps asked for: the project's kernel returns them";
  if (call.shared_prefixes) return "forks of one prefix: the project's kernel reads it once";
  if (std::string why =
          HeadsIneligibleReason(call.num_heads, call.num_kv_heads, call.head_dim, call.v_head_dim);
      !why.empty()) {
    return why;
  }
  // cuDNN reads 16-byte rows: the pool, each block and each key and value row start aligned.
  if (call.block_bytes % 16 != 0 || call.storage_address % 16 != 0) {
    return "block_bytes " + std::to_string(call.block_bytes) +
           " or the pool's address not 16-byte aligned";
  }
  if (call.num_blocks > std::numeric_limits<int32_t>::max()) {
    return "num_blocks " + std::to_string(call.num_blocks) + ": page tables are int32";
  }
  if (call.lengths.empty() || call.lengths.size() != call.num_queries.size()) {
    return "no sequences";
  }
  for (size_t b = 0; b < call.lengths.size(); ++b) {
    if (call.lengths[b] > std::numeric_limits<int32_t>::max()) {
      return "lengths[" + std::to_string(b) + "] = " + std::to_string(call.lengths[b]) +
             ": lengths are int32";
    }
  }
  return "";
}

CudnnSdpaGraphKey CudnnPagedKeyOf(const CudnnPagedCall& call, float scale) {
  CudnnSdpaGraphKey key;
  key.batch = 1;
  while (key.batch < static_cast<int64_t>(call.lengths.size())) key.batch *= 2;
  key.num_heads = call.num_heads;
  key.num_kv_heads = call.num_kv_heads;
  const int64_t most_queries = *std::max_element(call.num_queries.begin(), call.num_queries.end());
  key.q_bucket = most_queries == 1 ? 1 : CudnnSdpaSequenceBucket(most_queries);
  const int64_t longest = *std::max_element(call.lengths.begin(), call.lengths.end());
  key.tokens_per_block = call.tokens_per_block;
  key.pages =
      (CudnnSdpaSequenceBucket(longest) + call.tokens_per_block - 1) / call.tokens_per_block;
  key.kv_bucket = key.pages * call.tokens_per_block;
  key.num_blocks = call.num_blocks;
  key.block_elements = call.block_bytes / 2;
  key.head_dim = call.head_dim;
  key.v_head_dim = call.v_head_dim;
  // One query per sequence sees every key it holds; more see them bottom-right aligned, as
  // does a window (cuDNN's band is aligned to the top left otherwise).
  key.causal = key.q_bucket > 1 || call.sliding_window > 0;
  key.sliding_window = call.sliding_window;
  std::memcpy(&key.scale_bits, &scale, sizeof(scale));
  return key;
}

void WriteCudnnPagedArrays(const CudnnSdpaGraphKey& key,
                           absl::Span<const PagedDecodeSequence> sequences, int32_t* q_lengths,
                           int32_t* kv_lengths, int32_t* page_table) {
  std::fill(q_lengths, q_lengths + key.batch, 1);
  std::fill(kv_lengths, kv_lengths + key.batch, 1);
  std::fill(page_table, page_table + key.batch * key.pages, 0);
  for (size_t b = 0; b < sequences.size(); ++b) {
    const PagedDecodeSequence& s = sequences[b];
    q_lengths[b] = static_cast<int32_t>(s.num_queries);
    kv_lengths[b] = static_cast<int32_t>(s.length);
    const int64_t used = (s.length + key.tokens_per_block - 1) / key.tokens_per_block;
    std::copy(s.block_table.begin(), s.block_table.begin() + used,
              page_table + static_cast<int64_t>(b) * key.pages);
  }
}

}  // namespace attention::core::cuda

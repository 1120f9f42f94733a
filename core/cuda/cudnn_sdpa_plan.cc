#include "core/cuda/cudnn_sdpa_plan.h"

#include <algorithm>
#include <cstring>

namespace attention::core::cuda {

std::string CudnnSdpaIneligibleReason(const CudnnSdpaCall& call, int sm_major,
                                      int64_t cudnn_version) {
  const AttentionShape& s = call.shape;
  if (cudnn_version < kCudnnSdpaMinVersion) {
    return "cuDNN " + std::to_string(cudnn_version) + " is older than " +
           std::to_string(kCudnnSdpaMinVersion);
  }
  if (sm_major < 8) {
    return "compute capability " + std::to_string(sm_major) + ".x: cuDNN's SDPA needs 8.0";
  }
  if (!call.bf16_products) return "compute precision float32: cuDNN's SDPA is bf16 or fp16";
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
  for (const auto& [name, dim] : {std::pair<const char*, int64_t>{"head_dim", s.head_dim},
                                  std::pair<const char*, int64_t>{"v_head_dim", s.v_head_dim}}) {
    if (dim % 8 != 0 || dim > kCudnnSdpaMaxHeadDim) {
      return std::string(name) + " " + std::to_string(dim) + ": cuDNN takes multiples of 8 up to " +
             std::to_string(kCudnnSdpaMaxHeadDim);
    }
  }
  if (s.num_kv_heads <= 0 || s.num_heads % s.num_kv_heads != 0) {
    return "num_heads " + std::to_string(s.num_heads) + " not a multiple of num_kv_heads " +
           std::to_string(s.num_kv_heads);
  }
  return "";
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
  return key;
}

}  // namespace attention::core::cuda

// The per-element maths of attention, shared by every backend: which keys a query may
// attend (causal frontier, key lengths, padding, masks), deterministic dropout, the online
// softmax update and rotary angles. Plain structs and inline functions that compile both
// for the host (the CPU backend and the reference call them, and tests check them there)
// and for CUDA devices, so both backends compute the same masks and drop the same weights.
#ifndef ATTENTION_CORE_ATTENTION_MATH_H_
#define ATTENTION_CORE_ATTENTION_MATH_H_

#include <cmath>
#include <cstdint>

#include "core/hash.h"
#include "core/host_device.h"

namespace attention::core {

// Sizes and element masks of one attention call, as raw pointers so that a kernel can take
// it by value. Pointers are null when that mask is absent; they point to host or device
// memory depending on who reads them.
struct MaskView {
  int64_t batch = 1, num_heads = 1, q_len = 1, kv_len = 1;
  // Bottom-right aligned: query i attends key j iff j <= i + (Nk - Nq).
  bool causal = false;
  const int64_t* key_lengths = nullptr;       // [B], each in [0, Nk]
  const uint8_t* key_padding_keep = nullptr;  // [B, Nk], 1 = attend
  // The explicit mask, broadcast from these dims (each 1 or the full size) to [B, H, Nq, Nk]:
  // a keep mask (1 = attend) or an additive bias, at most one of them.
  int64_t attn_mask_dims[4] = {1, 1, 1, 1};
  const uint8_t* attn_mask_keep = nullptr;
  const float* attn_mask_bias = nullptr;

  // Keys row i may attend before any element mask: the causal frontier and key length.
  ATTENTION_HOST_DEVICE int64_t KeyLimit(int64_t b, int64_t i) const {
    int64_t limit = kv_len;
    if (causal) {
      const int64_t frontier = i + (kv_len - q_len) + 1;
      limit = frontier < 0 ? 0 : (frontier < limit ? frontier : limit);
    }
    if (key_lengths != nullptr && key_lengths[b] < limit) limit = key_lengths[b];
    return limit;
  }

  ATTENTION_HOST_DEVICE bool HasElementMasks() const {
    return key_lengths != nullptr || key_padding_keep != nullptr || attn_mask_keep != nullptr ||
           attn_mask_bias != nullptr;
  }

  // What is added to the scaled score of (b, h, i, j): 0, -inf (masked) or the float mask.
  ATTENTION_HOST_DEVICE float ScoreBias(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const float masked = -INFINITY;
    if (j >= KeyLimit(b, i)) return masked;
    if (key_padding_keep != nullptr && !key_padding_keep[b * kv_len + j]) return masked;
    if (attn_mask_keep == nullptr && attn_mask_bias == nullptr) return 0.0f;
    const int64_t index[4] = {b, h, i, j};
    int64_t offset = 0;
    for (int d = 0; d < 4; ++d) {
      offset = offset * attn_mask_dims[d] + (attn_mask_dims[d] == 1 ? 0 : index[d]);
    }
    if (attn_mask_keep != nullptr) return attn_mask_keep[offset] ? 0.0f : masked;
    return attn_mask_bias[offset];
  }
};

// Deterministic dropout: whether the weight at (b, h, i, j) survives, from a counter-based
// hash of the seed and the position, so results never depend on threads, batching or the
// backend.
ATTENTION_HOST_DEVICE inline bool DropoutKeeps(uint64_t seed, float p, int64_t b, int64_t h,
                                               int64_t i, int64_t j) {
  if (p <= 0.0f) return true;
  uint64_t x = Mix64(seed ^ 0x9e3779b97f4a7c15ULL);
  x = Mix64(x + static_cast<uint64_t>(b));
  x = Mix64(x + static_cast<uint64_t>(h));
  x = Mix64(x + static_cast<uint64_t>(i));
  x = Mix64(x + static_cast<uint64_t>(j));
  return UnitInterval(x) >= p;
}

// The running state of one query row's online softmax (flash-style): the largest score
// seen and the sum of exp(score - max) over the keys seen.
struct OnlineSoftmaxRow {
  float max = -INFINITY;
  float sum = 0.0f;

  // Takes a block whose largest (masked) score is `block_max` and returns the factor by
  // which everything accumulated against the old maximum must be scaled. A block with
  // nothing to attend (block_max = -inf) changes nothing and returns 1.
  ATTENTION_HOST_DEVICE float Rescale(float block_max) {
    if (!(block_max > max)) return 1.0f;
    const float correction = max == -INFINITY ? 0.0f : expf(max - block_max);
    sum *= correction;
    max = block_max;
    return correction;
  }
  // The normaliser of the accumulated output: 0 for a fully masked row (whose output
  // stays zeros, never NaN).
  ATTENTION_HOST_DEVICE float InverseSum() const { return sum > 0.0f ? 1.0f / sum : 0.0f; }
};

// Rotary position embedding, rotate-half layout (Hugging Face Llama): the cosine and sine
// that rotate channels c and c + dk/2 of a row at `position`.
ATTENTION_HOST_DEVICE inline void RotaryAngle(int64_t position, int64_t channel,
                                              int64_t head_dim, double theta, float* cos_a,
                                              float* sin_a) {
  const double angle =
      static_cast<double>(position) * pow(theta, -2.0 * static_cast<double>(channel) / head_dim);
  *cos_a = static_cast<float>(cos(angle));
  *sin_a = static_cast<float>(sin(angle));
}

}  // namespace attention::core

#endif  // ATTENTION_CORE_ATTENTION_MATH_H_

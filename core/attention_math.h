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
  // Sliding window (with causal): query i attends only keys j > i + (Nk - Nq) - window.
  // 0 = no window.
  int64_t sliding_window = 0;

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
           attn_mask_bias != nullptr || sliding_window > 0;
  }

  // What is added to the scaled score of (b, h, i, j): 0, -inf (masked) or the float mask.
  ATTENTION_HOST_DEVICE float ScoreBias(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const float masked = -INFINITY;
    if (j >= KeyLimit(b, i)) return masked;
    if (sliding_window > 0 && j <= i + (kv_len - q_len) - sliding_window) return masked;
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

// Rotary frequency scaling for long contexts, as Hugging Face's rope_scaling.
struct RopeScaling {
  enum Type : int {
    kNone = 0,
    kLinear = 1,   // every frequency divided by factor
    kDynamic = 2,  // NTK-aware: the base grows with the sequence length (RotaryBase)
    kLlama3 = 3,   // low frequencies divided by factor, high ones kept, a ramp between
  };
  int type = kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  // llama3: the pretraining context; dynamic: max_position_embeddings.
  int64_t original_max_positions = 0;
};

// The rotary base for a sequence of `seq_len` positions: theta, except that dynamic scaling
// enlarges it past original_max_positions (transformers' _compute_dynamic_ntk_parameters).
ATTENTION_HOST_DEVICE inline double RotaryBase(double theta, const RopeScaling& scaling,
                                               int64_t seq_len, int64_t head_dim) {
  if (scaling.type != RopeScaling::kDynamic || seq_len <= scaling.original_max_positions) {
    return theta;
  }
  const double f = scaling.factor;
  const double stretch =
      f * static_cast<double>(seq_len) / static_cast<double>(scaling.original_max_positions) -
      (f - 1.0);
  return theta * pow(stretch, static_cast<double>(head_dim) / (head_dim - 2));
}

// The inverse frequency of channel pair `channel` for rotary base `base`, after scaling
// (transformers' _compute_linear_scaling / _compute_llama3_parameters).
ATTENTION_HOST_DEVICE inline double RotaryInverseFrequency(int64_t channel, int64_t head_dim,
                                                           double base,
                                                           const RopeScaling& scaling) {
  const double frequency = pow(base, -2.0 * static_cast<double>(channel) / head_dim);
  if (scaling.type == RopeScaling::kLinear) return frequency / scaling.factor;
  if (scaling.type != RopeScaling::kLlama3) return frequency;
  const double context = static_cast<double>(scaling.original_max_positions);
  const double wavelength = 2.0 * 3.14159265358979323846 / frequency;
  if (wavelength < context / scaling.high_freq_factor) return frequency;
  if (wavelength > context / scaling.low_freq_factor) return frequency / scaling.factor;
  const double smooth = (context / wavelength - scaling.low_freq_factor) /
                        (scaling.high_freq_factor - scaling.low_freq_factor);
  return (1.0 - smooth) * frequency / scaling.factor + smooth * frequency;
}

// Rotary position embedding, rotate-half layout (Hugging Face Llama): the cosine and sine
// that rotate channels c and c + dk/2 of a row at `position`, for base `base` (RotaryBase).
ATTENTION_HOST_DEVICE inline void RotaryAngle(int64_t position, int64_t channel,
                                              int64_t head_dim, double base,
                                              const RopeScaling& scaling, float* cos_a,
                                              float* sin_a) {
  const double angle =
      static_cast<double>(position) * RotaryInverseFrequency(channel, head_dim, base, scaling);
  *cos_a = static_cast<float>(cos(angle));
  *sin_a = static_cast<float>(sin(angle));
}

}  // namespace attention::core

#endif  // ATTENTION_CORE_ATTENTION_MATH_H_

// Per-request attention options and masks, shared by every kernel variant.
#ifndef ATTENTION_CORE_ATTENTION_OPTIONS_H_
#define ATTENTION_CORE_ATTENTION_OPTIONS_H_

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/attention_math.h"

namespace attention::core {

enum class NeedWeights { kNone, kAveraged, kPerHead };

// Sizes of one attention call: B sequences of Nq queries attending Nk keys, H query heads
// sharing Hkv key/value heads (GQA when Hkv < H).
struct AttentionDims {
  int64_t batch = 1;         // B
  int64_t num_heads = 1;     // H
  int64_t num_kv_heads = 1;  // Hkv, divides H
  int64_t q_len = 1;         // Nq
  int64_t kv_len = 1;        // Nk
  int64_t head_dim = 1;      // dk
  int64_t v_head_dim = 1;    // dv
};

// Grouped-query attention's rule, for layer configs and SDPA inputs alike: kv_heads >= 1
// key/value heads divide the `heads` query heads. The error names both as the fields say.
absl::Status CheckHeadGroups(int64_t heads, int64_t kv_heads, absl::string_view heads_field,
                             absl::string_view kv_heads_field);

// Thread-compatible. Field names match the wire API so validation messages name them.
struct AttentionOptions {
  // Bottom-right aligned: query i attends key j iff j <= i + (Nk - Nq).
  bool causal = false;
  // Empty, or one valid-key count per sequence, each in [0, Nk].
  std::vector<int64_t> key_lengths;
  // Empty, or [B, Nk] with 1 = attend (polarity already resolved).
  std::vector<uint8_t> key_padding_keep;
  // Dims of the explicit mask after right-aligned padding to rank 4; each is 1 or the full
  // size of [B, H, Nq, Nk].
  std::array<int64_t, 4> attn_mask_dims = {1, 1, 1, 1};
  // At most one of these is non-empty: a boolean keep mask (1 = attend) or an additive bias.
  std::vector<uint8_t> attn_mask_keep;
  std::vector<float> attn_mask_bias;
  // Softmax scale; unset means 1/sqrt(dk).
  std::optional<float> scale;
  // Dropout probability on the attention weights, in [0, 1).
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0;
  NeedWeights need_weights = NeedWeights::kNone;
  // Sliding window with causal (see MaskView); set from the layer config, not the wire.
  int64_t sliding_window = 0;

  // Checks every field against `dims`; the error names the field and the values.
  absl::Status Validate(const AttentionDims& dims) const;

  float Scale(const AttentionDims& dims) const;

  // True when some key of some row may be masked by something other than `causal`.
  bool HasElementMasks() const {
    return !key_lengths.empty() || !key_padding_keep.empty() || !attn_mask_keep.empty() ||
           !attn_mask_bias.empty() || sliding_window > 0;
  }

  // The options of sequences [first, first + count) alone, of a batch of `dims.batch`
  // attending `dims.kv_len` keys: their key lengths, padding rows and blocks of the explicit
  // mask (a mask shared by the batch is copied whole). Dropout's pattern follows the batch
  // index: not for dropout_p > 0.
  AttentionOptions Sequences(const AttentionDims& dims, int64_t first, int64_t count) const;
  AttentionOptions OneSequence(const AttentionDims& dims, int64_t b) const {
    return Sequences(dims, b, 1);
  }
  // Whether a batch with these options may run in pieces of whole sequences: no attention
  // weights, no dropout, and no explicit mask shared by the whole batch (each piece would
  // copy it).
  bool SplitsBetweenSequences() const;
  // The masks as every kernel reads them (see core/attention_math.h), pointing into this
  // object: valid while it lives unchanged.
  MaskView View(const AttentionDims& dims) const;

  // What is added to the scaled score of (b, h, i, j): 0, -inf (masked) or the float mask.
  float ScoreBias(const AttentionDims& dims, int64_t b, int64_t h, int64_t i, int64_t j) const {
    return View(dims).ScoreBias(b, h, i, j);
  }

  // Number of keys row i may attend before any element mask (the causal frontier).
  int64_t KeyLimit(const AttentionDims& dims, int64_t b, int64_t i) const {
    return View(dims).KeyLimit(b, i);
  }
};

}  // namespace attention::core

#endif  // ATTENTION_CORE_ATTENTION_OPTIONS_H_

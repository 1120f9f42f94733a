#include "core/attention_options.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attention::core {

absl::Status AttentionOptions::Validate(const AttentionDims& dims) const {
  if (!key_lengths.empty()) {
    if (static_cast<int64_t>(key_lengths.size()) != dims.batch) {
      return absl::InvalidArgumentError(absl::StrCat("options.key_lengths has ",
                                                     key_lengths.size(),
                                                     " values; expected batch size ", dims.batch));
    }
    for (size_t b = 0; b < key_lengths.size(); ++b) {
      if (key_lengths[b] < 0 || key_lengths[b] > dims.kv_len) {
        return absl::InvalidArgumentError(absl::StrCat("options.key_lengths[", b, "] = ",
                                                       key_lengths[b], " is outside [0, ",
                                                       dims.kv_len, "] (Nk)"));
      }
    }
  }
  if (!key_padding_keep.empty() &&
      static_cast<int64_t>(key_padding_keep.size()) != dims.batch * dims.kv_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.key_padding_mask has ", key_padding_keep.size(), " elements; expected [B, Nk] = [",
        dims.batch, ", ", dims.kv_len, "]"));
  }
  if (!attn_mask_keep.empty() && !attn_mask_bias.empty()) {
    return absl::InvalidArgumentError("options.attn_mask: both a bool and a float mask given");
  }
  if (!attn_mask_keep.empty() || !attn_mask_bias.empty()) {
    const std::array<int64_t, 4> full = {dims.batch, dims.num_heads, dims.q_len, dims.kv_len};
    int64_t count = 1;
    for (int d = 0; d < 4; ++d) {
      if (attn_mask_dims[d] != 1 && attn_mask_dims[d] != full[d]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "options.attn_mask shape [", absl::StrJoin(attn_mask_dims, ", "),
            "] is not broadcastable to [B, H, Nq, Nk] = [", absl::StrJoin(full, ", "), "]"));
      }
      count *= attn_mask_dims[d];
    }
    const size_t given = std::max(attn_mask_keep.size(), attn_mask_bias.size());
    if (static_cast<int64_t>(given) != count) {
      return absl::InvalidArgumentError(absl::StrCat("options.attn_mask has ", given,
                                                     " elements; its shape needs ", count));
    }
  }
  if (scale.has_value() && !std::isfinite(*scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.scale = ", *scale, " is not finite"));
  }
  if (!(dropout_p >= 0.0f && dropout_p < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.dropout_p = ", dropout_p, " is outside [0, 1)"));
  }
  return absl::OkStatus();
}

float AttentionOptions::Scale(const AttentionDims& dims) const {
  return scale.has_value() ? *scale : 1.0f / std::sqrt(static_cast<float>(dims.head_dim));
}

int64_t AttentionOptions::KeyLimit(const AttentionDims& dims, int64_t b, int64_t i) const {
  int64_t limit = dims.kv_len;
  if (causal) limit = std::clamp<int64_t>(i + (dims.kv_len - dims.q_len) + 1, 0, limit);
  if (!key_lengths.empty()) limit = std::min(limit, key_lengths[b]);
  return limit;
}

float AttentionOptions::ScoreBias(const AttentionDims& dims, int64_t b, int64_t h, int64_t i,
                                  int64_t j) const {
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  if (j >= KeyLimit(dims, b, i)) return kMasked;
  if (!key_padding_keep.empty() && !key_padding_keep[b * dims.kv_len + j]) return kMasked;
  if (attn_mask_keep.empty() && attn_mask_bias.empty()) return 0.0f;
  const std::array<int64_t, 4> index = {b, h, i, j};
  int64_t offset = 0;
  for (int d = 0; d < 4; ++d) {
    offset = offset * attn_mask_dims[d] + (attn_mask_dims[d] == 1 ? 0 : index[d]);
  }
  if (!attn_mask_keep.empty()) return attn_mask_keep[offset] ? 0.0f : kMasked;
  return attn_mask_bias[offset];
}

bool DropoutKeeps(uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (p <= 0.0f) return true;
  uint64_t x = Mix64(seed ^ 0x9e3779b97f4a7c15ULL);
  x = Mix64(x + static_cast<uint64_t>(b));
  x = Mix64(x + static_cast<uint64_t>(h));
  x = Mix64(x + static_cast<uint64_t>(i));
  x = Mix64(x + static_cast<uint64_t>(j));
  const double uniform = UnitInterval(x);
  return uniform >= p;
}

}  // namespace attention::core

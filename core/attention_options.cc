#include "core/attention_options.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attention::core {

absl::Status CheckHeadGroups(int64_t heads, int64_t kv_heads, absl::string_view heads_field,
                             absl::string_view kv_heads_field) {
  if (kv_heads >= 1 && heads % kv_heads == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(kv_heads_field, " = ", kv_heads,
                                                 " must be >= 1 and divide ", heads_field,
                                                 " = ", heads));
}

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

AttentionOptions AttentionOptions::Sequences(const AttentionDims& dims, int64_t first,
                                             int64_t count) const {
  AttentionOptions some;
  some.causal = causal;
  some.scale = scale;
  some.dropout_p = dropout_p;
  some.dropout_seed = dropout_seed;
  some.need_weights = need_weights;
  some.sliding_window = sliding_window;
  if (!key_lengths.empty()) {
    some.key_lengths.assign(key_lengths.begin() + first, key_lengths.begin() + first + count);
  }
  if (!key_padding_keep.empty()) {
    const auto begin = key_padding_keep.begin() + first * dims.kv_len;
    some.key_padding_keep.assign(begin, begin + count * dims.kv_len);
  }
  some.attn_mask_dims = attn_mask_dims;
  const bool per_sequence = attn_mask_dims[0] != 1;
  some.attn_mask_dims[0] = per_sequence ? count : 1;
  const int64_t block = attn_mask_dims[1] * attn_mask_dims[2] * attn_mask_dims[3];
  const int64_t offset = per_sequence ? first * block : 0;
  const int64_t length = per_sequence ? count * block : block;
  if (!attn_mask_keep.empty()) {
    some.attn_mask_keep.assign(attn_mask_keep.begin() + offset,
                               attn_mask_keep.begin() + offset + length);
  }
  if (!attn_mask_bias.empty()) {
    some.attn_mask_bias.assign(attn_mask_bias.begin() + offset,
                               attn_mask_bias.begin() + offset + length);
  }
  return some;
}

bool AttentionOptions::SplitsBetweenSequences() const {
  const bool shared_mask =
      attn_mask_dims[0] == 1 && !(attn_mask_keep.empty() && attn_mask_bias.empty());
  return need_weights == NeedWeights::kNone && dropout_p == 0.0f && !shared_mask;
}

MaskView AttentionOptions::View(const AttentionDims& dims) const {
  MaskView view;
  view.batch = dims.batch;
  view.num_heads = dims.num_heads;
  view.q_len = dims.q_len;
  view.kv_len = dims.kv_len;
  view.causal = causal;
  view.key_lengths = key_lengths.empty() ? nullptr : key_lengths.data();
  view.key_padding_keep = key_padding_keep.empty() ? nullptr : key_padding_keep.data();
  for (int d = 0; d < 4; ++d) view.attn_mask_dims[d] = attn_mask_dims[d];
  view.attn_mask_keep = attn_mask_keep.empty() ? nullptr : attn_mask_keep.data();
  view.attn_mask_bias = attn_mask_bias.empty() ? nullptr : attn_mask_bias.data();
  view.sliding_window = sliding_window;
  return view;
}

}  // namespace attention::core

#include "core/attention_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace attention::core {

void AttentionReference(const AttentionProblem& p) {
  const AttentionOptions& options = *p.options;
  const AttentionDims& d = p.dims;
  const double scale = options.Scale(d);
  const double keep_scale = 1.0 / (1.0 - options.dropout_p);
  std::vector<double> scores(d.kv_len);
  std::vector<double> accumulator(d.v_head_dim);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.num_heads; ++h) {
      const int64_t hk = KvHead(d, h);
      for (int64_t i = 0; i < d.q_len; ++i) {
        const float* q = p.query + p.query_layout.Offset(b, h, i);
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < d.kv_len; ++j) {
          const float bias = options.ScoreBias(d, b, h, i, j);
          if (bias == -std::numeric_limits<float>::infinity()) {
            scores[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          const float* k = p.key + p.key_layout.Offset(b, hk, j);
          double dot = 0.0;
          for (int64_t c = 0; c < d.head_dim; ++c) dot += static_cast<double>(q[c]) * k[c];
          scores[j] = dot * scale + bias;
          max_score = std::max(max_score, scores[j]);
        }
        const bool fully_masked = max_score == -std::numeric_limits<double>::infinity();
        double sum = 0.0;
        for (int64_t j = 0; j < d.kv_len && !fully_masked; ++j) {
          scores[j] = std::exp(scores[j] - max_score);
          sum += scores[j];
        }
        std::fill(accumulator.begin(), accumulator.end(), 0.0);
        for (int64_t j = 0; j < d.kv_len; ++j) {
          double weight = fully_masked ? 0.0 : scores[j] / sum;
          if (!DropoutKeeps(options.dropout_seed, options.dropout_p, b, h, i, j)) {
            weight = 0.0;
          } else {
            weight *= keep_scale;
          }
          if (p.weights != nullptr) {
            p.weights[((b * d.num_heads + h) * d.q_len + i) * d.kv_len + j] =
                static_cast<float>(weight);
          }
          if (weight == 0.0) continue;
          const float* v = p.value + p.value_layout.Offset(b, hk, j);
          for (int64_t c = 0; c < d.v_head_dim; ++c) accumulator[c] += weight * v[c];
        }
        float* out = p.output + p.output_layout.Offset(b, h, i);
        for (int64_t c = 0; c < d.v_head_dim; ++c) out[c] = static_cast<float>(accumulator[c]);
      }
    }
  }
}

std::vector<float> AverageHeads(absl::Span<const float> per_head, const AttentionDims& d) {
  std::vector<float> averaged(d.batch * d.q_len * d.kv_len, 0.0f);
  const int64_t plane = d.q_len * d.kv_len;
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.num_heads; ++h) {
      const float* src = per_head.data() + (b * d.num_heads + h) * plane;
      float* dst = averaged.data() + b * plane;
      for (int64_t e = 0; e < plane; ++e) dst[e] += src[e] / d.num_heads;
    }
  }
  return averaged;
}

void FinishWeights(AttentionResult& result, const AttentionDims& dims, NeedWeights need) {
  if (need == NeedWeights::kAveraged) result.weights = AverageHeads(result.weights, dims);
}

AttentionProblem SdpaProblem(const SdpaInput& in, AttentionResult& result) {
  const AttentionDims& d = in.dims;
  AttentionProblem p;
  p.dims = d;
  p.query = in.query.data();
  p.query_layout = HeadLayout::BatchHeadRow(d.num_heads, d.q_len, d.head_dim);
  p.key = in.key.data();
  p.key_layout = HeadLayout::BatchHeadRow(d.num_kv_heads, d.kv_len, d.head_dim);
  p.value = in.value.data();
  p.value_layout = HeadLayout::BatchHeadRow(d.num_kv_heads, d.kv_len, d.v_head_dim);
  p.output = result.output.data();
  p.output_layout = HeadLayout::BatchHeadRow(d.num_heads, d.q_len, d.v_head_dim);
  p.weights = result.weights.empty() ? nullptr : result.weights.data();
  p.options = &in.options;
  return p;
}

}  // namespace attention::core

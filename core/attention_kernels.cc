#include "core/attention_kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace attention::core {

template <typename T>
void AttentionTextbook(const AttentionProblemOf<T>& p) {
  const AttentionOptions& options = *p.options;
  const AttentionDims& d = p.dims;
  const T scale = options.Scale(d);
  const T keep_scale = T{1} / (T{1} - options.dropout_p);
  std::vector<T> scores(d.kv_len);
  std::vector<T> accumulator(d.v_head_dim);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < d.num_heads; ++h) {
      const int64_t hk = KvHead(d, h);
      for (int64_t i = 0; i < d.q_len; ++i) {
        const T* q = p.query + p.query_layout.Offset(b, h, i);
        T max_score = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < d.kv_len; ++j) {
          const float bias = options.ScoreBias(d, b, h, i, j);
          if (bias == -std::numeric_limits<float>::infinity()) {
            scores[j] = -std::numeric_limits<T>::infinity();
            continue;
          }
          const T* k = p.key + p.key_layout.Offset(b, hk, j);
          T dot = 0;
          for (int64_t c = 0; c < d.head_dim; ++c) dot += q[c] * k[c];
          scores[j] = dot * scale + bias;
          max_score = std::max(max_score, scores[j]);
        }
        const bool fully_masked = max_score == -std::numeric_limits<T>::infinity();
        T sum = 0;
        for (int64_t j = 0; j < d.kv_len && !fully_masked; ++j) {
          scores[j] = std::exp(scores[j] - max_score);
          sum += scores[j];
        }
        std::fill(accumulator.begin(), accumulator.end(), T{0});
        for (int64_t j = 0; j < d.kv_len; ++j) {
          T weight = fully_masked ? T{0} : scores[j] / sum;
          if (!DropoutKeeps(options.dropout_seed, options.dropout_p, b, h, i, j)) {
            weight = 0;
          } else {
            weight *= keep_scale;
          }
          if (p.weights != nullptr) {
            p.weights[((b * d.num_heads + h) * d.q_len + i) * d.kv_len + j] = weight;
          }
          if (weight == 0) continue;
          const T* v = p.value + p.value_layout.Offset(b, hk, j);
          for (int64_t c = 0; c < d.v_head_dim; ++c) accumulator[c] += weight * v[c];
        }
        T* out = p.output + p.output_layout.Offset(b, h, i);
        std::copy(accumulator.begin(), accumulator.end(), out);
      }
    }
  }
}

template void AttentionTextbook<float>(const AttentionProblemOf<float>&);
template void AttentionTextbook<double>(const AttentionProblemOf<double>&);

void FinishWeights(AttentionResult& result, const AttentionDims& dims, NeedWeights need) {
  if (need == NeedWeights::kAveraged) {
    result.weights = AverageHeads(absl::Span<const float>(result.weights), dims);
  }
}

}  // namespace attention::core

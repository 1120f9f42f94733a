#include "core/attention_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <cblas.h>

namespace attention::core {
namespace {

int64_t KvHead(const AttentionDims& dims, int64_t h) {
  return h / (dims.num_heads / dims.num_kv_heads);
}

// exp(x) for x <= 0 with |relative error| < 2e-7; -inf and anything below -87 give 0.
// Written branch-free so the compiler vectorizes it for each target clone.
__attribute__((target_clones("arch=haswell", "default"))) float ExpAndSum(float* values,
                                                                          int64_t count,
                                                                          float shift) {
  float sum = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    const float x = values[j] - shift;
    const float clamped = std::max(x, -87.0f);
    const float t = clamped * 1.44269504088896341f;
    const float n = std::floor(t + 0.5f);
    const float f = (t - n) * 0.693147180559945309f;  // |f| <= ln2/2
    float p = 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;
    float two_to_n;
    std::memcpy(&two_to_n, &exponent_bits, sizeof(two_to_n));
    const float e = x < -87.0f ? 0.0f : p * two_to_n;
    values[j] = e;
    sum += e;
  }
  return sum;
}

__attribute__((target_clones("arch=haswell", "default"))) float RowMax(const float* values,
                                                                       int64_t count) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) m = std::max(m, values[j]);
  return m;
}

__attribute__((target_clones("arch=haswell", "default"))) void ScaleRow(float* values,
                                                                        int64_t count,
                                                                        float factor) {
  for (int64_t j = 0; j < count; ++j) values[j] *= factor;
}

}  // namespace

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

namespace {

int64_t QueryBlocks(const AttentionDims& d) { return (d.q_len + kQueryBlock - 1) / kQueryBlock; }

// One (sequence b, head h, query block) of a problem.
void AttendBlock(const AttentionProblem& p, int64_t b, int64_t h, int64_t block) {
  const AttentionOptions& options = *p.options;
  const AttentionDims& d = p.dims;
  const float scale = options.Scale(d);
  const bool element_masks = options.HasElementMasks();
  const float keep_scale = 1.0f / (1.0f - options.dropout_p);
  const int64_t hk = KvHead(d, h);
  const int64_t first_row = block * kQueryBlock;
  const int64_t rows = std::min(kQueryBlock, d.q_len - first_row);
  // Keys past the last row's causal frontier are never attended: skip them entirely.
  const int64_t key_count = options.KeyLimit(d, b, first_row + rows - 1);
  float* out = p.output + p.output_layout.Offset(b, h, first_row);
  float* weights =
      p.weights == nullptr ? nullptr
                           : p.weights + ((b * d.num_heads + h) * d.q_len + first_row) * d.kv_len;
  if (weights != nullptr) std::fill(weights, weights + rows * d.kv_len, 0.0f);
  if (key_count == 0) {
    for (int64_t r = 0; r < rows; ++r) {
      std::fill(out + r * p.output_layout.row_stride,
                out + r * p.output_layout.row_stride + d.v_head_dim, 0.0f);
    }
    return;
  }
  thread_local std::vector<float> scores;
  scores.resize(rows * key_count);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, key_count, d.head_dim, scale,
              p.query + p.query_layout.Offset(b, h, first_row), p.query_layout.row_stride,
              p.key + p.key_layout.Offset(b, hk, 0), p.key_layout.row_stride, 0.0f,
              scores.data(), key_count);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = first_row + r;
    float* row = scores.data() + r * key_count;
    const int64_t limit = options.KeyLimit(d, b, i);
    std::fill(row + limit, row + key_count, 0.0f);
    if (element_masks) {
      for (int64_t j = 0; j < limit; ++j) row[j] += options.ScoreBias(d, b, h, i, j);
    }
    const float max_score = RowMax(row, limit);
    if (max_score == -std::numeric_limits<float>::infinity()) {
      std::fill(row, row + limit, 0.0f);  // fully masked row: zeros, never NaN
      continue;
    }
    const float sum = ExpAndSum(row, limit, max_score);
    ScaleRow(row, limit, 1.0f / sum);
    if (options.dropout_p > 0.0f) {
      for (int64_t j = 0; j < limit; ++j) {
        row[j] = DropoutKeeps(options.dropout_seed, options.dropout_p, b, h, i, j)
                     ? row[j] * keep_scale
                     : 0.0f;
      }
    }
    if (weights != nullptr) std::copy(row, row + key_count, weights + r * d.kv_len);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, d.v_head_dim, key_count, 1.0f,
              scores.data(), key_count, p.value + p.value_layout.Offset(b, hk, 0),
              p.value_layout.row_stride, 0.0f, out, p.output_layout.row_stride);
}

}  // namespace

void AttentionBlockedCpu(absl::Span<const AttentionProblem> problems, ThreadPool& pool) {
  std::vector<int64_t> first_task(problems.size() + 1, 0);
  for (size_t k = 0; k < problems.size(); ++k) {
    const AttentionDims& d = problems[k].dims;
    first_task[k + 1] = first_task[k] + d.batch * d.num_heads * QueryBlocks(d);
  }
  pool.ParallelFor(first_task.back(), [&](int64_t task) {
    const size_t k =
        std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
    const AttentionProblem& p = problems[k];
    const int64_t blocks = QueryBlocks(p.dims);
    const int64_t local = task - first_task[k];
    AttendBlock(p, local / (blocks * p.dims.num_heads), (local / blocks) % p.dims.num_heads,
                local % blocks);
  });
}

}  // namespace attention::core

#include "core/mha_layer.h"

#include <algorithm>
#include <cmath>

#include <cblas.h>

#include "core/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace attention::core {
namespace {

absl::Status Invalid(absl::string_view field, int64_t value, absl::string_view rule) {
  return absl::InvalidArgumentError(absl::StrCat(field, " = ", value, " ", rule));
}

// Y[M, N] = X[M, K] * W[N, K]^T (+ bias[N]), split across the pool. Every part's GEMM
// packs all of the operand that is not split, so split the larger one: by output columns
// when the weights outweigh the rows (few tokens), else by rows.
void LinearForward(ThreadPool& pool, const float* x, int64_t rows, int64_t in_features,
                   absl::Span<const float> weight, absl::Span<const float> bias,
                   int64_t out_features, float* y) {
  constexpr int64_t kMinPart = 16;
  const int64_t threads = pool.size();
  const bool split_rows = rows >= out_features ? rows >= threads * kMinPart
                                               : out_features < threads * kMinPart;
  const int64_t total = split_rows ? rows : out_features;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, total));
  pool.ParallelFor(parts, [&](int64_t part) {
    const int64_t begin = total * part / parts;
    const int64_t end = total * (part + 1) / parts;
    if (begin == end) return;
    const int64_t m = split_rows ? end - begin : rows;
    const int64_t n = split_rows ? out_features : end - begin;
    const float* a = split_rows ? x + begin * in_features : x;
    const float* w = split_rows ? weight.data() : weight.data() + begin * in_features;
    float* c = split_rows ? y + begin * out_features : y + begin;
    // The bias goes in as the GEMM's C with beta = 1: no separate pass over Y.
    float beta = 0.0f;
    if (!bias.empty()) {
      const float* b = split_rows ? bias.data() : bias.data() + begin;
      for (int64_t r = 0; r < m; ++r) std::copy(b, b + n, c + r * out_features);
      beta = 1.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, in_features, 1.0f, a,
                in_features, w, in_features, beta, c, out_features);
  });
}

// Reference linear layer in double: y[r, o] = sum_i x[r, i] * w[o, i] + bias[o].
std::vector<double> LinearReference(const double* x, int64_t rows, int64_t in_features,
                                    absl::Span<const float> weight,
                                    absl::Span<const float> bias, int64_t out_features) {
  std::vector<double> y(rows * out_features);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out_features; ++o) {
      double sum = bias.empty() ? 0.0 : bias[o];
      for (int64_t i = 0; i < in_features; ++i) {
        sum += x[r * in_features + i] * static_cast<double>(weight[o * in_features + i]);
      }
      y[r * out_features + o] = sum;
    }
  }
  return y;
}

void RotaryReference(std::vector<double>& data, int64_t rows, int64_t seq_len, int64_t heads,
                     int64_t head_dim, double theta) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const double position = static_cast<double>(r % seq_len);
    for (int64_t h = 0; h < heads; ++h) {
      double* x = data.data() + (r * heads + h) * head_dim;
      for (int64_t c = 0; c < half; ++c) {
        const double angle = position * std::pow(theta, -2.0 * c / head_dim);
        const double x1 = x[c], x2 = x[c + half];
        x[c] = x1 * std::cos(angle) - x2 * std::sin(angle);
        x[c + half] = x2 * std::cos(angle) + x1 * std::sin(angle);
      }
    }
  }
}

std::vector<float> ToFloat(const std::vector<double>& values) {
  return std::vector<float>(values.begin(), values.end());
}

// [B, H, Nq, Nk] -> [B, Nq, Nk], mean over heads.
std::vector<float> AverageHeads(const std::vector<float>& per_head, const AttentionDims& d) {
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

// Working memory of ForwardBatch, kept per calling thread and reused: allocating and
// zero-filling tens of MB per batch (page faults on fresh memory) cost about a fifth of a
// BERT-sized batch. It grows to the largest batch the thread has run and is freed with the
// thread. Every buffer is fully written before it is read, so nothing is zeroed.
class ForwardScratch {
 public:
  enum Slot { kX, kKeyInput, kValueInput, kQ, kK, kV, kAttended, kProjected, kSlots };

  float* Get(Slot slot, int64_t count) {
    if (sizes_[slot] < count) {
      buffers_[slot].reset(new float[count]);
      sizes_[slot] = count;
    }
    return buffers_[slot].get();
  }

 private:
  std::unique_ptr<float[]> buffers_[kSlots];
  int64_t sizes_[kSlots] = {};
};

void FinishWeights(AttentionResult& result, const AttentionDims& dims, NeedWeights need) {
  if (need == NeedWeights::kAveraged) result.weights = AverageHeads(result.weights, dims);
}

}  // namespace

absl::StatusOr<MhaConfig> MhaConfig::Resolve(MhaConfig c) {
  if (c.embed_dim < 1) return Invalid("config.embed_dim", c.embed_dim, "must be >= 1");
  if (c.num_heads < 1) return Invalid("config.num_heads", c.num_heads, "must be >= 1");
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  if (c.num_kv_heads < 1 || c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("config.num_kv_heads = ", c.num_kv_heads,
                                                   " must be >= 1 and divide config.num_heads = ",
                                                   c.num_heads));
  }
  if (c.head_dim == 0) {
    if (c.embed_dim % c.num_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.num_heads = ", c.num_heads, " does not divide config.embed_dim = ",
          c.embed_dim, " (set config.head_dim to choose the head size explicitly)"));
    }
    c.head_dim = c.embed_dim / c.num_heads;
  }
  if (c.head_dim < 1) return Invalid("config.head_dim", c.head_dim, "must be >= 1");
  if (c.v_head_dim == 0) c.v_head_dim = c.head_dim;
  if (c.v_head_dim < 1) return Invalid("config.v_head_dim", c.v_head_dim, "must be >= 1");
  if (c.kdim == 0) c.kdim = c.embed_dim;
  if (c.kdim < 1) return Invalid("config.kdim", c.kdim, "must be >= 1");
  if (c.vdim == 0) c.vdim = c.embed_dim;
  if (c.vdim < 1) return Invalid("config.vdim", c.vdim, "must be >= 1");
  if (c.output_dim == 0) c.output_dim = c.output_projection ? c.embed_dim : c.AttentionWidth();
  if (c.output_dim < 1) return Invalid("config.output_dim", c.output_dim, "must be >= 1");
  if (!c.output_projection && c.output_dim != c.AttentionWidth()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.output_dim = ", c.output_dim,
        " must equal num_heads * v_head_dim = ", c.AttentionWidth(),
        " when config.skip_output_projection is set"));
  }
  if (!c.output_projection) c.output_bias = false;
  if (!(c.rope_theta >= 0.0) || !std::isfinite(c.rope_theta)) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.rope_theta = ", c.rope_theta, " must be finite and >= 0"));
  }
  if (c.rope_theta > 0.0 && c.head_dim % 2 != 0) {
    return Invalid("config.head_dim", c.head_dim, "must be even when config.rope_theta is set");
  }
  constexpr int64_t kMaxDim = 1 << 16;  // keeps every weight matrix far below 2^63 elements
  for (auto [name, value] :
       {std::pair<const char*, int64_t>{"config.embed_dim", c.embed_dim},
        {"config.num_heads", c.num_heads}, {"config.head_dim", c.head_dim},
        {"config.v_head_dim", c.v_head_dim}, {"config.kdim", c.kdim}, {"config.vdim", c.vdim},
        {"config.output_dim", c.output_dim}}) {
    if (value > kMaxDim) return Invalid(name, value, absl::StrCat("exceeds ", kMaxDim));
  }
  return c;
}

int64_t MhaConfig::ParameterCount() const {
  int64_t count = QWidth() * embed_dim + KWidth() * kdim + VWidth() * vdim;
  if (qkv_bias) count += QWidth() + KWidth() + VWidth();
  if (output_projection) count += output_dim * AttentionWidth();
  if (output_bias) count += output_dim;
  return count;
}

std::vector<MhaWeights::Slot> MhaWeights::Slots(const MhaConfig& c) {
  std::vector<Slot> slots = {
      {"q_proj.weight", {c.QWidth(), c.embed_dim}, &MhaWeights::q_weight},
      {"k_proj.weight", {c.KWidth(), c.kdim}, &MhaWeights::k_weight},
      {"v_proj.weight", {c.VWidth(), c.vdim}, &MhaWeights::v_weight},
  };
  if (c.qkv_bias) {
    slots.push_back({"q_proj.bias", {c.QWidth()}, &MhaWeights::q_bias});
    slots.push_back({"k_proj.bias", {c.KWidth()}, &MhaWeights::k_bias});
    slots.push_back({"v_proj.bias", {c.VWidth()}, &MhaWeights::v_bias});
  }
  if (c.output_projection) {
    slots.push_back({"out_proj.weight", {c.output_dim, c.AttentionWidth()}, &MhaWeights::out_weight});
  }
  if (c.output_bias) slots.push_back({"out_proj.bias", {c.output_dim}, &MhaWeights::out_bias});
  return slots;
}

MhaWeights MhaWeights::Random(const MhaConfig& config, uint64_t seed) {
  MhaWeights weights;
  uint64_t tensor_index = 0;
  for (const Slot& slot : Slots(config)) {
    ++tensor_index;
    int64_t count = 1;
    for (int64_t dim : slot.shape) count *= dim;
    // fan_in is the input width of the Linear the tensor belongs to.
    const std::string base = slot.name.substr(0, slot.name.find('.'));
    const int64_t fan_in = base == "q_proj"     ? config.embed_dim
                           : base == "k_proj"   ? config.kdim
                           : base == "v_proj"   ? config.vdim
                                                : config.AttentionWidth();
    const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
    std::vector<float>& values = weights.*slot.member;
    values.resize(count);
    const uint64_t stream = Mix64(seed ^ Mix64(tensor_index));
    for (int64_t e = 0; e < count; ++e) {
      const double uniform = UnitInterval(Mix64(stream + e));
      values[e] = static_cast<float>((2.0 * uniform - 1.0) * bound);
    }
  }
  return weights;
}

absl::StatusOr<std::shared_ptr<const MhaLayer>> MhaLayer::Create(const MhaConfig& config,
                                                                 MhaWeights weights) {
  for (const MhaWeights::Slot& slot : MhaWeights::Slots(config)) {
    int64_t expected = 1;
    for (int64_t dim : slot.shape) expected *= dim;
    const int64_t given = static_cast<int64_t>((weights.*slot.member).size());
    if (given != expected) {
      return absl::InvalidArgumentError(absl::StrCat("weight ", slot.name, " has ", given,
                                                     " elements; expected shape [",
                                                     absl::StrJoin(slot.shape, ", "), "]"));
    }
  }
  return std::shared_ptr<const MhaLayer>(new MhaLayer(config, std::move(weights)));
}

MhaLayer::MhaLayer(const MhaConfig& config, MhaWeights weights)
    : config_(config), weights_(std::move(weights)) {
  if (config_.kdim != config_.embed_dim || config_.vdim != config_.embed_dim) return;
  // Move Q, K and V into the fused matrix; peak memory is one extra projection briefly.
  for (std::vector<float>* part : {&weights_.q_weight, &weights_.k_weight, &weights_.v_weight}) {
    fused_qkv_weight_.insert(fused_qkv_weight_.end(), part->begin(), part->end());
    std::vector<float>().swap(*part);
  }
  for (std::vector<float>* part : {&weights_.q_bias, &weights_.k_bias, &weights_.v_bias}) {
    fused_qkv_bias_.insert(fused_qkv_bias_.end(), part->begin(), part->end());
    std::vector<float>().swap(*part);
  }
}

absl::Span<const float> MhaLayer::QWeight() const {
  if (fused_qkv_weight_.empty()) return weights_.q_weight;
  return absl::MakeConstSpan(fused_qkv_weight_).subspan(0, config_.QWidth() * config_.embed_dim);
}
absl::Span<const float> MhaLayer::KWeight() const {
  if (fused_qkv_weight_.empty()) return weights_.k_weight;
  return absl::MakeConstSpan(fused_qkv_weight_)
      .subspan(config_.QWidth() * config_.embed_dim, config_.KWidth() * config_.embed_dim);
}
absl::Span<const float> MhaLayer::VWeight() const {
  if (fused_qkv_weight_.empty()) return weights_.v_weight;
  return absl::MakeConstSpan(fused_qkv_weight_)
      .subspan((config_.QWidth() + config_.KWidth()) * config_.embed_dim);
}
absl::Span<const float> MhaLayer::QBias() const {
  if (fused_qkv_weight_.empty()) return weights_.q_bias;
  if (fused_qkv_bias_.empty()) return {};
  return absl::MakeConstSpan(fused_qkv_bias_).subspan(0, config_.QWidth());
}
absl::Span<const float> MhaLayer::KBias() const {
  if (fused_qkv_weight_.empty()) return weights_.k_bias;
  if (fused_qkv_bias_.empty()) return {};
  return absl::MakeConstSpan(fused_qkv_bias_).subspan(config_.QWidth(), config_.KWidth());
}
absl::Span<const float> MhaLayer::VBias() const {
  if (fused_qkv_weight_.empty()) return weights_.v_bias;
  if (fused_qkv_bias_.empty()) return {};
  return absl::MakeConstSpan(fused_qkv_bias_).subspan(config_.QWidth() + config_.KWidth());
}

MhaWeights MhaLayer::weights() const {
  MhaWeights copy = weights_;
  if (!fused_qkv_weight_.empty()) {
    copy.q_weight.assign(QWeight().begin(), QWeight().end());
    copy.k_weight.assign(KWeight().begin(), KWeight().end());
    copy.v_weight.assign(VWeight().begin(), VWeight().end());
    copy.q_bias.assign(QBias().begin(), QBias().end());
    copy.k_bias.assign(KBias().begin(), KBias().end());
    copy.v_bias.assign(VBias().begin(), VBias().end());
  }
  return copy;
}

AttentionDims MhaLayer::Dims(const MhaInput& input) const {
  return {input.batch, config_.num_heads, config_.num_kv_heads, input.q_len, input.kv_len,
          config_.head_dim, config_.v_head_dim};
}

absl::Status MhaLayer::ValidateInput(const MhaInput& in) const {
  const bool self_attention = in.key.empty() && in.value.empty();
  if (self_attention && in.kv_len != in.q_len) {
    return absl::InvalidArgumentError(absl::StrCat("self-attention needs kv_len (", in.kv_len,
                                                   ") == q_len (", in.q_len, ")"));
  }
  if (static_cast<int64_t>(in.query.size()) != in.batch * in.q_len * config_.embed_dim) {
    return absl::InvalidArgumentError(absl::StrCat("query has ", in.query.size(),
                                                   " values; expected [B, Nq, E] = [", in.batch,
                                                   ", ", in.q_len, ", ", config_.embed_dim, "]"));
  }
  if (!self_attention) {
    if (static_cast<int64_t>(in.key.size()) != in.batch * in.kv_len * config_.kdim) {
      return absl::InvalidArgumentError(absl::StrCat("key has ", in.key.size(),
                                                     " values; expected [B, Nk, kdim] = [",
                                                     in.batch, ", ", in.kv_len, ", ",
                                                     config_.kdim, "]"));
    }
    if (static_cast<int64_t>(in.value.size()) != in.batch * in.kv_len * config_.vdim) {
      return absl::InvalidArgumentError(absl::StrCat("value has ", in.value.size(),
                                                     " values; expected [B, Nk, vdim] = [",
                                                     in.batch, ", ", in.kv_len, ", ",
                                                     config_.vdim, "]"));
    }
  }
  return in.options.Validate(Dims(in));
}

AttentionResult MhaLayer::ForwardReference(const MhaInput& in) const {
  const MhaConfig& c = config_;
  const MhaWeights& w = weights_;
  const bool self_attention = in.key.empty();
  const int64_t q_rows = in.batch * in.q_len;
  const int64_t kv_rows = in.batch * in.kv_len;
  const std::vector<double> x(in.query.begin(), in.query.end());
  const std::vector<double> xk = self_attention ? x : std::vector<double>(in.key.begin(), in.key.end());
  const std::vector<double> xv =
      self_attention ? x : std::vector<double>(in.value.begin(), in.value.end());
  std::vector<double> q = LinearReference(x.data(), q_rows, c.embed_dim, QWeight(), QBias(), c.QWidth());
  std::vector<double> k = LinearReference(xk.data(), kv_rows, c.kdim, KWeight(), KBias(), c.KWidth());
  const std::vector<double> v =
      LinearReference(xv.data(), kv_rows, c.vdim, VWeight(), VBias(), c.VWidth());
  if (c.rope_theta > 0.0) {
    RotaryReference(q, q_rows, in.q_len, c.num_heads, c.head_dim, c.rope_theta);
    RotaryReference(k, kv_rows, in.kv_len, c.num_kv_heads, c.head_dim, c.rope_theta);
  }
  // The attention oracle reads float inputs; projections are rounded once, like the fast path.
  const std::vector<float> qf = ToFloat(q), kf = ToFloat(k), vf = ToFloat(v);
  AttentionOptions options = in.options;
  options.causal = options.causal || c.always_causal;
  const AttentionDims dims = Dims(in);
  std::vector<float> attended(q_rows * c.AttentionWidth());
  AttentionResult result;
  if (in.options.need_weights != NeedWeights::kNone) {
    result.weights.resize(in.batch * c.num_heads * in.q_len * in.kv_len);
  }
  AttentionProblem problem;
  problem.dims = dims;
  problem.query = qf.data();
  problem.query_layout = HeadLayout::BatchRowHead(c.num_heads, in.q_len, c.head_dim);
  problem.key = kf.data();
  problem.key_layout = HeadLayout::BatchRowHead(c.num_kv_heads, in.kv_len, c.head_dim);
  problem.value = vf.data();
  problem.value_layout = HeadLayout::BatchRowHead(c.num_kv_heads, in.kv_len, c.v_head_dim);
  problem.output = attended.data();
  problem.output_layout = HeadLayout::BatchRowHead(c.num_heads, in.q_len, c.v_head_dim);
  problem.weights = result.weights.empty() ? nullptr : result.weights.data();
  problem.options = &options;
  AttentionReference(problem);
  if (c.output_projection) {
    const std::vector<double> a(attended.begin(), attended.end());
    result.output = ToFloat(LinearReference(a.data(), q_rows, c.AttentionWidth(), w.out_weight,
                                            w.out_bias, c.output_dim));
  } else {
    result.output = std::move(attended);
  }
  FinishWeights(result, dims, in.options.need_weights);
  return result;
}

std::vector<AttentionResult> MhaLayer::ForwardBatch(absl::Span<const MhaInput* const> inputs,
                                                    ThreadPool& pool) const {
  const MhaConfig& c = config_;
  const MhaWeights& w = weights_;
  // Row offsets of every input inside the packed token matrices.
  std::vector<int64_t> q_row(inputs.size() + 1, 0), kv_row(inputs.size() + 1, 0);
  bool all_self_attention = true;
  for (size_t n = 0; n < inputs.size(); ++n) {
    q_row[n + 1] = q_row[n] + inputs[n]->batch * inputs[n]->q_len;
    kv_row[n + 1] = kv_row[n] + inputs[n]->batch * inputs[n]->kv_len;
    all_self_attention = all_self_attention && inputs[n]->key.empty();
  }
  const int64_t q_rows = q_row.back(), kv_rows = kv_row.back();
  thread_local ForwardScratch scratch;
  // A single input is used in place; a batch is packed into one token matrix.
  const float* x = inputs.size() == 1 ? inputs[0]->query.data() : nullptr;
  if (x == nullptr) {
    float* packed = scratch.Get(ForwardScratch::kX, q_rows * c.embed_dim);
    for (size_t n = 0; n < inputs.size(); ++n) {
      std::copy(inputs[n]->query.begin(), inputs[n]->query.end(), packed + q_row[n] * c.embed_dim);
    }
    x = packed;
  }
  // Key and value inputs: the query rows themselves for self-attention.
  const float* key_input = x;
  const float* value_input = x;
  if (!all_self_attention) {
    float* xk = scratch.Get(ForwardScratch::kKeyInput, kv_rows * c.kdim);
    float* xv = scratch.Get(ForwardScratch::kValueInput, kv_rows * c.vdim);
    for (size_t n = 0; n < inputs.size(); ++n) {
      const MhaInput& in = *inputs[n];
      absl::Span<const float> key = in.key.empty() ? in.query : in.key;
      absl::Span<const float> value = in.value.empty() ? in.query : in.value;
      std::copy(key.begin(), key.end(), xk + kv_row[n] * c.kdim);
      std::copy(value.begin(), value.end(), xv + kv_row[n] * c.vdim);
    }
    key_input = xk;
    value_input = xv;
  }
  // Projected Q, K and V rows and their strides (floats from one token's row to the next).
  float *q, *k, *v;
  int64_t q_stride = c.QWidth(), k_stride = c.KWidth(), v_stride = c.VWidth();
  if (all_self_attention && !fused_qkv_weight_.empty()) {
    // One GEMM for all three: [T, E] x [E, Q + K + V]; Q, K, V are column ranges of it.
    const int64_t width = c.QWidth() + c.KWidth() + c.VWidth();
    q = scratch.Get(ForwardScratch::kQ, q_rows * width);
    LinearForward(pool, x, q_rows, c.embed_dim, fused_qkv_weight_, fused_qkv_bias_, width, q);
    k = q + c.QWidth();
    v = k + c.KWidth();
    q_stride = k_stride = v_stride = width;
  } else {
    q = scratch.Get(ForwardScratch::kQ, q_rows * c.QWidth());
    k = scratch.Get(ForwardScratch::kK, kv_rows * c.KWidth());
    v = scratch.Get(ForwardScratch::kV, kv_rows * c.VWidth());
    LinearForward(pool, x, q_rows, c.embed_dim, QWeight(), QBias(), c.QWidth(), q);
    LinearForward(pool, key_input, kv_rows, c.kdim, KWeight(), KBias(), c.KWidth(), k);
    LinearForward(pool, value_input, kv_rows, c.vdim, VWeight(), VBias(), c.VWidth(), v);
  }
  if (c.rope_theta > 0.0) {
    for (size_t n = 0; n < inputs.size(); ++n) {
      const MhaInput& in = *inputs[n];
      ApplyRotary(q + q_row[n] * q_stride, in.batch * in.q_len, in.q_len, c.num_heads,
                  c.head_dim, c.rope_theta, q_stride);
      ApplyRotary(k + kv_row[n] * k_stride, in.batch * in.kv_len, in.kv_len, c.num_kv_heads,
                  c.head_dim, c.rope_theta, k_stride);
    }
  }
  float* attended = scratch.Get(ForwardScratch::kAttended, q_rows * c.AttentionWidth());
  std::vector<AttentionResult> results(inputs.size());
  std::vector<AttentionOptions> options(inputs.size());
  std::vector<AttentionProblem> problems(inputs.size());
  for (size_t n = 0; n < inputs.size(); ++n) {
    const MhaInput& in = *inputs[n];
    options[n] = in.options;
    options[n].causal = options[n].causal || c.always_causal;
    if (in.options.need_weights != NeedWeights::kNone) {
      results[n].weights.resize(in.batch * c.num_heads * in.q_len * in.kv_len);
    }
    AttentionProblem& p = problems[n];
    p.dims = Dims(in);
    p.query = q + q_row[n] * q_stride;
    p.query_layout = HeadLayout::StridedRows(in.q_len, c.head_dim, q_stride);
    p.key = k + kv_row[n] * k_stride;
    p.key_layout = HeadLayout::StridedRows(in.kv_len, c.head_dim, k_stride);
    p.value = v + kv_row[n] * v_stride;
    p.value_layout = HeadLayout::StridedRows(in.kv_len, c.v_head_dim, v_stride);
    p.output = attended + q_row[n] * c.AttentionWidth();
    p.output_layout = HeadLayout::BatchRowHead(c.num_heads, in.q_len, c.v_head_dim);
    p.weights = results[n].weights.empty() ? nullptr : results[n].weights.data();
    p.options = &options[n];
  }
  AttentionBlockedCpu(problems, pool);
  const float* output = attended;
  if (c.output_projection) {
    float* projected = scratch.Get(ForwardScratch::kProjected, q_rows * c.output_dim);
    LinearForward(pool, attended, q_rows, c.AttentionWidth(), w.out_weight, w.out_bias,
                  c.output_dim, projected);
    output = projected;
  }
  for (size_t n = 0; n < inputs.size(); ++n) {
    results[n].output.assign(output + q_row[n] * c.output_dim,
                             output + q_row[n + 1] * c.output_dim);
    FinishWeights(results[n], problems[n].dims, inputs[n]->options.need_weights);
  }
  return results;
}

void ApplyRotary(float* data, int64_t rows, int64_t seq_len, int64_t heads, int64_t head_dim,
                 double theta, int64_t row_stride) {
  const int64_t half = head_dim / 2;
  std::vector<double> inverse_frequency(half);
  for (int64_t c = 0; c < half; ++c) inverse_frequency[c] = std::pow(theta, -2.0 * c / head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    const double position = static_cast<double>(r % seq_len);
    for (int64_t c = 0; c < half; ++c) {
      const float cos_a = static_cast<float>(std::cos(position * inverse_frequency[c]));
      const float sin_a = static_cast<float>(std::sin(position * inverse_frequency[c]));
      for (int64_t h = 0; h < heads; ++h) {
        float* x = data + r * row_stride + h * head_dim;
        const float x1 = x[c], x2 = x[c + half];
        x[c] = x1 * cos_a - x2 * sin_a;
        x[c + half] = x2 * cos_a + x1 * sin_a;
      }
    }
  }
}

absl::Status ValidateSdpaInput(const SdpaInput& in) {
  const AttentionDims& d = in.dims;
  for (auto [name, value] : {std::pair<const char*, int64_t>{"B", d.batch}, {"H", d.num_heads},
                             {"Hkv", d.num_kv_heads}, {"Nq", d.q_len}, {"Nk", d.kv_len},
                             {"dk", d.head_dim}, {"dv", d.v_head_dim}}) {
    if (value < 1) return Invalid(name, value, "must be >= 1");
  }
  if (d.num_heads % d.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("key heads (", d.num_kv_heads,
                                                   ") must divide query heads (", d.num_heads,
                                                   ")"));
  }
  return in.options.Validate(d);
}

namespace {

AttentionResult RunSdpa(const SdpaInput& in, ThreadPool* pool) {
  const AttentionDims& d = in.dims;
  AttentionResult result;
  result.output.resize(d.batch * d.num_heads * d.q_len * d.v_head_dim);
  if (in.options.need_weights != NeedWeights::kNone) {
    result.weights.resize(d.batch * d.num_heads * d.q_len * d.kv_len);
  }
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
  if (pool == nullptr) {
    AttentionReference(p);
  } else {
    AttentionBlockedCpu(absl::MakeConstSpan(&p, 1), *pool);
  }
  FinishWeights(result, d, in.options.need_weights);
  return result;
}

}  // namespace

AttentionResult SdpaReference(const SdpaInput& input) { return RunSdpa(input, nullptr); }
AttentionResult SdpaForward(const SdpaInput& input, ThreadPool& pool) {
  return RunSdpa(input, &pool);
}

}  // namespace attention::core

#include "core/cpu/bf16_layer.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "core/attention_kernels.h"
#include "core/cpu/attention_cpu.h"
#include "core/cpu/batch_groups.h"
#include "core/cpu/bf16_linear.h"
#include "core/cpu/cpu_backend.h"
#include "core/cpu/forward_scratch.h"
#include "core/cpu/forward_steps.h"
#include "core/cpu/gemm.h"
#include "core/dtype.h"
#include "core/forward_plan.h"
#include "core/half_bits.h"

namespace attention::core {
namespace {

// `count` elements of one input tensor as bf16 into `to`: copied when the wire sent bf16,
// else rounded to nearest even once (float16 is exact in float32 first).
void ToBf16(absl::Span<const float> values, absl::Span<const uint16_t> half, DType half_dtype,
            uint16_t* to, Bf16Kernel kernel) {
  if (half_dtype == DType::kBFloat16) {
    std::memcpy(to, half.data(), half.size() * sizeof(uint16_t));
  } else if (half_dtype == DType::kFloat16) {
    for (size_t i = 0; i < half.size(); ++i) to[i] = FloatToBFloat16(HalfToFloat(half[i]));
  } else {
    RoundToBf16(values.data(), static_cast<int64_t>(values.size()), to, kernel);
  }
}

// A part of one input tensor to convert to bf16 (ToBf16): float32 values or 16-bit ones.
struct TokenChunk {
  absl::Span<const float> values;
  absl::Span<const uint16_t> half;
  DType half_dtype;
  uint16_t* to;
};

// Adds the chunks of one tensor (its float32 `values` or `half` ones) bound for `to`: about
// 1 MB of floats each, so that a large batch converts on every thread.
void AddTokenChunks(absl::Span<const float> values, absl::Span<const uint16_t> half,
                    DType half_dtype, uint16_t* to, std::vector<TokenChunk>& chunks) {
  constexpr size_t kChunkElements = size_t{1} << 18;
  const size_t count = half_dtype == DType::kFloat32 ? values.size() : half.size();
  for (size_t first = 0; first < count; first += kChunkElements) {
    const size_t length = std::min(kChunkElements, count - first);
    const bool is_float = half_dtype == DType::kFloat32;
    chunks.push_back({is_float ? values.subspan(first, length) : absl::Span<const float>(),
                      is_float ? absl::Span<const uint16_t>() : half.subspan(first, length),
                      half_dtype, to + first});
  }
}

// This thread's working memory for every step of a bf16 layer's passes (one set of slots).
ForwardScratch& ThreadScratch() {
  thread_local ForwardScratch scratch;
  return scratch;
}

class CpuBf16Layer final : public PreparedLayer {
 public:
  CpuBf16Layer(const MhaConfig& config, const MhaWeightsView& weights, ThreadPool& pool,
               Bf16Kernel kernel, Bf16Projection projection)
      : config_(config), weights_(weights), pool_(pool), kernel_(kernel) {
    const MhaConfig& c = config;
    const MhaWeightsView::Bf16Matrices& w = weights.bf16;
    const int64_t q = c.QWidth(), k = c.KWidth(), v = c.VWidth();
    if (!w.fused_qkv_weight.empty()) {
      fused_qkv_.emplace(w.fused_qkv_weight, q + k + v, c.embed_dim, projection);
    } else {
      q_.emplace(w.q_weight, q, c.embed_dim, projection);
      k_.emplace(w.k_weight, k, c.kdim, projection);
      v_.emplace(w.v_weight, v, c.vdim, projection);
    }
    if (c.output_projection) {
      out_.emplace(w.out_weight, c.output_dim, c.AttentionWidth(), projection);
    }
  }

  // In groups of sequences, each group's every step on one thread, where GroupBatchParts
  // finds groups that keep the pool busy; else ForwardOn the pool.
  absl::StatusOr<std::vector<AttentionResult>> ForwardBatch(
      absl::Span<const MhaInput* const> inputs) const override;
  bool HasDecodeEntry() const override { return true; }
  absl::Status ProjectForDecode(const float* x, absl::Span<const int64_t> positions, float* q,
                                float* k, float* v) const override;
  absl::Status ProjectDecodeOutput(const float* attended, int64_t rows,
                                   float* output) const override;
  int64_t DeviceWeightBytes() const override {
    int64_t bytes = 0;
    for (const auto* linear : {&fused_qkv_, &q_, &k_, &v_, &out_}) {
      if (linear->has_value()) bytes += (*linear)->bytes();
    }
    return bytes;
  }

 private:
  // The whole batch with every step split across `pool`'s threads.
  std::vector<AttentionResult> ForwardOn(ThreadPool& pool,
                                         absl::Span<const MhaInput* const> inputs) const;
  // Q, K and V of `rows` bf16 tokens `x`: with fused weights one GEMM into `q` ([rows,
  // Q + K + V]; k and v unused), else three.
  void ProjectSelf(ThreadPool& pool, const uint16_t* x, int64_t rows, float* q, float* k,
                   float* v) const;
  // Whether attended rows go to the output projection in bf16 as attention writes them
  // (what the projection would round them to): where the host multiplies in bf16 and an
  // output projection follows.
  bool AttendsToBf16() const;
  // Whether, besides, Q, K and V go to attention in bf16 as the projections write them
  // (what its products would round them to): not where RoPE rotates float32 rows, weights
  // are asked for (their long rows multiply in float32), or a fused layer takes separate
  // keys and values.
  bool ProjectsToBf16(const ForwardPlan& plan, absl::Span<const MhaInput* const> inputs) const;
  // Q, K and V of the planned inputs (x, or xk and xv for separate keys and values), in bf16,
  // attended into `attended` in bf16.
  std::vector<AttentionResult> ProjectAndAttendInBf16(ThreadPool& pool, const ForwardPlan& plan,
                                                      absl::Span<const MhaInput* const> inputs,
                                                      const uint16_t* x, const uint16_t* xk,
                                                      const uint16_t* xv, uint16_t* attended) const;
  // The same in float32 rows, rounded by attention's bf16 products where the host has them,
  // into float32 `attended` or (AttendsToBf16) bf16 `attended_bf16`.
  std::vector<AttentionResult> ProjectAndAttend(ThreadPool& pool, const ForwardPlan& plan,
                                                absl::Span<const MhaInput* const> inputs,
                                                const uint16_t* x, const uint16_t* xk,
                                                const uint16_t* xv, float* attended,
                                                uint16_t* attended_bf16) const;
  // The output projection of `rows` attended float32 rows into `output`.
  void ProjectOutput(ThreadPool& pool, const float* attended, int64_t rows, float* output) const;

  const MhaConfig config_;
  const MhaWeightsView weights_;
  ThreadPool& pool_;
  // Runs a group of the batch (GroupBatchParts) on the pool thread that claimed it.
  mutable ThreadPool claiming_thread_{1};
  const Bf16Kernel kernel_;
  std::optional<Bf16Linear> fused_qkv_, q_, k_, v_, out_;
};

void CpuBf16Layer::ProjectSelf(ThreadPool& pool, const uint16_t* x, int64_t rows, float* q,
                               float* k, float* v) const {
  const MhaWeightsView& w = weights_;
  if (fused_qkv_.has_value()) {
    fused_qkv_->Forward(pool, x, rows, w.fused_qkv_bias, q);
    return;
  }
  q_->Forward(pool, x, rows, w.q_bias, q);
  k_->Forward(pool, x, rows, w.k_bias, k);
  v_->Forward(pool, x, rows, w.v_bias, v);
}

bool CpuBf16Layer::AttendsToBf16() const {
  return kernel_ != Bf16Kernel::kPortable && out_.has_value() && out_->WritesBf16();
}

bool CpuBf16Layer::ProjectsToBf16(const ForwardPlan& plan,
                                  absl::Span<const MhaInput* const> inputs) const {
  if (!AttendsToBf16() || config_.rope_theta > 0.0) return false;
  if (fused_qkv_.has_value() && !plan.fused_qkv) return false;
  return std::all_of(inputs.begin(), inputs.end(), [](const MhaInput* in) {
    return in->options.need_weights == NeedWeights::kNone;
  });
}

std::vector<AttentionResult> CpuBf16Layer::ProjectAndAttendInBf16(
    ThreadPool& pool, const ForwardPlan& plan, absl::Span<const MhaInput* const> inputs,
    const uint16_t* x, const uint16_t* xk, const uint16_t* xv, uint16_t* attended) const {
  const MhaConfig& c = config_;
  const MhaWeightsView& w = weights_;
  ForwardScratch& scratch = ThreadScratch();
  uint16_t *q, *k, *v;
  if (plan.fused_qkv) {
    q = scratch.Get<uint16_t>(ForwardScratch::kQ, plan.q_rows * plan.q_stride);
    fused_qkv_->Forward(pool, x, plan.q_rows, w.fused_qkv_bias, q);
    k = q + c.QWidth();
    v = k + c.KWidth();
  } else {
    q = scratch.Get<uint16_t>(ForwardScratch::kQ, plan.q_rows * c.QWidth());
    k = scratch.Get<uint16_t>(ForwardScratch::kK, plan.kv_rows * c.KWidth());
    v = scratch.Get<uint16_t>(ForwardScratch::kV, plan.kv_rows * c.VWidth());
    q_->Forward(pool, x, plan.q_rows, w.q_bias, q);
    k_->Forward(pool, xk != nullptr ? xk : x, plan.kv_rows, w.k_bias, k);
    v_->Forward(pool, xv != nullptr ? xv : x, plan.kv_rows, w.v_bias, v);
  }
  return AttendPlannedBf16(plan, inputs, q, k, v, attended, kernel_, pool);
}

void CpuBf16Layer::ProjectOutput(ThreadPool& pool, const float* attended, int64_t rows,
                                 float* output) const {
  const MhaConfig& c = config_;
  if (!c.output_projection) {
    std::copy(attended, attended + rows * c.AttentionWidth(), output);
    return;
  }
  ForwardScratch& scratch = ThreadScratch();
  uint16_t* rounded = scratch.Get<uint16_t>(ForwardScratch::kRounded, rows * c.AttentionWidth());
  RoundToBf16(attended, rows * c.AttentionWidth(), rounded, kernel_);
  out_->Forward(pool, rounded, rows, weights_.out_bias, output);
}

absl::StatusOr<std::vector<AttentionResult>> CpuBf16Layer::ForwardBatch(
    absl::Span<const MhaInput* const> inputs) const {
  // The batch's parts: each input whole, or each of its sequences where it splits.
  std::vector<BatchPart> part_sizes;
  for (const MhaInput* input : inputs) {
    const MhaInput& in = *input;
    if (SplitsIntoSequences(in)) {
      part_sizes.insert(part_sizes.end(), in.batch, {in.q_len, in.kv_len});
    } else {
      part_sizes.push_back({in.batch * in.q_len, in.kv_len});
    }
  }
  const std::vector<std::vector<size_t>> groups =
      GroupBatchParts(config_.embed_dim, part_sizes, pool_.size());
  if (groups.empty()) return ForwardOn(pool_, inputs);
  std::vector<AttentionResult> results;
  const BatchParts split = SplitBatch(inputs, config_.output_dim, results);
  pool_.ParallelFor(static_cast<int64_t>(groups.size()), [&](int64_t g) {
    std::vector<const MhaInput*> members;
    for (size_t part : groups[g]) members.push_back(split.parts[part]);
    std::vector<AttentionResult> answers = ForwardOn(claiming_thread_, members);
    for (size_t i = 0; i < members.size(); ++i) {
      const int64_t n = split.whole_input[groups[g][i]];
      if (n >= 0) results[n] = std::move(answers[i]);
    }
  });
  return results;
}

std::vector<AttentionResult> CpuBf16Layer::ForwardOn(
    ThreadPool& pool, absl::Span<const MhaInput* const> inputs) const {
  const MhaConfig& c = config_;
  const ForwardPlan plan = PlanForward(c, inputs, fused_qkv_.has_value());
  const int64_t q_rows = plan.q_rows, kv_rows = plan.kv_rows;
  ForwardScratch& scratch = ThreadScratch();
  // Every input's tokens in bf16, packed into one matrix (keys' and values' too for
  // cross-attention).
  uint16_t* x = scratch.Get<uint16_t>(ForwardScratch::kX, q_rows * c.embed_dim);
  uint16_t* xk = plan.all_self_attention
                     ? nullptr
                     : scratch.Get<uint16_t>(ForwardScratch::kKeyInput, kv_rows * c.kdim);
  uint16_t* xv = plan.all_self_attention
                     ? nullptr
                     : scratch.Get<uint16_t>(ForwardScratch::kValueInput, kv_rows * c.vdim);
  std::vector<TokenChunk> chunks;
  for (size_t n = 0; n < inputs.size(); ++n) {
    const MhaInput& in = *inputs[n];
    const ForwardPlan::Input& planned = plan.inputs[n];
    AddTokenChunks(in.query, in.query_half, in.half_dtype, x + planned.q_row * c.embed_dim, chunks);
    if (xk == nullptr) continue;
    const bool self = in.self_attention();
    AddTokenChunks(self ? in.query : in.key, self ? in.query_half : in.key_half, in.half_dtype,
                   xk + planned.kv_row * c.kdim, chunks);
    AddTokenChunks(self ? in.query : in.value, self ? in.query_half : in.value_half, in.half_dtype,
                   xv + planned.kv_row * c.vdim, chunks);
  }
  // Rounding a large batch is bound by memory bandwidth, which one thread does not reach.
  const auto convert = [&](int64_t i) {
    const TokenChunk& chunk = chunks[i];
    ToBf16(chunk.values, chunk.half, chunk.half_dtype, chunk.to, kernel_);
  };
  if (chunks.size() > 1) {
    pool.ParallelFor(static_cast<int64_t>(chunks.size()), convert);
  } else if (!chunks.empty()) {
    convert(0);
  }
  // A lone input's output projection writes straight to its destination. (Taken after
  // attention, which may use kProjected for a fused layer's cross-attention.)
  const bool project_to_destination = inputs.size() == 1 && !inputs[0]->output_destination.empty();
  const auto output = [&] {
    return project_to_destination ? inputs[0]->output_destination.data()
                                  : scratch.Get(ForwardScratch::kProjected, q_rows * c.output_dim);
  };
  std::vector<AttentionResult> results;
  if (AttendsToBf16()) {
    uint16_t* attended =
        scratch.Get<uint16_t>(ForwardScratch::kRounded, q_rows * c.AttentionWidth());
    results = ProjectsToBf16(plan, inputs)
                  ? ProjectAndAttendInBf16(pool, plan, inputs, x, xk, xv, attended)
                  : ProjectAndAttend(pool, plan, inputs, x, xk, xv, nullptr, attended);
    // A lone caller that asked for bf16 gets it from the projection, with no float32 pass.
    if (inputs.size() == 1 && !inputs[0]->output_destination_bf16.empty()) {
      out_->Forward(pool, attended, q_rows, weights_.out_bias,
                    inputs[0]->output_destination_bf16.data());
      return results;
    }
    out_->Forward(pool, attended, q_rows, weights_.out_bias, output());
  } else {
    float* attended = scratch.Get(ForwardScratch::kAttended, q_rows * c.AttentionWidth());
    results = ProjectAndAttend(pool, plan, inputs, x, xk, xv, attended, nullptr);
    ProjectOutput(pool, attended, q_rows, output());
  }
  if (!project_to_destination) DeliverPlanned(plan, inputs, output(), c.output_dim, results);
  return results;
}

std::vector<AttentionResult> CpuBf16Layer::ProjectAndAttend(
    ThreadPool& pool, const ForwardPlan& plan, absl::Span<const MhaInput* const> inputs,
    const uint16_t* x, const uint16_t* xk, const uint16_t* xv, float* attended,
    uint16_t* attended_bf16) const {
  const MhaConfig& c = config_;
  const MhaWeightsView& w = weights_;
  const int64_t q_rows = plan.q_rows, kv_rows = plan.kv_rows;
  ForwardScratch& scratch = ThreadScratch();
  float *q, *k, *v;
  if (plan.fused_qkv) {
    q = scratch.Get(ForwardScratch::kQ, q_rows * plan.q_stride);
    ProjectSelf(pool, x, q_rows, q, nullptr, nullptr);
    k = q + c.QWidth();
    v = k + c.KWidth();
  } else {
    q = scratch.Get(ForwardScratch::kQ, q_rows * c.QWidth());
    k = scratch.Get(ForwardScratch::kK, kv_rows * c.KWidth());
    v = scratch.Get(ForwardScratch::kV, kv_rows * c.VWidth());
    if (!fused_qkv_.has_value()) {
      q_->Forward(pool, x, q_rows, w.q_bias, q);
      k_->Forward(pool, xk != nullptr ? xk : x, kv_rows, w.k_bias, k);
      v_->Forward(pool, xv != nullptr ? xv : x, kv_rows, w.v_bias, v);
    } else {
      // Cross-attention on a layer stored fused (kdim == vdim == E, but separate key and
      // value tokens sent): each token set through the whole fused GEMM, keeping its
      // columns. Three times the work, for a rare mix; no second copy of the weights.
      const int64_t width = c.QWidth() + c.KWidth() + c.VWidth();
      const int64_t most_rows = std::max(q_rows, kv_rows);
      float* fused = scratch.Get(ForwardScratch::kProjected, most_rows * width);
      const auto project = [&](const uint16_t* tokens, int64_t rows, int64_t first_column,
                               int64_t columns, float* to) {
        fused_qkv_->Forward(pool, tokens, rows, w.fused_qkv_bias, fused);
        for (int64_t r = 0; r < rows; ++r) {
          std::copy_n(fused + r * width + first_column, columns, to + r * columns);
        }
      };
      project(x, q_rows, 0, c.QWidth(), q);
      project(xk, kv_rows, c.QWidth(), c.KWidth(), k);
      project(xv, kv_rows, c.QWidth() + c.KWidth(), c.VWidth(), v);
    }
  }
  RotatePlanned(c, plan, q, k, pool);
  if (attended_bf16 != nullptr) {
    return AttendPlanned(plan, inputs, q, k, v, attended_bf16, kernel_, pool);
  }
  return AttendPlanned(
      plan, inputs, q, k, v, attended,
      kernel_ == Bf16Kernel::kPortable ? std::nullopt : std::optional<Bf16Kernel>(kernel_), pool);
}

absl::Status CpuBf16Layer::ProjectForDecode(const float* x, absl::Span<const int64_t> positions,
                                            float* q, float* k, float* v) const {
  const MhaConfig& c = config_;
  const auto rows = static_cast<int64_t>(positions.size());
  ForwardScratch& scratch = ThreadScratch();
  uint16_t* tokens = scratch.Get<uint16_t>(ForwardScratch::kX, rows * c.embed_dim);
  RoundToBf16(x, rows * c.embed_dim, tokens, kernel_);
  if (fused_qkv_.has_value()) {
    const int64_t width = c.QWidth() + c.KWidth() + c.VWidth();
    float* qkv = scratch.Get(ForwardScratch::kQ, rows * width);
    ProjectSelf(pool_, tokens, rows, qkv, nullptr, nullptr);
    SplitFusedRows(c, qkv, rows, q, k, v);
  } else {
    ProjectSelf(pool_, tokens, rows, q, k, v);
  }
  RotateAtPositions(c, positions, q, k);
  return absl::OkStatus();
}

absl::Status CpuBf16Layer::ProjectDecodeOutput(const float* attended, int64_t rows,
                                               float* output) const {
  ProjectOutput(pool_, attended, rows, output);
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<PreparedLayer> PrepareBf16Layer(const MhaConfig& config,
                                                const MhaWeightsView& weights, ThreadPool& pool,
                                                Bf16Kernel kernel, Bf16Projection projection) {
  return std::make_unique<CpuBf16Layer>(config, weights, pool, kernel, projection);
}

}  // namespace attention::core

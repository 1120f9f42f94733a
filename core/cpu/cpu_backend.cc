#include "core/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <optional>
#include <vector>

#include <cblas.h>

#include "absl/strings/str_cat.h"

#include "core/attention_kernels.h"
#include "core/cpu/attention_cpu.h"
#include "core/cpu/bf16_layer.h"
#include "core/cpu/float32_linear.h"
#include "core/cpu/forward_scratch.h"
#include "core/cpu/forward_steps.h"
#include "core/cpu/gemm.h"
#include "core/forward_plan.h"
#include "core/half_bits.h"

namespace attention::core {
namespace {

// Every projection runs on the kernel set the backend chose (core/cpu/float32_linear.h), at
// every row count: the microkernel on a copy of the weights packed once (core/cpu/gemm.h),
// or oneDNN reading the host weights in place. The pool is the backend's.
class CpuPreparedLayer final : public PreparedLayer {
 public:
  CpuPreparedLayer(const MhaConfig& config, const MhaWeightsView& weights, ThreadPool& pool,
                   std::optional<Float32Projection> projection)
      : config_(config), weights_(weights), pool_(pool) {
    const MhaConfig& c = config;
    const MhaWeightsView& w = weights;
    const int64_t q = c.QWidth(), k = c.KWidth(), v = c.VWidth();
    const float *q_panels = nullptr, *k_panels = nullptr, *v_panels = nullptr;
    if (!w.fused_qkv_weight.empty()) {
      packed_qkv_.emplace(w.fused_qkv_weight, q + k + v, c.embed_dim);
      qkv_.emplace(w.fused_qkv_weight, w.fused_qkv_bias, q + k + v, c.embed_dim,
                   packed_qkv_->panels(), projection);
      // Cross-attention projects Q, K and V apart: the fused panels serve when each part
      // starts on a panel boundary; otherwise each part is packed apart as well.
      if (q % kPanelWidth == 0 && k % kPanelWidth == 0) {
        q_panels = packed_qkv_->panels();
        k_panels = q_panels + PanelFloats(c.embed_dim, q);
        v_panels = k_panels + PanelFloats(c.embed_dim, k);
      }
    }
    if (q_panels == nullptr) {
      q_panels = packed_q_.emplace(w.q_weight, q, c.embed_dim).panels();
      k_panels = packed_k_.emplace(w.k_weight, k, c.kdim).panels();
      v_panels = packed_v_.emplace(w.v_weight, v, c.vdim).panels();
    }
    q_.emplace(w.q_weight, w.q_bias, q, c.embed_dim, q_panels, projection);
    k_.emplace(w.k_weight, w.k_bias, k, c.kdim, k_panels, projection);
    v_.emplace(w.v_weight, w.v_bias, v, c.vdim, v_panels, projection);
    if (c.output_projection) {
      packed_out_.emplace(w.out_weight, c.output_dim, c.AttentionWidth());
      out_.emplace(w.out_weight, w.out_bias, c.output_dim, c.AttentionWidth(),
                   packed_out_->panels(), projection);
    }
  }

  // The projections of all inputs run over every token of the batch at once (Q, K and V as
  // one GEMM for self-attention when they are fused), attention per sequence, head and
  // query block, one GEMM for the output.
  absl::StatusOr<std::vector<AttentionResult>> ForwardBatch(
      absl::Span<const MhaInput* const> inputs) const override;
  // Sessions' decode entry: the same projections over the given rows, RoPE at each row's
  // absolute position.
  bool HasDecodeEntry() const override { return true; }
  absl::Status ProjectForDecode(const float* x, absl::Span<const int64_t> positions, float* q,
                                float* k, float* v) const override;
  absl::Status ProjectDecodeOutput(const float* attended, int64_t rows,
                                   float* output) const override;
  // The packed copies, held besides the host weights.
  int64_t DeviceWeightBytes() const override {
    int64_t bytes = 0;
    for (const auto* packed : {&packed_qkv_, &packed_q_, &packed_k_, &packed_v_, &packed_out_}) {
      if (packed->has_value()) bytes += (*packed)->bytes();
    }
    return bytes;
  }

 private:
  const MhaConfig config_;
  const MhaWeightsView weights_;
  ThreadPool& pool_;
  std::optional<PackedWeight> packed_qkv_, packed_q_, packed_k_, packed_v_, packed_out_;
  // The projections on those panels (Q, K and V apart on the fused ones where each part
  // starts on a panel, else on their own), or on the host weights in place (oneDNN).
  std::optional<Float32Linear> qkv_, q_, k_, v_, out_;
};

absl::StatusOr<std::vector<AttentionResult>> CpuPreparedLayer::ForwardBatch(
    absl::Span<const MhaInput* const> given) const {
  // 16-bit inputs are decoded on the host (the server only sends them to backends that
  // convert on a device, so this is the fallback).
  std::deque<std::vector<float>> decoded;
  std::vector<MhaInput> float_inputs;
  std::vector<const MhaInput*> pointers(given.begin(), given.end());
  if (std::any_of(given.begin(), given.end(), [](const MhaInput* in) { return in->is_half(); })) {
    for (const MhaInput* in : given) float_inputs.push_back(WithFloatInputs(*in, &decoded));
    for (size_t n = 0; n < given.size(); ++n) pointers[n] = &float_inputs[n];
  }
  const absl::Span<const MhaInput* const> inputs = pointers;
  const MhaConfig& c = config_;
  const MhaWeightsView& w = weights_;
  const ForwardPlan plan = PlanForward(c, inputs, !w.fused_qkv_weight.empty());
  const int64_t q_rows = plan.q_rows, kv_rows = plan.kv_rows;
  thread_local ForwardScratch scratch;
  // A single input is used in place; a batch is packed into one token matrix. Key and
  // value inputs are the query rows themselves for self-attention.
  const bool pack_queries = inputs.size() != 1;
  float* packed_x = pack_queries ? scratch.Get(ForwardScratch::kX, q_rows * c.embed_dim) : nullptr;
  float* xk =
      plan.all_self_attention ? nullptr : scratch.Get(ForwardScratch::kKeyInput, kv_rows * c.kdim);
  float* xv = plan.all_self_attention ? nullptr
                                      : scratch.Get(ForwardScratch::kValueInput, kv_rows * c.vdim);
  for (size_t n = 0; n < inputs.size(); ++n) {
    PackInputTokens(c, plan.inputs[n], *inputs[n], packed_x, xk, xv);
  }
  const float* x = pack_queries ? packed_x : inputs[0]->query.data();
  const float* key_input = plan.all_self_attention ? x : xk;
  const float* value_input = plan.all_self_attention ? x : xv;
  // Projected Q, K and V rows, at the plan's strides.
  float *q, *k, *v;
  if (plan.fused_qkv) {
    // One GEMM for all three: [T, E] x [E, Q + K + V]; Q, K, V are column ranges of it.
    q = scratch.Get(ForwardScratch::kQ, q_rows * plan.q_stride);
    qkv_->Forward(pool_, x, q_rows, q);
    k = q + c.QWidth();
    v = k + c.KWidth();
  } else {
    q = scratch.Get(ForwardScratch::kQ, q_rows * c.QWidth());
    k = scratch.Get(ForwardScratch::kK, kv_rows * c.KWidth());
    v = scratch.Get(ForwardScratch::kV, kv_rows * c.VWidth());
    q_->Forward(pool_, x, q_rows, q);
    k_->Forward(pool_, key_input, kv_rows, k);
    v_->Forward(pool_, value_input, kv_rows, v);
  }
  RotatePlanned(c, plan, q, k, pool_);
  float* attended = scratch.Get(ForwardScratch::kAttended, q_rows * c.AttentionWidth());
  std::vector<AttentionResult> results =
      AttendPlanned(plan, inputs, q, k, v, attended, /*bf16_products=*/std::nullopt, pool_);
  if (!c.output_projection) {
    DeliverPlanned(plan, inputs, attended, c.output_dim, results);
    return results;
  }
  // A lone input's output projection writes straight to its destination.
  const bool project_to_destination = inputs.size() == 1 && !inputs[0]->output_destination.empty();
  float* projected = project_to_destination
                         ? inputs[0]->output_destination.data()
                         : scratch.Get(ForwardScratch::kProjected, q_rows * c.output_dim);
  out_->Forward(pool_, attended, q_rows, projected);
  if (!project_to_destination) DeliverPlanned(plan, inputs, projected, c.output_dim, results);
  return results;
}

absl::Status CpuPreparedLayer::ProjectForDecode(const float* x, absl::Span<const int64_t> positions,
                                                float* q, float* k, float* v) const {
  const MhaConfig& c = config_;
  const auto rows = static_cast<int64_t>(positions.size());
  if (qkv_.has_value()) {
    // One GEMM for all three, as ForwardBatch runs self-attention, then split: a prefill
    // chunk's three GEMMs apart measured 0.86-0.95 of the stateless layer.
    const int64_t width = c.QWidth() + c.KWidth() + c.VWidth();
    thread_local ForwardScratch scratch;
    float* qkv = scratch.Get(ForwardScratch::kQ, rows * width);
    qkv_->Forward(pool_, x, rows, qkv);
    SplitFusedRows(c, qkv, rows, q, k, v);
  } else {
    q_->Forward(pool_, x, rows, q);
    k_->Forward(pool_, x, rows, k);
    v_->Forward(pool_, x, rows, v);
  }
  RotateAtPositions(c, positions, q, k);
  return absl::OkStatus();
}

absl::Status CpuPreparedLayer::ProjectDecodeOutput(const float* attended, int64_t rows,
                                                   float* output) const {
  out_->Forward(pool_, attended, rows, output);
  return absl::OkStatus();
}

// The bf16 matrices of a BFLOAT16 layer widened to float32 once, with a float32 view of
// them (the biases are float32 already).
struct WidenedBf16Weights {
  explicit WidenedBf16Weights(const MhaWeightsView& weights) : view(weights) {
    const auto widen = [](absl::Span<const uint16_t> bits, std::vector<float>& to) {
      to.resize(bits.size());
      for (size_t i = 0; i < bits.size(); ++i) to[i] = BFloat16BitsToFloat(bits[i]);
      return absl::Span<const float>(to);
    };
    const MhaWeightsView::Bf16Matrices& bf16 = weights.bf16;
    view.q_weight = widen(bf16.q_weight, q);
    view.k_weight = widen(bf16.k_weight, k);
    view.v_weight = widen(bf16.v_weight, v);
    view.out_weight = widen(bf16.out_weight, out);
    view.fused_qkv_weight = widen(bf16.fused_qkv_weight, fused_qkv);
  }
  WidenedBf16Weights(const WidenedBf16Weights&) = delete;
  WidenedBf16Weights& operator=(const WidenedBf16Weights&) = delete;

  int64_t bytes() const {
    return static_cast<int64_t>(q.size() + k.size() + v.size() + out.size() + fused_qkv.size()) *
           static_cast<int64_t>(sizeof(float));
  }

  std::vector<float> q, k, v, out, fused_qkv;
  MhaWeightsView view;
};

// One input tensor (float32 `values`, or 16-bit `half` of `dtype`) as bf16 values widened
// to float32 into `to`: one pass, rounding what is not bf16 already.
absl::Span<const float> AsBf16Values(absl::Span<const float> values,
                                     absl::Span<const uint16_t> half, DType dtype,
                                     std::vector<float>& to) {
  const auto round = [](float value) { return BFloat16BitsToFloat(FloatToBFloat16Bits(value)); };
  to.resize(dtype == DType::kFloat32 ? values.size() : half.size());
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < to.size(); ++i) to[i] = BFloat16BitsToFloat(half[i]);
  } else if (dtype == DType::kFloat16) {
    for (size_t i = 0; i < to.size(); ++i) to[i] = round(HalfBitsToFloat(half[i]));
  } else {
    for (size_t i = 0; i < to.size(); ++i) to[i] = round(values[i]);
  }
  return to;
}

// A BFLOAT16 layer where the host multiplies bf16 fastest in float32 (Bf16ComputesInFloat32):
// the float32 layer on the bf16 weights widened once, every token rounded to bf16 as bf16
// layers take them. Q, K, V and the attended rows stay float32, more accurate than bf16, and
// the projections run where float32 layers' do (OpenBLAS for many rows): bf16 layers grouped
// on widened panels ran at 0.84-0.88 x the float32 layer on Zen 3 (one thread).
class Bf16OnFloat32Layer final : public PreparedLayer {
 public:
  Bf16OnFloat32Layer(const MhaConfig& config, const MhaWeightsView& weights, ThreadPool& pool,
                     std::optional<Float32Projection> projection)
      : embed_dim_(config.embed_dim),
        widened_(weights),
        pool_(pool),
        layer_(config, widened_.view, pool, projection) {}

  absl::StatusOr<std::vector<AttentionResult>> ForwardBatch(
      absl::Span<const MhaInput* const> inputs) const override {
    std::vector<MhaInput> rounded(inputs.size());
    // Kept per calling thread, as ForwardScratch is: no page faults on every call.
    // (A reference: in the pool's threads the name would be their own thread_local.)
    thread_local std::vector<std::vector<float>> this_threads_storage;
    std::vector<std::vector<float>>& storage = this_threads_storage;
    if (storage.size() < 3 * inputs.size()) storage.resize(3 * inputs.size());
    pool_.ParallelFor(static_cast<int64_t>(inputs.size()), [&](int64_t n) {
      const MhaInput& given = *inputs[n];
      MhaInput& in = rounded[n] = given;
      std::vector<float>* to = &storage[3 * n];
      in.query = AsBf16Values(given.query, given.query_half, given.half_dtype, to[0]);
      in.key = AsBf16Values(given.key, given.key_half, given.half_dtype, to[1]);
      in.value = AsBf16Values(given.value, given.value_half, given.half_dtype, to[2]);
      in.half_dtype = DType::kFloat32;
      in.query_half = in.key_half = in.value_half = {};
    });
    std::vector<const MhaInput*> pointers;
    for (const MhaInput& in : rounded) pointers.push_back(&in);
    return layer_.ForwardBatch(pointers);
  }
  bool HasDecodeEntry() const override { return true; }
  absl::Status ProjectForDecode(const float* x, absl::Span<const int64_t> positions, float* q,
                                float* k, float* v) const override {
    thread_local std::vector<float> tokens;
    const auto count = static_cast<size_t>(positions.size() * embed_dim_);
    AsBf16Values(absl::MakeConstSpan(x, count), {}, DType::kFloat32, tokens);
    return layer_.ProjectForDecode(tokens.data(), positions, q, k, v);
  }
  absl::Status ProjectDecodeOutput(const float* attended, int64_t rows,
                                   float* output) const override {
    return layer_.ProjectDecodeOutput(attended, rows, output);
  }
  // The widened weights and the float32 layer's packed copy.
  int64_t DeviceWeightBytes() const override {
    return widened_.bytes() + layer_.DeviceWeightBytes();
  }

 private:
  const int64_t embed_dim_;
  const WidenedBf16Weights widened_;
  ThreadPool& pool_;
  const CpuPreparedLayer layer_;
};

}  // namespace

RotaryAngles::RotaryAngles(absl::Span<const int64_t> positions, int64_t head_dim, double base,
                           const RopeScaling& scaling)
    : base_(base) {
  const int64_t half = head_dim / 2;
  std::vector<double> inverse_frequency(half);
  for (int64_t c = 0; c < half; ++c) {
    inverse_frequency[c] = RotaryInverseFrequency(c, head_dim, base, scaling);
  }
  cos_.resize(positions.size() * half);
  sin_.resize(positions.size() * half);
  for (size_t p = 0; p < positions.size(); ++p) {
    const auto position = static_cast<double>(positions[p]);
    for (int64_t c = 0; c < half; ++c) {
      cos_[p * half + c] = static_cast<float>(std::cos(position * inverse_frequency[c]));
      sin_[p * half + c] = static_cast<float>(std::sin(position * inverse_frequency[c]));
    }
  }
}

RotaryAngles RotaryAngles::FirstPositions(int64_t count, int64_t head_dim, double base,
                                          const RopeScaling& scaling) {
  std::vector<int64_t> positions(count);
  for (int64_t p = 0; p < count; ++p) positions[p] = p;
  return RotaryAngles(positions, head_dim, base, scaling);
}

namespace {

// One row's heads rotated by the angles of row `angle_row` of `angles`: the inner loop
// runs along a head's contiguous channels, so it vectorizes.
void RotateRow(float* row, int64_t heads, int64_t head_dim, const RotaryAngles& angles,
               int64_t angle_row) {
  const int64_t half = head_dim / 2;
  const float* cos_a = angles.cos(angle_row, half);
  const float* sin_a = angles.sin(angle_row, half);
  for (int64_t h = 0; h < heads; ++h) {
    float* x = row + h * head_dim;
    for (int64_t c = 0; c < half; ++c) {
      const float x1 = x[c], x2 = x[c + half];
      x[c] = x1 * cos_a[c] - x2 * sin_a[c];
      x[c + half] = x2 * cos_a[c] + x1 * sin_a[c];
    }
  }
}

}  // namespace

void ApplyRotary(float* data, int64_t rows, int64_t seq_len, int64_t heads, int64_t head_dim,
                 double base, int64_t row_stride, const RopeScaling& scaling) {
  ApplyRotary(data, rows, seq_len, heads, head_dim,
              RotaryAngles::FirstPositions(std::min(rows, seq_len), head_dim, base, scaling),
              row_stride, nullptr);
}

void ApplyRotary(float* data, int64_t rows, int64_t seq_len, int64_t heads, int64_t head_dim,
                 const RotaryAngles& angles, int64_t row_stride, ThreadPool* pool) {
  constexpr int64_t kRowsPerTask = 256;
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  const auto rotate = [&](int64_t task) {
    const int64_t end = std::min(rows, (task + 1) * kRowsPerTask);
    for (int64_t r = task * kRowsPerTask; r < end; ++r) {
      RotateRow(data + r * row_stride, heads, head_dim, angles, r % seq_len);
    }
  };
  if (pool != nullptr && tasks > 1) {
    pool->ParallelFor(tasks, rotate);
  } else {
    for (int64_t task = 0; task < tasks; ++task) rotate(task);
  }
}

void ApplyRotaryAt(float* data, absl::Span<const int64_t> positions, int64_t heads,
                   int64_t head_dim, double base, int64_t row_stride, const RopeScaling& scaling) {
  const RotaryAngles angles(positions, head_dim, base, scaling);
  for (size_t r = 0; r < positions.size(); ++r) {
    RotateRow(data + r * row_stride, heads, head_dim, angles, static_cast<int64_t>(r));
  }
}

std::string CpuBackend::BlasCore() { return openblas_get_corename(); }

std::string CpuBackend::Bf16Path() const {
  if (Bf16ComputesInFloat32()) {
    return absl::StrCat(
        "float32 kernels on the bf16 values, as float32 layers run (measured: projections ",
        Bf16ProjectionReport(), "; attention products ", Bf16ProductsReport(), ")");
  }
  return absl::StrCat("projections on ", Bf16ProjectionName(bf16_projection_),
                      " (measured: ", Bf16ProjectionReport(),
                      "), attention products (and sessions' shared prefixes over bf16 KV) on ",
                      Bf16ProductsName(bf16_kernel_), " (measured: ", Bf16ProductsReport(), ")");
}

std::string CpuBackend::Float32Path() const {
  const std::string measured = Float32ProjectionReport(pool_.size());
  return absl::StrCat(
      "every row count on ",
      Float32ProjectionName(float32_projection_.value_or(FastestFloat32Projection(pool_.size()))),
      float32_projection_.has_value() ? ", forced" : "", " (measured: ", measured, ")");
}

absl::StatusOr<std::unique_ptr<PreparedLayer>> CpuBackend::Prepare(
    const MhaConfig& config, const MhaWeightsView& weights) const {
  if (config.compute_dtype == DType::kBFloat16 && Bf16ComputesInFloat32()) {
    return std::make_unique<Bf16OnFloat32Layer>(config, weights, pool_, float32_projection_);
  }
  if (config.compute_dtype == DType::kBFloat16) {
    return PrepareBf16Layer(config, weights, pool_, bf16_kernel_, bf16_projection_);
  }
  return std::make_unique<CpuPreparedLayer>(config, weights, pool_, float32_projection_);
}

absl::StatusOr<AttentionResult> CpuBackend::ScaledDotProductAttention(
    const SdpaInput& in) const {
  const AttentionDims& d = in.dims;
  AttentionResult result;
  result.output.resize(d.batch * d.num_heads * d.q_len * d.v_head_dim);
  if (in.options.need_weights != NeedWeights::kNone) {
    result.weights.resize(d.batch * d.num_heads * d.q_len * d.kv_len);
  }
  AttentionProblem problem = SdpaProblem(in, result);
  // Where float32 products are the host's fastest, bf16 compute is float32: as fast and
  // more accurate.
  if (bf16_kernel_ == Bf16Kernel::kPortable) problem.bf16_products = false;
  AttentionBlockedCpu(absl::MakeConstSpan(&problem, 1), pool_, bf16_kernel_);
  FinishWeights(result, d, in.options.need_weights);
  return result;
}

}  // namespace attention::core

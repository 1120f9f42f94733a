#include "core/mha_layer.h"

#include <algorithm>
#include <cmath>

#include "core/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace attention::core {
namespace {

// Textbook linear layer in T: y[r, o] = sum_i x[r, i] * w[o, i] + bias[o], in order.
template <typename T>
std::vector<T> LinearTextbook(const T* x, int64_t rows, int64_t in_features,
                              absl::Span<const float> weight, absl::Span<const float> bias,
                              int64_t out_features) {
  std::vector<T> y(rows * out_features);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out_features; ++o) {
      T sum = 0;
      for (int64_t i = 0; i < in_features; ++i) {
        sum += x[r * in_features + i] * static_cast<T>(weight[o * in_features + i]);
      }
      if (!bias.empty()) sum += bias[o];
      y[r * out_features + o] = sum;
    }
  }
  return y;
}

// Errors name the config.rope_scaling field and its value.
absl::Status ValidateRopeScaling(const MhaConfig& c) {
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScaling::kNone) return absl::OkStatus();
  if (!(c.rope_theta > 0.0)) {
    return absl::InvalidArgumentError("config.rope_scaling needs config.rope_theta > 0");
  }
  if (!(s.factor > 0.0) || !std::isfinite(s.factor)) {
    return absl::InvalidArgumentError(absl::StrCat("config.rope_scaling.factor = ", s.factor,
                                                   " must be finite and > 0"));
  }
  if (s.type == RopeScaling::kLinear) return absl::OkStatus();
  if (s.original_max_positions < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.rope_scaling.original_max_position_embeddings = ",
                     s.original_max_positions, " must be >= 1"));
  }
  if (s.type == RopeScaling::kDynamic) {
    if (c.head_dim <= 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.head_dim = ", c.head_dim, " must be > 2 for dynamic rope scaling"));
    }
    return absl::OkStatus();
  }
  if (!(s.low_freq_factor > 0.0) || !(s.high_freq_factor > s.low_freq_factor) ||
      !std::isfinite(s.high_freq_factor)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.rope_scaling.low_freq_factor = ", s.low_freq_factor, " and high_freq_factor = ",
        s.high_freq_factor, " must satisfy 0 < low_freq_factor < high_freq_factor"));
  }
  return absl::OkStatus();
}

// Rotary positions in T; the angles' cosines and sines in double, rounded to T (as the
// tables of PyTorch models are).
template <typename T>
void RotaryTextbook(std::vector<T>& data, int64_t rows, int64_t seq_len, int64_t heads,
                    int64_t head_dim, double base, const RopeScaling& scaling) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const double position = static_cast<double>(r % seq_len);
    for (int64_t h = 0; h < heads; ++h) {
      T* x = data.data() + (r * heads + h) * head_dim;
      for (int64_t c = 0; c < half; ++c) {
        const double angle = position * RotaryInverseFrequency(c, head_dim, base, scaling);
        const T cos = static_cast<T>(std::cos(angle)), sin = static_cast<T>(std::sin(angle));
        const T x1 = x[c], x2 = x[c + half];
        x[c] = x1 * cos - x2 * sin;
        x[c + half] = x2 * cos + x1 * sin;
      }
    }
  }
}

template <typename T>
std::vector<T> Converted(absl::Span<const float> values) {
  return std::vector<T>(values.begin(), values.end());
}

AttentionResult Rounded(const TextbookResult<double>& result) {
  return {std::vector<float>(result.output.begin(), result.output.end()),
          std::vector<float>(result.weights.begin(), result.weights.end())};
}

}  // namespace

absl::StatusOr<MhaConfig> MhaConfig::Resolve(MhaConfig c) {
  if (c.embed_dim < 1) return Invalid("config.embed_dim = ", c.embed_dim, " must be >= 1");
  if (c.num_heads < 1) return Invalid("config.num_heads = ", c.num_heads, " must be >= 1");
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  RETURN_IF_ERROR(
      CheckHeadGroups(c.num_heads, c.num_kv_heads, "config.num_heads", "config.num_kv_heads"));
  if (c.head_dim == 0) {
    if (c.embed_dim % c.num_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "config.num_heads = ", c.num_heads, " does not divide config.embed_dim = ",
          c.embed_dim, " (set config.head_dim to choose the head size explicitly)"));
    }
    c.head_dim = c.embed_dim / c.num_heads;
  }
  if (c.head_dim < 1) return Invalid("config.head_dim = ", c.head_dim, " must be >= 1");
  if (c.v_head_dim == 0) c.v_head_dim = c.head_dim;
  if (c.v_head_dim < 1) return Invalid("config.v_head_dim = ", c.v_head_dim, " must be >= 1");
  if (c.kdim == 0) c.kdim = c.embed_dim;
  if (c.kdim < 1) return Invalid("config.kdim = ", c.kdim, " must be >= 1");
  if (c.vdim == 0) c.vdim = c.embed_dim;
  if (c.vdim < 1) return Invalid("config.vdim = ", c.vdim, " must be >= 1");
  if (c.output_dim == 0) c.output_dim = c.output_projection ? c.embed_dim : c.AttentionWidth();
  if (c.output_dim < 1) return Invalid("config.output_dim = ", c.output_dim, " must be >= 1");
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
    return Invalid("config.head_dim = ", c.head_dim, " must be even when config.rope_theta is set");
  }
  RETURN_IF_ERROR(ValidateRopeScaling(c));
  if (c.sliding_window < 0 || (c.sliding_window > 0 && !c.always_causal)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.sliding_window = ", c.sliding_window,
        c.sliding_window < 0 ? " must be >= 0"
                             : " needs config.always_causal (the window applies with causal)"));
  }
  if (c.compute_dtype != DType::kFloat32 && c.compute_dtype != DType::kBFloat16) {
    return Invalid("config.compute_dtype = ", DTypeName(c.compute_dtype),
                   " is not a compute precision; expected FLOAT32 or BFLOAT16");
  }
  constexpr int64_t kMaxDim = 1 << 16;  // keeps every weight matrix far below 2^63 elements
  for (auto [name, value] :
       {std::pair<const char*, int64_t>{"config.embed_dim", c.embed_dim},
        {"config.num_heads", c.num_heads}, {"config.head_dim", c.head_dim},
        {"config.v_head_dim", c.v_head_dim}, {"config.kdim", c.kdim}, {"config.vdim", c.vdim},
        {"config.output_dim", c.output_dim}}) {
    if (value > kMaxDim) return Invalid(name, " = ", value, " exceeds ", kMaxDim);
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

absl::StatusOr<std::shared_ptr<const MhaLayer>> MhaLayer::Create(
    const MhaConfig& config, MhaWeights weights, std::shared_ptr<const Backend> backend) {
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
  std::shared_ptr<MhaLayer> layer(new MhaLayer(config, std::move(weights), std::move(backend)));
  ASSIGN_OR_RETURN(layer->prepared_, layer->backend_->Prepare(config, layer->WeightsView()));
  return std::shared_ptr<const MhaLayer>(std::move(layer));
}

MhaLayer::MhaLayer(const MhaConfig& config, MhaWeights weights,
                   std::shared_ptr<const Backend> backend)
    : config_(config), weights_(std::move(weights)), backend_(std::move(backend)) {
  if (config_.kdim == config_.embed_dim && config_.vdim == config_.embed_dim) FuseQkv();
  if (config_.compute_dtype == DType::kBFloat16) HoldBf16();
}

void MhaLayer::FuseQkv() {
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

void MhaLayer::HoldBf16() {
  // Each float32 matrix is freed as soon as its bf16 copy exists.
  const auto round = [](std::vector<float>& from, std::vector<uint16_t>& to) {
    to.resize(from.size());
    for (size_t i = 0; i < from.size(); ++i) to[i] = FloatToBFloat16(from[i]);
    std::vector<float>().swap(from);
  };
  round(weights_.q_weight, bf16_.q_weight);
  round(weights_.k_weight, bf16_.k_weight);
  round(weights_.v_weight, bf16_.v_weight);
  round(weights_.out_weight, bf16_.out_weight);
  round(fused_qkv_weight_, bf16_.fused_qkv_weight);
  for (std::vector<float>* bias : {&weights_.q_bias, &weights_.k_bias, &weights_.v_bias,
                                   &weights_.out_bias, &fused_qkv_bias_}) {
    for (float& b : *bias) b = BFloat16ToFloat(FloatToBFloat16(b));
  }
}

int64_t MhaLayer::WeightBytes() const {
  int64_t bytes = 0;
  for (const std::vector<float>* part :
       {&weights_.q_weight, &weights_.k_weight, &weights_.v_weight, &weights_.out_weight,
        &weights_.q_bias, &weights_.k_bias, &weights_.v_bias, &weights_.out_bias,
        &fused_qkv_weight_, &fused_qkv_bias_}) {
    bytes += static_cast<int64_t>(part->size() * sizeof(float));
  }
  for (const std::vector<uint16_t>* part : {&bf16_.q_weight, &bf16_.k_weight, &bf16_.v_weight,
                                            &bf16_.out_weight, &bf16_.fused_qkv_weight}) {
    bytes += static_cast<int64_t>(part->size() * sizeof(uint16_t));
  }
  return bytes;
}

absl::Status MhaLayer::DecodeSupport() const {
  const MhaConfig& c = config_;
  if (c.kdim != c.embed_dim || c.vdim != c.embed_dim) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a session projects keys and values from the hidden states: the layer's kdim = ", c.kdim,
        " and vdim = ", c.vdim, " must equal embed_dim = ", c.embed_dim));
  }
  if (c.rope_scaling.type == RopeScaling::kDynamic) {
    return absl::FailedPreconditionError(
        "the layer's rope_scaling is dynamic, whose rotary base grows with the sequence under "
        "keys already cached; sessions need a fixed base (linear, llama3 or none)");
  }
  if (!prepared_->HasDecodeEntry()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the layer runs on ", device(),
                     ", whose backend has no decode entry for sessions; load "
                     "it on cpu"));
  }
  return absl::OkStatus();
}

MhaWeightsView MhaLayer::WeightsView() const {
  MhaWeightsView view;
  view.out_weight = weights_.out_weight;
  view.out_bias = weights_.out_bias;
  view.bf16.out_weight = bf16_.out_weight;
  if (fused_qkv_weight_.empty() && bf16_.fused_qkv_weight.empty()) {
    view.q_weight = weights_.q_weight;
    view.k_weight = weights_.k_weight;
    view.v_weight = weights_.v_weight;
    view.q_bias = weights_.q_bias;
    view.k_bias = weights_.k_bias;
    view.v_bias = weights_.v_bias;
    view.bf16.q_weight = bf16_.q_weight;
    view.bf16.k_weight = bf16_.k_weight;
    view.bf16.v_weight = bf16_.v_weight;
    return view;
  }
  const MhaConfig& c = config_;
  // Q, K and V as row ranges of the fused matrix, in whichever precision it is held.
  const auto split = [&c](auto fused, auto& q, auto& k, auto& v) {
    if (fused.empty()) return;
    q = fused.subspan(0, c.QWidth() * c.embed_dim);
    k = fused.subspan(c.QWidth() * c.embed_dim, c.KWidth() * c.embed_dim);
    v = fused.subspan((c.QWidth() + c.KWidth()) * c.embed_dim);
  };
  const absl::Span<const float> weight = fused_qkv_weight_, bias = fused_qkv_bias_;
  view.fused_qkv_weight = weight;
  view.fused_qkv_bias = bias;
  split(weight, view.q_weight, view.k_weight, view.v_weight);
  view.bf16.fused_qkv_weight = bf16_.fused_qkv_weight;
  split(view.bf16.fused_qkv_weight, view.bf16.q_weight, view.bf16.k_weight, view.bf16.v_weight);
  if (!bias.empty()) {
    view.q_bias = bias.subspan(0, c.QWidth());
    view.k_bias = bias.subspan(c.QWidth(), c.KWidth());
    view.v_bias = bias.subspan(c.QWidth() + c.KWidth());
  }
  return view;
}

MhaWeights MhaLayer::weights() const {
  MhaWeights copy = weights_;
  const MhaWeightsView view = WeightsView();
  if (config_.compute_dtype == DType::kBFloat16) {
    const auto widen = [](absl::Span<const uint16_t> bits, std::vector<float>& to) {
      to.resize(bits.size());
      for (size_t i = 0; i < bits.size(); ++i) to[i] = BFloat16ToFloat(bits[i]);
    };
    widen(view.bf16.q_weight, copy.q_weight);
    widen(view.bf16.k_weight, copy.k_weight);
    widen(view.bf16.v_weight, copy.v_weight);
    widen(view.bf16.out_weight, copy.out_weight);
  } else if (!fused_qkv_weight_.empty()) {
    copy.q_weight.assign(view.q_weight.begin(), view.q_weight.end());
    copy.k_weight.assign(view.k_weight.begin(), view.k_weight.end());
    copy.v_weight.assign(view.v_weight.begin(), view.v_weight.end());
  }
  if (!fused_qkv_bias_.empty()) {
    copy.q_bias.assign(view.q_bias.begin(), view.q_bias.end());
    copy.k_bias.assign(view.k_bias.begin(), view.k_bias.end());
    copy.v_bias.assign(view.v_bias.begin(), view.v_bias.end());
  }
  return copy;
}

AttentionDims MhaLayer::Dims(const MhaInput& input) const {
  return {input.batch, config_.num_heads, config_.num_kv_heads, input.q_len, input.kv_len,
          config_.head_dim, config_.v_head_dim};
}

void DeliverOutput(const MhaInput& input, const float* rows, int64_t count,
                   AttentionResult* result) {
  if (!input.output_destination.empty()) {
    std::copy(rows, rows + count, input.output_destination.data());
  } else if (!input.output_destination_bf16.empty()) {
    FloatsToBFloat16(rows, count, input.output_destination_bf16.data());
  } else {
    result->output.assign(rows, rows + count);
  }
}

bool SplitsIntoSequences(const MhaInput& input) {
  return input.batch > 1 && input.options.SplitsBetweenSequences();
}

MhaInput OneSequence(const MhaInput& input, int64_t b, absl::Span<float> batch_destination) {
  const auto rows_of_b = [&](auto tensor) {
    const size_t each = tensor.size() / input.batch;
    return tensor.subspan(b * each, each);
  };
  AttentionDims dims;
  dims.batch = input.batch;
  dims.kv_len = input.kv_len;
  MhaInput one;
  one.q_len = input.q_len;
  one.kv_len = input.kv_len;
  one.query = rows_of_b(input.query);
  one.key = rows_of_b(input.key);
  one.value = rows_of_b(input.value);
  one.options = input.options.OneSequence(dims, b);
  one.half_dtype = input.half_dtype;
  one.query_half = rows_of_b(input.query_half);
  one.key_half = rows_of_b(input.key_half);
  one.value_half = rows_of_b(input.value_half);
  one.output_destination = rows_of_b(batch_destination);
  one.output_destination_bf16 = rows_of_b(input.output_destination_bf16);
  one.inputs_memory = input.inputs_memory;
  one.output_on_gpu = input.output_on_gpu;
  return one;
}

BatchParts SplitBatch(absl::Span<const MhaInput* const> inputs, int64_t output_dim,
                      std::vector<AttentionResult>& results) {
  BatchParts split;
  results.assign(inputs.size(), {});
  for (size_t n = 0; n < inputs.size(); ++n) {
    const MhaInput& in = *inputs[n];
    if (!SplitsIntoSequences(in)) {
      split.parts.push_back(&in);
      split.whole_input.push_back(static_cast<int64_t>(n));
      continue;
    }
    absl::Span<float> destination = in.output_destination;
    if (!in.has_output_destination()) {
      results[n].output.resize(in.batch * in.q_len * output_dim);
      destination = absl::MakeSpan(results[n].output);
    }
    for (int64_t b = 0; b < in.batch; ++b) {
      split.sequences.push_back(OneSequence(in, b, destination));
      split.parts.push_back(&split.sequences.back());
      split.whole_input.push_back(-1);
    }
  }
  return split;
}

MhaInput WithFloatInputs(const MhaInput& in, std::deque<std::vector<float>>* storage) {
  if (!in.is_half()) return in;
  MhaInput decoded = in;
  decoded.half_dtype = DType::kFloat32;
  decoded.query_half = decoded.key_half = decoded.value_half = {};
  auto decode = [&](absl::Span<const uint16_t> bits) -> absl::Span<const float> {
    if (bits.empty()) return {};
    std::vector<float>& values = storage->emplace_back(bits.size());
    for (size_t e = 0; e < bits.size(); ++e) {
      values[e] = in.half_dtype == DType::kBFloat16 ? BFloat16ToFloat(bits[e]) : HalfToFloat(bits[e]);
    }
    return values;
  };
  decoded.query = decode(in.query_half);
  decoded.key = decode(in.key_half);
  decoded.value = decode(in.value_half);
  return decoded;
}

absl::Status MhaLayer::ValidateInput(const MhaInput& in) const {
  const bool self_attention = in.self_attention() && in.value_elements() == 0;
  if (self_attention && in.kv_len != in.q_len) {
    return absl::InvalidArgumentError(absl::StrCat("self-attention needs kv_len (", in.kv_len,
                                                   ") == q_len (", in.q_len, ")"));
  }
  if (in.query_elements() != in.batch * in.q_len * config_.embed_dim) {
    return absl::InvalidArgumentError(absl::StrCat("query has ", in.query_elements(),
                                                   " values; expected [B, Nq, E] = [", in.batch,
                                                   ", ", in.q_len, ", ", config_.embed_dim, "]"));
  }
  if (!self_attention) {
    if (in.key_elements() != in.batch * in.kv_len * config_.kdim) {
      return absl::InvalidArgumentError(absl::StrCat("key has ", in.key_elements(),
                                                     " values; expected [B, Nk, kdim] = [",
                                                     in.batch, ", ", in.kv_len, ", ",
                                                     config_.kdim, "]"));
    }
    if (in.value_elements() != in.batch * in.kv_len * config_.vdim) {
      return absl::InvalidArgumentError(absl::StrCat("value has ", in.value_elements(),
                                                     " values; expected [B, Nk, vdim] = [",
                                                     in.batch, ", ", in.kv_len, ", ",
                                                     config_.vdim, "]"));
    }
  }
  const int64_t output_count = in.batch * in.q_len * config_.output_dim;
  if (!in.output_destination.empty() && !in.output_destination_bf16.empty()) {
    return absl::InvalidArgumentError(
        "output_destination and output_destination_bf16 are both set; give at most one");
  }
  for (const auto& [name, size] :
       {std::pair{"output_destination", in.output_destination.size()},
        std::pair{"output_destination_bf16", in.output_destination_bf16.size()}}) {
    if (size != 0 && static_cast<int64_t>(size) != output_count) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " has ", size, " values; expected [B, Nq, output_dim] = [", in.batch,
                       ", ", in.q_len, ", ", config_.output_dim, "]"));
    }
  }
  return in.options.Validate(Dims(in));
}

template <typename T>
TextbookResult<T> MhaLayer::ForwardTextbook(const MhaInput& input) const {
  return Textbook<T>(input, /*bf16_stages=*/false);
}

TextbookResult<float> MhaLayer::ForwardBf16Textbook(const MhaInput& input) const {
  return Textbook<float>(input, /*bf16_stages=*/true);
}

template <typename T>
TextbookResult<T> MhaLayer::Textbook(const MhaInput& input, bool bf16_stages) const {
  // Rounds a stage's values to bf16 where PyTorch's bf16 modules hold them in bf16.
  const auto stage = [bf16_stages](std::vector<T>& values) {
    if (!bf16_stages) return;
    for (T& value : values) value = BFloat16ToFloat(FloatToBFloat16(static_cast<float>(value)));
  };
  std::deque<std::vector<float>> decoded;
  const MhaInput in = WithFloatInputs(input, &decoded);
  const MhaConfig& c = config_;
  const MhaWeights w = weights();
  const bool self_attention = in.key.empty();
  const int64_t q_rows = in.batch * in.q_len;
  const int64_t kv_rows = in.batch * in.kv_len;
  std::vector<T> x = Converted<T>(in.query);
  stage(x);
  std::vector<T> xk = self_attention ? x : Converted<T>(in.key);
  std::vector<T> xv = self_attention ? x : Converted<T>(in.value);
  stage(xk);
  stage(xv);
  std::vector<T> q = LinearTextbook(x.data(), q_rows, c.embed_dim, w.q_weight, w.q_bias, c.QWidth());
  std::vector<T> k = LinearTextbook(xk.data(), kv_rows, c.kdim, w.k_weight, w.k_bias, c.KWidth());
  std::vector<T> v = LinearTextbook(xv.data(), kv_rows, c.vdim, w.v_weight, w.v_bias, c.VWidth());
  stage(q);
  stage(k);
  stage(v);
  if (c.rope_theta > 0.0) {
    const double base = c.RotaryBaseFor(std::max(in.q_len, in.kv_len));
    RotaryTextbook(q, q_rows, in.q_len, c.num_heads, c.head_dim, base, c.rope_scaling);
    RotaryTextbook(k, kv_rows, in.kv_len, c.num_kv_heads, c.head_dim, base, c.rope_scaling);
    stage(q);
    stage(k);
  }
  const AttentionOptions options = c.LayerOptions(in.options);
  const AttentionDims dims = Dims(in);
  std::vector<T> attended(q_rows * c.AttentionWidth());
  TextbookResult<T> result;
  if (in.options.need_weights != NeedWeights::kNone) {
    result.weights.resize(in.batch * c.num_heads * in.q_len * in.kv_len);
  }
  AttentionProblemOf<T> problem;
  problem.dims = dims;
  problem.query = q.data();
  problem.query_layout = HeadLayout::BatchRowHead(c.num_heads, in.q_len, c.head_dim);
  problem.key = k.data();
  problem.key_layout = HeadLayout::BatchRowHead(c.num_kv_heads, in.kv_len, c.head_dim);
  problem.value = v.data();
  problem.value_layout = HeadLayout::BatchRowHead(c.num_kv_heads, in.kv_len, c.v_head_dim);
  problem.output = attended.data();
  problem.output_layout = HeadLayout::BatchRowHead(c.num_heads, in.q_len, c.v_head_dim);
  problem.weights = result.weights.empty() ? nullptr : result.weights.data();
  problem.options = &options;
  AttentionTextbook(problem);
  stage(attended);
  stage(result.weights);
  result.output = c.output_projection
                      ? LinearTextbook(attended.data(), q_rows, c.AttentionWidth(),
                                       w.out_weight, w.out_bias, c.output_dim)
                      : std::move(attended);
  stage(result.output);
  if (in.options.need_weights == NeedWeights::kAveraged) {
    result.weights = AverageHeads(absl::Span<const T>(result.weights), dims);
  }
  return result;
}

template TextbookResult<float> MhaLayer::ForwardTextbook<float>(const MhaInput&) const;
template TextbookResult<double> MhaLayer::ForwardTextbook<double>(const MhaInput&) const;

AttentionResult MhaLayer::ForwardReference(const MhaInput& input) const {
  return Rounded(ForwardTextbook<double>(input));
}

absl::Status ValidateSdpaInput(const SdpaInput& in) {
  const AttentionDims& d = in.dims;
  for (auto [name, value] : {std::pair<const char*, int64_t>{"B", d.batch}, {"H", d.num_heads},
                             {"Hkv", d.num_kv_heads}, {"Nq", d.q_len}, {"Nk", d.kv_len},
                             {"dk", d.head_dim}, {"dv", d.v_head_dim}}) {
    if (value < 1) return Invalid(name, " = ", value, " must be >= 1");
  }
  RETURN_IF_ERROR(CheckHeadGroups(d.num_heads, d.num_kv_heads, "H", "Hkv"));
  if (in.compute_dtype != DType::kFloat32 && in.compute_dtype != DType::kBFloat16 &&
      in.compute_dtype != DType::kFloat16) {
    return Invalid("compute_dtype = ", DTypeName(in.compute_dtype),
                   " is not a compute precision; expected FLOAT32, BFLOAT16 or FLOAT16");
  }
  return in.options.Validate(d);
}

SdpaInput SdpaSequences(const SdpaInput& in, int64_t first, int64_t count) {
  const AttentionDims& d = in.dims;
  const auto rows = [&](absl::Span<const float> tensor) {
    const size_t each = tensor.size() / d.batch;
    return tensor.subspan(first * each, count * each);
  };
  SdpaInput some = in;
  some.dims.batch = count;
  some.query = rows(in.query);
  some.key = rows(in.key);
  some.value = rows(in.value);
  some.options = in.options.Sequences(d, first, count);
  return some;
}

template <typename T>
TextbookResult<T> SdpaTextbook(const SdpaInput& in) {
  const AttentionDims& d = in.dims;
  const std::vector<T> query = Converted<T>(in.query), key = Converted<T>(in.key),
                       value = Converted<T>(in.value);
  TextbookResult<T> result;
  result.output.resize(d.batch * d.num_heads * d.q_len * d.v_head_dim);
  if (in.options.need_weights != NeedWeights::kNone) {
    result.weights.resize(d.batch * d.num_heads * d.q_len * d.kv_len);
  }
  AttentionTextbook(SdpaProblem<T>(in, query.data(), key.data(), value.data(),
                                   result.output.data(),
                                   result.weights.empty() ? nullptr : result.weights.data()));
  if (in.options.need_weights == NeedWeights::kAveraged) {
    result.weights = AverageHeads(absl::Span<const T>(result.weights), d);
  }
  return result;
}

template TextbookResult<float> SdpaTextbook<float>(const SdpaInput&);
template TextbookResult<double> SdpaTextbook<double>(const SdpaInput&);

AttentionResult SdpaReference(const SdpaInput& in) { return Rounded(SdpaTextbook<double>(in)); }

TextbookResult<float> SdpaHalfTextbook(const SdpaInput& in) {
  const bool bf16 = in.compute_dtype == DType::kBFloat16;
  const auto rounded = [bf16](absl::Span<const float> values) {
    std::vector<float> half(values.begin(), values.end());
    for (float& value : half) {
      value = bf16 ? BFloat16ToFloat(FloatToBFloat16(value)) : HalfToFloat(FloatToHalf(value));
    }
    return half;
  };
  const std::vector<float> query = rounded(in.query), key = rounded(in.key),
                           value = rounded(in.value);
  SdpaInput half_input = in;
  half_input.query = query;
  half_input.key = key;
  half_input.value = value;
  TextbookResult<float> result = SdpaTextbook<float>(half_input);
  result.output = rounded(result.output);
  result.weights = rounded(result.weights);
  return result;
}

}  // namespace attention::core

// A multi-head-attention layer: configuration, host weights, the oracle, and the layer as
// its backend prepared it.
#ifndef ATTENTION_CORE_MHA_LAYER_H_
#define ATTENTION_CORE_MHA_LAYER_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention_kernels.h"
#include "core/attention_options.h"
#include "core/backend.h"
#include "core/mha_types.h"

namespace attention::core {

// What the textbook loops return, in their arithmetic type T (see AttentionTextbook).
template <typename T>
struct TextbookResult {
  std::vector<T> output;   // as AttentionResult::output
  std::vector<T> weights;  // as AttentionResult::weights
};

// Immutable once created; thread-safe.
class MhaLayer {
 public:
  // `config` must come from MhaConfig::Resolve; weight sizes are checked against it. The
  // weights are prepared once on `backend` (packed, or uploaded to its device), and its
  // errors are returned (a device out of memory is RESOURCE_EXHAUSTED).
  static absl::StatusOr<std::shared_ptr<const MhaLayer>> Create(
      const MhaConfig& config, MhaWeights weights, std::shared_ptr<const Backend> backend);

  const MhaConfig& config() const { return config_; }
  // The weights as separate float32 tensors (Q, K and V copied out when they are stored
  // fused; a BFLOAT16 layer's widened from bf16).
  MhaWeights weights() const;
  // Bytes of the host weights as held: float32, or bf16 matrices and float32 biases.
  int64_t WeightBytes() const;
  // Where the forward passes run: the backend's name ("cpu", "cuda:0").
  const std::string& device() const { return backend_->name(); }
  const Backend& backend() const { return *backend_; }
  // Bytes of weights the backend holds besides the host weights (a device copy, or the
  // CPU's packed copy).
  int64_t DeviceWeightBytes() const { return prepared_->DeviceWeightBytes(); }
  // Host memory of the weights: the host copy, plus the packed copy when the backend is the
  // CPU's (a GPU's copy is in device memory).
  int64_t HostBytes() const {
    return WeightBytes() + (device() == "cpu" ? DeviceWeightBytes() : 0);
  }

  // Whether ForwardBatch takes 16-bit inputs as sent (MhaInput::half_dtype): a backend
  // that converts them on its device, or a BFLOAT16 layer, whose products take bf16 as is.
  bool TakesHalfInputs() const {
    return backend_->ConvertsHalfInputs() || config_.compute_dtype == DType::kBFloat16;
  }

  // Checks shapes and options of `input`; errors name the request fields.
  absl::Status ValidateInput(const MhaInput& input) const;
  // The attention shape of `input` through this layer.
  AttentionDims Dims(const MhaInput& input) const;

  // Naive loops on the host weights with every product and sum in T (float and double
  // are compiled): projections, rotary positions, attention, output projection.
  template <typename T>
  TextbookResult<T> ForwardTextbook(const MhaInput& input) const;
  // The same-dtype reference of a BFLOAT16 layer: ForwardTextbook<float> with every stage
  // rounded to bf16 where PyTorch's bf16 modules hold it in bf16 (inputs, projections,
  // rotated Q and K, attention output and weights, the output).
  TextbookResult<float> ForwardBf16Textbook(const MhaInput& input) const;
  // The oracle: ForwardTextbook<double>, rounded once to float.
  AttentionResult ForwardReference(const MhaInput& input) const;

  // Production path for validated inputs, on the layer's backend: the projections of all
  // inputs run over every token of the batch at once, attention per sequence and head, one
  // GEMM for the output.
  absl::StatusOr<std::vector<AttentionResult>> ForwardBatch(
      absl::Span<const MhaInput* const> inputs) const {
    return prepared_->ForwardBatch(inputs);
  }

  // KV-cache sessions over this layer (hidden states in): OK, or FAILED_PRECONDITION
  // saying what stands in the way (keys and values projected from other inputs than the
  // queries', dynamic RoPE scaling, a backend without a decode entry).
  absl::Status DecodeSupport() const;
  // The decode entry of the prepared layer (see PreparedLayer::ProjectForDecode); callers
  // check DecodeSupport first.
  absl::Status ProjectForDecode(const float* x, absl::Span<const int64_t> positions, float* q,
                                float* k, float* v) const {
    return prepared_->ProjectForDecode(x, positions, q, k, v);
  }
  absl::Status ProjectDecodeOutput(const float* attended, int64_t rows, float* output) const {
    if (!config_.output_projection) {  // the attended rows are the output
      std::copy(attended, attended + rows * config_.AttentionWidth(), output);
      return absl::OkStatus();
    }
    return prepared_->ProjectDecodeOutput(attended, rows, output);
  }

 private:
  MhaLayer(const MhaConfig& config, MhaWeights weights, std::shared_ptr<const Backend> backend);
  template <typename T>
  TextbookResult<T> Textbook(const MhaInput& input, bool bf16_stages) const;
  // Stores Q, K and V as one matrix (kdim == vdim == E).
  void FuseQkv();
  // A BFLOAT16 layer: the weight matrices to bf16, the biases to bf16 values.
  void HoldBf16();
  MhaWeightsView WeightsView() const;

  MhaConfig config_;
  // Output projection always; Q, K and V only when they are not fused.
  MhaWeights weights_;
  // When kdim == vdim == E, Q, K and V live here as one [Q + K + V, E] matrix (rows in that
  // order), so self-attention projects every token with a single GEMM. Stored once, not
  // copied: the separate vectors in weights_ are then empty.
  std::vector<float> fused_qkv_weight_;
  std::vector<float> fused_qkv_bias_;
  // A BFLOAT16 layer's weight matrices (rounded to nearest even once, at creation), fused
  // alike; their float32 vectors above are then empty and the biases hold bf16 values.
  struct Bf16Matrices {
    std::vector<uint16_t> q_weight, k_weight, v_weight, out_weight, fused_qkv_weight;
  } bf16_;
  std::shared_ptr<const Backend> backend_;
  // Declared last: it may point into the weights above, so it is destroyed first.
  std::unique_ptr<PreparedLayer> prepared_;
};

absl::Status ValidateSdpaInput(const SdpaInput& input);
// Sequences [first, first + count) of `input`'s batch as a call of their own: their rows of
// Q, K and V (pointing into the input's) and their masks (AttentionOptions::Sequences). Their
// answer is rows [first, first + count) of the whole call's.
SdpaInput SdpaSequences(const SdpaInput& input, int64_t first, int64_t count);
// Scaled dot-product attention in T, as ForwardTextbook.
template <typename T>
TextbookResult<T> SdpaTextbook(const SdpaInput& input);
// The oracle for scaled dot-product attention: SdpaTextbook<double>, rounded once to float.
AttentionResult SdpaReference(const SdpaInput& input);
// What PyTorch's SDPA computes on bf16 or fp16 tensors (`input.compute_dtype`), for the
// 16-bit rule's reference: the inputs rounded to that type, SdpaTextbook<float>, the output
// and weights rounded to it.
TextbookResult<float> SdpaHalfTextbook(const SdpaInput& input);

}  // namespace attention::core

#endif  // ATTENTION_CORE_MHA_LAYER_H_

// The compute seam: where a layer's forward pass and scaled dot-product attention run. Like
// ONNX Runtime's execution providers and ggml's backend interface, a backend names itself,
// says what it cannot do, prepares a layer's weights once (packs them, or uploads them to
// a device) and runs prepared layers. The CPU backend lives in core/cpu/, CUDA in core/cuda/.
#ifndef ATTENTION_CORE_BACKEND_H_
#define ATTENTION_CORE_BACKEND_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/attention_options.h"
#include "core/mha_types.h"

namespace attention::core {

// A layer's weights as a backend receives them, in PyTorch layout (see MhaWeights), read
// only. When `fused_qkv_weight` is set, Q, K and V are one [Q + K + V, E] matrix (rows in
// that order, biases likewise) and the q/k/v spans are ranges of it.
// A BFLOAT16 layer (MhaConfig::compute_dtype) holds its weight matrices as bf16 bits in
// `bf16`, laid out alike, and the float32 matrix spans are empty; its biases stay float32
// spans (of bf16 values).
struct MhaWeightsView {
  absl::Span<const float> q_weight, k_weight, v_weight, out_weight;
  absl::Span<const float> q_bias, k_bias, v_bias, out_bias;
  absl::Span<const float> fused_qkv_weight, fused_qkv_bias;
  struct Bf16Matrices {
    absl::Span<const uint16_t> q_weight, k_weight, v_weight, out_weight, fused_qkv_weight;
  } bf16;
};

// A layer prepared by a backend: its weights packed or resident where the backend computes.
// Thread-safe: several batches may run at once.
class PreparedLayer {
 public:
  virtual ~PreparedLayer() = default;

  // One forward pass over inputs that MhaLayer::ValidateInput accepted, packed into one
  // batch without padding; one result per input. Errors are the backend's (a device out of
  // memory is RESOURCE_EXHAUSTED) and apply to the whole batch. An input's output goes to
  // its output_destination when it has one (DeliverOutput).
  virtual absl::StatusOr<std::vector<AttentionResult>> ForwardBatch(
      absl::Span<const MhaInput* const> inputs) const = 0;

  // Bytes of weights this copy holds besides the host weights: a device's copy, or the
  // CPU's copy packed for its small-batch microkernel.
  virtual int64_t DeviceWeightBytes() const = 0;

  // The decode entry of KV-cache sessions (server/sessions), for backends that opt in; the
  // attention between the two runs on the session's paged cache. ProjectForDecode projects
  // `positions.size()` tokens of hidden states `x` [rows, E] into q [rows, H * dk],
  // k [rows, Hkv * dk] and v [rows, Hkv * dv], rotating q and k when the layer has RoPE,
  // row r at absolute position positions[r]. ProjectDecodeOutput maps attended rows
  // [rows, H * dv] to the layer's output [rows, output_dim]; MhaLayer calls it only for
  // layers with an output projection. Host pointers.
  virtual bool HasDecodeEntry() const { return false; }
  virtual absl::Status ProjectForDecode(const float* /*x*/, absl::Span<const int64_t> /*positions*/,
                                        float* /*q*/, float* /*k*/, float* /*v*/) const {
    return absl::UnimplementedError("this backend has no decode entry");
  }
  virtual absl::Status ProjectDecodeOutput(const float* /*attended*/, int64_t /*rows*/,
                                           float* /*output*/) const {
    return absl::UnimplementedError("this backend has no decode entry");
  }
};

// Memory of an accelerator, for the metrics.
struct DeviceMemory {
  int64_t used_bytes = 0;   // by every process
  int64_t total_bytes = 0;
};

// Thread-safe. Lives as long as any layer prepared by it (layers hold a shared_ptr).
class Backend {
 public:
  virtual ~Backend() = default;

  // The device as LayerInfo.device and the metrics name it: "cpu", "cuda:0".
  virtual const std::string& name() const = 0;

  // OK, or UNIMPLEMENTED naming the config or options field this backend cannot compute,
  // so that the caller can fall back to the CPU or refuse the request.
  virtual absl::Status Supports(const MhaConfig& config, const AttentionOptions& options) const = 0;

  // Packs or uploads the weights of a resolved `config` once. `weights` must outlive the
  // prepared layer (MhaLayer owns both).
  virtual absl::StatusOr<std::unique_ptr<PreparedLayer>> Prepare(
      const MhaConfig& config, const MhaWeightsView& weights) const = 0;

  // Scaled dot-product attention of an input that ValidateSdpaInput accepted and that
  // Supports(SdpaConfig(input.dims), input.options) allows.
  virtual absl::StatusOr<AttentionResult> ScaledDotProductAttention(
      const SdpaInput& input) const = 0;

  // Whether prepared layers take 16-bit inputs as sent (MhaInput::half_dtype) and convert
  // them on the device; otherwise the caller decodes them to float32 first.
  virtual bool ConvertsHalfInputs() const { return false; }

  // The GPU whose memory this backend's prepared layers read inputs from and write answers
  // to in place (InputMemory::kGpu, MhaInput::output_on_gpu); nullopt: host memory only.
  virtual std::optional<int> InPlaceGpu() const { return std::nullopt; }

  // Page-locked host memory of at least `bytes` for a call's inputs (InputMemory::
  // kPinnedHost): read straight into it, each is one DMA from the device. Null when the
  // backend has none (the CPU) or cannot pin more now.
  virtual std::shared_ptr<char> PinnedHostBuffer(size_t /*bytes*/) const { return nullptr; }

  // The device's memory; nullopt for the host.
  virtual std::optional<DeviceMemory> Memory() const { return std::nullopt; }

  // Attention calls since start by the path that ran them, where a backend has several (the
  // CUDA backend: "cudnn", cuDNN's fused SDPA, and "kernels", its own); empty otherwise.
  virtual std::map<std::string, int64_t> AttentionCallsByPath() const { return {}; }
};

// The head sizes of a scaled dot-product attention call as a layer config, for Supports.
inline MhaConfig SdpaConfig(const AttentionDims& dims) {
  MhaConfig config;
  config.embed_dim = dims.num_heads * dims.head_dim;
  config.num_heads = dims.num_heads;
  config.num_kv_heads = dims.num_kv_heads;
  config.head_dim = dims.head_dim;
  config.v_head_dim = dims.v_head_dim;
  return config;
}

}  // namespace attention::core

#endif  // ATTENTION_CORE_BACKEND_H_

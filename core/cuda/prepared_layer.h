// A layer prepared on a GPU: its weights uploaded once, its forward pass over a packed
// batch run on the calling thread's stream as core/forward_plan.h plans it; a large batch
// in chunks on two streams, copies overlapping compute (copy_overlap_plan.h).
#ifndef ATTENTION_CORE_CUDA_PREPARED_LAYER_H_
#define ATTENTION_CORE_CUDA_PREPARED_LAYER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/backend.h"
#include "core/cuda/staging.h"
#include "core/cuda/streams.h"
#include "core/forward_plan.h"

namespace attention::core::cuda {

class CudaBackend;

// Device copies of a layer's weights: one allocation, views into it (null when absent).
struct DeviceWeights {
  const float *q_weight = nullptr, *k_weight = nullptr, *v_weight = nullptr, *out_weight = nullptr;
  const float *q_bias = nullptr, *k_bias = nullptr, *v_bias = nullptr, *out_bias = nullptr;
  const float *fused_qkv_weight = nullptr, *fused_qkv_bias = nullptr;
  // A BFLOAT16 layer's matrices, bf16 bits (the float ones above are then null; its biases
  // are the float ones).
  const uint16_t *q_weight_bf16 = nullptr, *k_weight_bf16 = nullptr, *v_weight_bf16 = nullptr,
                 *out_weight_bf16 = nullptr, *fused_qkv_weight_bf16 = nullptr;
};

class CudaPreparedLayer final : public PreparedLayer {
 public:
  CudaPreparedLayer(const CudaBackend& backend, const MhaConfig& config)
      : backend_(backend), config_(config) {}
  ~CudaPreparedLayer() override;

  // Copies the weights to the backend's GPU (the current device).
  absl::Status Upload(const MhaWeightsView& weights);
  absl::StatusOr<std::vector<AttentionResult>> ForwardBatch(
      absl::Span<const MhaInput* const> inputs) const override;
  int64_t DeviceWeightBytes() const override { return bytes_; }

  // The decode entry of sessions over this layer: projections and RoPE on the GPU, host
  // tensors in and out (the session's KV cache lives where --kv_cache_device puts it).
  bool HasDecodeEntry() const override { return true; }
  absl::Status ProjectForDecode(const float* x, absl::Span<const int64_t> positions, float* q,
                                float* k, float* v) const override;
  absl::Status ProjectDecodeOutput(const float* attended, int64_t rows,
                                   float* output) const override;

 private:
  // A piece of a forward pass queued on a stream (Enqueue): what Deliver needs once it ends.
  struct InFlight {
    std::vector<const MhaInput*> inputs;
    ForwardPlan plan;
    std::vector<StagedWeights> weights;
    bool bf16_answers = false;  // every answer comes back as bf16
    int64_t answers_at = 0;     // where the answers sit in staging
    StreamContext* context = nullptr;
    char* staging = nullptr;
  };
  // Packs `inputs` into `lane`'s pinned staging and queues on its stream their copy in, the
  // whole pass, and the copy of their answers back, without waiting for any of it.
  absl::StatusOr<InFlight> Enqueue(absl::Span<const MhaInput* const> inputs,
                                   StreamContext& lane) const;
  // Waits for `flight`'s stream, then hands each input its answer (destination or result).
  absl::StatusOr<std::vector<AttentionResult>> Deliver(const InFlight& flight) const;

  // A BFLOAT16 layer's GEMM input x [count] rounded into `rounded` on the device; nothing
  // for a FLOAT32 layer.
  absl::Status RoundForLayer(const StreamContext& context, const float* x, int64_t count,
                             uint16_t* rounded) const;
  // y = x W^T + bias in the layer's precision: float32 x, or for a BFLOAT16 layer x_bf16
  // (x already rounded to bf16 on the device).
  absl::Status LinearInPrecision(StreamContext& context, const float* x, const uint16_t* x_bf16,
                                 int64_t rows, int64_t in, const float* weight,
                                 const uint16_t* weight_bf16, const float* bias, int64_t out,
                                 float* y, int64_t ldy) const;

  const CudaBackend& backend_;
  const MhaConfig config_;
  void* memory_ = nullptr;
  int64_t bytes_ = 0;
  DeviceWeights weights_;
};

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_PREPARED_LAYER_H_

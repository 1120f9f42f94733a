// The CUDA backend of one GPU (see cuda_backend.h): what it supports, its prepared layers
// (prepared_layer.h), scaled dot-product attention (sdpa.cc) and each worker thread's
// stream context.
#ifndef ATTENTION_CORE_CUDA_DEVICE_BACKEND_H_
#define ATTENTION_CORE_CUDA_DEVICE_BACKEND_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/backend.h"
#include "core/cpu/thread_pool.h"
#include "core/cuda/kernels.h"
#include "core/cuda/pinned_pool.h"
#include "core/cuda/streams.h"

namespace attention::core::cuda {

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const cudaDeviceProp& properties);

  const std::string& name() const override { return name_; }
  int device() const { return device_; }

  absl::Status Supports(const MhaConfig& config, const AttentionOptions& options) const override;
  absl::StatusOr<std::unique_ptr<PreparedLayer>> Prepare(
      const MhaConfig& config, const MhaWeightsView& weights) const override;
  absl::StatusOr<AttentionResult> ScaledDotProductAttention(const SdpaInput& input) const override;

  // 16-bit inputs travel to the GPU as sent (half the bytes) and are converted there.
  bool ConvertsHalfInputs() const override { return true; }
  std::optional<int> InPlaceGpu() const override { return device_; }
  std::shared_ptr<char> PinnedHostBuffer(size_t bytes) const override {
    return pinned_->Get(bytes);
  }

  std::optional<DeviceMemory> Memory() const override;
  std::map<std::string, int64_t> AttentionCallsByPath() const override;

  // The calling thread's stream context on this device, created on first use; lane 1 is
  // the thread's second stream (a forward pass's chunks alternate between the two).
  absl::StatusOr<StreamContext*> Context(int lane = 0) const {
    return contexts_.ForThisThread(lane);
  }

  // The threads that copy a call's arrays into pinned staging and its answers out of it.
  ThreadPool& host_copies() const { return host_copies_; }

  // Runs one problem (shape checked by Supports) on `context`'s stream: on cuDNN's fused
  // SDPA where it takes the call (cudnn_sdpa_plan.h), else on this project's kernels.
  absl::Status Attend(const DeviceAttentionProblem& problem, StreamContext& context) const;

 private:
  // UNIMPLEMENTED naming this device and what the attention kernel cannot do, or OK.
  absl::Status KernelSupports(const AttentionShape& shape) const;

  const int device_;
  const std::string name_;
  const int64_t max_shared_bytes_;
  const int compute_major_;
  StreamContexts contexts_;
  mutable ThreadPool host_copies_;
  mutable std::atomic<int64_t> cudnn_calls_{0}, kernel_calls_{0};
  // Page-locked buffers: at most this many bytes of them kept for reuse, and in all.
  static constexpr size_t kMaxKeptPinnedBytes = size_t{256} << 20;
  static constexpr size_t kMaxPinnedBytes = size_t{1} << 30;
  const std::shared_ptr<PinnedBufferPool> pinned_;
};

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_DEVICE_BACKEND_H_

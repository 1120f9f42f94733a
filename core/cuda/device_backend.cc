#include "core/cuda/device_backend.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/cudnn_sdpa.h"
#include "core/cuda/launch_plan.h"
#include "core/cuda/prepared_layer.h"
#include "core/status_macros.h"

namespace attention::core::cuda {
namespace {

// Half the host's cores, up to 8: memory bandwidth is what a copy needs, and 8 threads
// reach it on the servers GPUs sit in.
int HostCopyThreads() {
  return std::clamp(static_cast<int>(std::thread::hardware_concurrency() / 2), 1, 8);
}

}  // namespace

CudaBackend::CudaBackend(int device, const cudaDeviceProp& properties)
    : device_(device),
      name_(absl::StrCat("cuda:", device)),
      max_shared_bytes_(static_cast<int64_t>(properties.sharedMemPerBlockOptin)),
      compute_major_(properties.major),
      contexts_(device),
      host_copies_(HostCopyThreads()),
      pinned_(PinnedBufferPool::Create(
          {[](size_t bytes) -> void* {
             void* buffer = nullptr;
             // Portable: pinned for every CUDA context, whichever thread copies from it.
             if (cudaHostAlloc(&buffer, bytes, cudaHostAllocPortable) != cudaSuccess) {
               cudaGetLastError();  // not sticky: clear it for the next call on this thread
               return nullptr;
             }
             return buffer;
           },
           [](void* buffer) { cudaFreeHost(buffer); }},
          kMaxKeptPinnedBytes, kMaxPinnedBytes)) {}

absl::Status CudaBackend::KernelSupports(const AttentionShape& shape) const {
  const std::string reason = FlashUnsupportedReason(shape, max_shared_bytes_);
  if (!reason.empty()) return absl::UnimplementedError(absl::StrCat(name_, ": ", reason));
  return absl::OkStatus();
}

absl::Status CudaBackend::Supports(const MhaConfig& config, const AttentionOptions& options) const {
  AttentionShape shape;
  shape.head_dim = config.head_dim;
  shape.v_head_dim = config.v_head_dim;
  return KernelSupports(shape);  // every AttentionOptions field is computed on the device
}

absl::StatusOr<std::unique_ptr<PreparedLayer>> CudaBackend::Prepare(
    const MhaConfig& config, const MhaWeightsView& weights) const {
  RETURN_IF_ERROR(Supports(config, AttentionOptions{}));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  auto prepared = std::make_unique<CudaPreparedLayer>(*this, config);
  RETURN_IF_ERROR(prepared->Upload(weights));
  return prepared;
}

std::map<std::string, int64_t> CudaBackend::AttentionCallsByPath() const {
  return {{"cudnn", cudnn_calls_.load()}, {"kernels", kernel_calls_.load()}};
}

std::optional<DeviceMemory> CudaBackend::Memory() const {
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaSetDevice(device_) != cudaSuccess ||
      cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    return std::nullopt;
  }
  return DeviceMemory{static_cast<int64_t>(total_bytes - free_bytes),
                      static_cast<int64_t>(total_bytes)};
}

absl::Status CudaBackend::Attend(const DeviceAttentionProblem& problem,
                                 StreamContext& context) const {
  RETURN_IF_ERROR(KernelSupports(problem.shape));
  ASSIGN_OR_RETURN(const bool on_cudnn, AttendOnCudnn(problem, device_, compute_major_, context));
  (on_cudnn ? cudnn_calls_ : kernel_calls_).fetch_add(1, std::memory_order_relaxed);
  if (on_cudnn) return absl::OkStatus();
  const cudaStream_t stream = context.stream;
  if (problem.bf16_products &&
      MmaKernelTakes(problem.shape, problem.weights != nullptr, max_shared_bytes_)) {
    return CudaStatus(LaunchMmaAttention(problem, PlanMmaAttention(problem.shape), stream),
                      "mma attention kernel launch");
  }
  const FlashLaunchPlan plan = PlanFlashAttention(problem.shape, problem.weights != nullptr);
  return CudaStatus(LaunchAttention(problem, plan, stream), "attention kernel launch");
}

}  // namespace attention::core::cuda

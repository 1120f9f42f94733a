// cuDNN's fused SDPA inside the CUDA backend (issue 40): the library of
// cudnn_sdpa_library.h loaded once per process, and a call or a session step over the KV
// pool run on it when cudnn_sdpa_plan.h says cuDNN takes it.
#ifndef ATTENTION_CORE_CUDA_CUDNN_SDPA_H_
#define ATTENTION_CORE_CUDA_CUDNN_SDPA_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/cuda/cudnn_sdpa_library.h"
#include "core/cuda/cudnn_sdpa_plan.h"
#include "core/cuda/device_buffer.h"
#include "core/cuda/kernels.h"
#include "core/cuda/streams.h"
#include "core/kv_cache/paged_batch.h"

namespace attention::core::cuda {

// The library beside this plugin is loaded on the first call to either; without it
// (ATTENTION_CUDNN_SDPA=off, or no cuDNN 9 or NVRTC this process can load) attention stays on
// this project's kernels.

// The start-up line of a GPU of compute capability `sm_major`: the cuDNN version and the
// calls it takes, or why attention stays on this project's kernels.
std::string CudnnSdpaSummary(int sm_major);

// Enqueues `problem` on cuDNN on `context`'s stream when it is eligible and cuDNN builds its
// graph: true when it did, false when the project's kernels should run it. Errors are
// cuDNN's or CUDA's failures once the call was on its way.
absl::StatusOr<bool> AttendOnCudnn(const DeviceAttentionProblem& problem, int device, int sm_major,
                                   StreamContext& context);

// What a GPU's KV storage keeps to run session steps on cuDNN (cuda_kv_storage.h): a
// runner made on its first eligible step, and staging for the steps' rows and page tables.
struct CudnnPagedContext {
  std::unique_ptr<CudnnSdpaRunner> runner;
  bool unavailable = false;  // the runner could not be made (logged then)
  PinnedBuffer host;
  DeviceBuffer device;
};

// Runs `batch` (block tables, queries and outputs in host memory) over the pool whose block 0
// is at `pool` on GPU `device` on cuDNN's paged SDPA, on `stream`, when
// CudnnPagedIneligibleReason takes it, and waits for it: true when it did, false when the
// project's kernel should run it. `shared_prefixes`: the batch holds forks of one prefix.
absl::StatusOr<bool> AttendPagedOnCudnn(const PagedDecodeBatch& batch, bool shared_prefixes,
                                        const char* pool, int device, int sm_major,
                                        CudnnPagedContext& context, cudaStream_t stream);

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_CUDNN_SDPA_H_

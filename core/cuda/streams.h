// What each batch worker thread computes with on one GPU: its own streams (so workers'
// copies and kernels overlap), cuBLAS handle, device scratch and pinned staging.
#ifndef ATTENTION_CORE_CUDA_STREAMS_H_
#define ATTENTION_CORE_CUDA_STREAMS_H_

#include <map>
#include <memory>
#include <thread>
#include <utility>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "core/cuda/cudnn_sdpa_library.h"
#include "core/cuda/device_buffer.h"
#include "core/mutex.h"

namespace attention::core::cuda {

struct StreamContext {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  // cuBLASLt (projections with their bias in the GEMM's epilogue; linear.h) and its workspace.
  cublasLtHandle_t cublas_lt = nullptr;
  DeviceBuffer lt_workspace;
  DeviceBuffer device;
  PinnedBuffer staging;
  // cuDNN's handle and graphs (cudnn_sdpa.h), made on this thread's first eligible call;
  // cudnn_unavailable once that failed (logged then).
  std::unique_ptr<CudnnSdpaRunner> cudnn;
  bool cudnn_unavailable = false;
};

// The stream contexts of GPU `device`, one per calling thread, created on first use and
// kept until this is destroyed. Thread-safe.
class StreamContexts {
 public:
  explicit StreamContexts(int device) : device_(device) {}
  StreamContexts(const StreamContexts&) = delete;
  StreamContexts& operator=(const StreamContexts&) = delete;
  ~StreamContexts();

  // The calling thread's context on `lane` (each lane its own stream); also makes `device`
  // the thread's current GPU.
  absl::StatusOr<StreamContext*> ForThisThread(int lane = 0) const;

 private:
  const int device_;
  mutable Mutex mu_;  // see core/mutex.h
  mutable std::map<std::pair<std::thread::id, int>, std::unique_ptr<StreamContext>> contexts_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_STREAMS_H_

#include "core/cuda/streams.h"

#include <utility>

#include "core/cuda/cuda_status.h"
#include "core/status_macros.h"

namespace attention::core::cuda {

StreamContexts::~StreamContexts() {
  cudaSetDevice(device_);
  for (auto& [thread, context] : contexts_) {
    context->cudnn.reset();  // its handle is bound to the stream
    cublasLtDestroy(context->cublas_lt);
    cublasDestroy(context->cublas);
    cudaStreamDestroy(context->stream);
  }
}

absl::StatusOr<StreamContext*> StreamContexts::ForThisThread(int lane) const {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  MutexLock lock(mu_);
  std::unique_ptr<StreamContext>& context = contexts_[{std::this_thread::get_id(), lane}];
  if (context == nullptr) {
    auto created = std::make_unique<StreamContext>();
    RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&created->stream, cudaStreamNonBlocking),
                               "cudaStreamCreate"));
    const cublasStatus_t status = cublasCreate(&created->cublas);
    if (status != CUBLAS_STATUS_SUCCESS) {
      cudaStreamDestroy(created->stream);
      return CublasStatus(status, "cublasCreate");
    }
    cublasSetStream(created->cublas, created->stream);
    if (const cublasStatus_t lt = cublasLtCreate(&created->cublas_lt);
        lt != CUBLAS_STATUS_SUCCESS) {
      created->cublas_lt = nullptr;  // projections then run on cuBLAS alone
    }
    // Full fp32 SGEMM: the default math mode never rounds to TF32 (only
    // CUBLAS_TF32_TENSOR_OP_MATH or NVIDIA_TF32_OVERRIDE=1 would), as PyTorch with
    // allow_tf32 = False; results match the CPU backend within float rounding.
    cublasSetMathMode(created->cublas, CUBLAS_DEFAULT_MATH);
    context = std::move(created);
  }
  return context.get();
}

}  // namespace attention::core::cuda

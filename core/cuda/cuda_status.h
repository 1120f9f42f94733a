// CUDA and cuBLAS errors as absl::Status: a device out of memory is RESOURCE_EXHAUSTED (the
// server keeps serving); anything else is INTERNAL naming the call.
#ifndef ATTENTION_CORE_CUDA_CUDA_STATUS_H_
#define ATTENTION_CORE_CUDA_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attention::core::cuda {

absl::Status CudaStatus(cudaError_t error, absl::string_view what);
absl::Status CublasStatus(cublasStatus_t status, absl::string_view what);

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_CUDA_STATUS_H_

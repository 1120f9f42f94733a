// The plugin's entry point: the device count, the backend of each GPU, KV-cache pools and
// other processes' exported memory.
#include "core/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <iostream>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_kv_storage.h"
#include "core/cuda/cudnn_sdpa.h"
#include "core/cuda/device_backend.h"
#include "core/cuda/ipc_memory.h"

namespace attention::core {
namespace {

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error == cudaErrorNoDevice) return 0;
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear it, so later calls do not report it again
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA driver (", cudaGetErrorString(error), ")"));
  }
  return count;
}

absl::StatusOr<std::shared_ptr<const Backend>> OpenCudaBackend(int device) {
  cudaDeviceProp properties;
  const cudaError_t error = cudaGetDeviceProperties(&properties, device);
  if (error != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open cuda:", device, ": ", cudaGetErrorString(error)));
  }
  std::cerr << "attention-service: cuda:" << device << ": "
            << cuda::CudnnSdpaSummary(properties.major) << std::endl;
  return std::shared_ptr<const Backend>(std::make_shared<cuda::CudaBackend>(device, properties));
}

}  // namespace
}  // namespace attention::core

extern "C" __attribute__((visibility("default"))) const attention::core::CudaPlugin*
AttentionCudaPlugin() {
  static const attention::core::CudaPlugin plugin = {
      &attention::core::CudaDeviceCount, &attention::core::OpenCudaBackend,
      &attention::core::cuda::CudaKvStorage::Create, &attention::core::cuda::OpenIpcMemory};
  return &plugin;
}

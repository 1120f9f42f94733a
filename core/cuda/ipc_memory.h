// Triton's CUDA shared memory regions on the GPU side: another process's cudaMalloc'd buffer,
// exported with cudaIpcGetMemHandle, opened here with cudaIpcOpenMemHandle and copied to and
// from host memory with cudaMemcpy. The region's size is checked against the exported
// allocation's (the driver's cuMemGetAddressRange), so a byte_size too large is refused at
// registration instead of reading another allocation later.
#ifndef ATTENTION_CORE_CUDA_IPC_MEMORY_H_
#define ATTENTION_CORE_CUDA_IPC_MEMORY_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/cuda/cuda_backend.h"

namespace attention::core::cuda {

// CudaPlugin::open_ipc_memory.
absl::StatusOr<std::unique_ptr<SharedDeviceMemory>> OpenIpcMemory(int device,
                                                                  absl::string_view handle,
                                                                  uint64_t byte_size);

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_IPC_MEMORY_H_

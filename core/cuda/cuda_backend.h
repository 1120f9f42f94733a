// The CUDA backend: weights resident on the GPU from Prepare on, cuBLAS fp32 GEMMs (TF32
// off, so results match the CPU within float rounding) over every token of a packed batch,
// and the fused flash-style attention kernel of kernels.cu. Each calling thread (batch
// worker) gets its own stream, cuBLAS handle, pinned staging buffers and device scratch,
// so one worker's copies overlap another's compute.
//
// It is built as a plugin (libattention_cuda_backend.so) that core/devices.cc loads with
// dlopen on first use, never linked into the binaries: cuBLAS carries about 100 KB of
// static thread-local storage, which would be carved from every thread's stack and makes
// threads with small stacks (the metrics HTTP server's) fail to start; and a machine
// without a GPU needs no CUDA libraries at all.
#ifndef ATTENTION_CORE_CUDA_CUDA_BACKEND_H_
#define ATTENTION_CORE_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/backend.h"
#include "core/dtype.h"
#include "core/kv_cache/kv_storage.h"

namespace attention::core {

// GPU memory another process exported with cudaIpcGetMemHandle, opened in this one (Triton's
// CUDA shared memory regions): copies between it and host memory, and its address for a
// backend on its GPU that reads and writes it in place. Closed when destroyed.
class SharedDeviceMemory {
 public:
  virtual ~SharedDeviceMemory() = default;
  // Bytes [offset, offset + bytes) of the region to `host`, or from it.
  virtual absl::Status CopyToHost(uint64_t offset, uint64_t bytes, void* host) const = 0;
  virtual absl::Status CopyFromHost(uint64_t offset, const void* host, uint64_t bytes) const = 0;
  // The GPU it is on, and the address of its first byte there.
  virtual int device() const = 0;
  virtual char* data() const = 0;
  // The index of the first NaN or infinity among `count` values of `dtype` (kFloat32,
  // kFloat16 or kBFloat16) from byte `offset` (a multiple of the dtype's size), or -1.
  virtual absl::StatusOr<int64_t> FindNonFinite(uint64_t offset, int64_t count,
                                                DType dtype) const = 0;
};

// The bytes of a cudaIpcMemHandle_t (CUDA_IPC_HANDLE_SIZE).
inline constexpr size_t kCudaIpcHandleBytes = 64;

// What the plugin offers; returned by its one exported C symbol, kCudaPluginEntry.
struct CudaPlugin {
  // GPUs the CUDA runtime sees. FAILED_PRECONDITION naming why when there is no usable
  // driver (a machine without a GPU); 0 when the driver sees none.
  absl::StatusOr<int> (*device_count)();
  // The backend of GPU `device` ("cuda:<device>"); FAILED_PRECONDITION when it cannot be
  // opened.
  absl::StatusOr<std::shared_ptr<const Backend>> (*open_backend)(int device);
  // A KV-cache pool on GPU `device` (see core/cuda/cuda_kv_storage.h); RESOURCE_EXHAUSTED
  // when it does not fit.
  absl::StatusOr<std::unique_ptr<kv_cache::KvStorage>> (*create_kv_storage)(int device,
                                                                            int64_t num_blocks,
                                                                            int64_t block_bytes);
  // Opens `handle` (kCudaIpcHandleBytes) on GPU `device` as a region of `byte_size` bytes:
  // INVALID_ARGUMENT naming raw_handle when CUDA refuses it, or byte_size when the exported
  // allocation is smaller.
  absl::StatusOr<std::unique_ptr<SharedDeviceMemory>> (*open_ipc_memory)(int device,
                                                                         absl::string_view handle,
                                                                         uint64_t byte_size);
};
inline constexpr char kCudaPluginEntry[] = "AttentionCudaPlugin";
using CudaPluginEntry = const CudaPlugin* (*)();

}  // namespace attention::core

#endif  // ATTENTION_CORE_CUDA_CUDA_BACKEND_H_

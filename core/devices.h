// The compute devices of this process and their backends: the CPU always, and each GPU
// when the build has CUDA and a device is visible. One backend per device, opened on first
// use and shared by every layer placed there.
#ifndef ATTENTION_CORE_DEVICES_H_
#define ATTENTION_CORE_DEVICES_H_

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/backend.h"
#include "core/cpu/cpu_backend.h"
#include "core/cuda/cuda_backend.h"
#include "core/kv_cache/kv_storage.h"
#include "core/mutex.h"

namespace attention::core {

// True when this binary was built with the CUDA backend.
bool CudaBuilt();

// Thread-safe.
class Devices {
 public:
  // `cpu_threads` >= 1: the CPU backend's compute threads; `forced`: its kernels chosen by
  // flags instead of measured.
  explicit Devices(int cpu_threads, const CpuKernelChoice& forced = {})
      : cpu_(std::make_shared<CpuBackend>(cpu_threads, forced)) {}

  const std::shared_ptr<const CpuBackend>& cpu() const { return cpu_; }

  // GPUs this process can use: 0 without CUDA in the build, without a driver or without a
  // device; `why_none` (may be null) then says which.
  int GpuCount(std::string* why_none = nullptr) const;

  // The backend of `device`: "cpu", "cuda" (= "cuda:0"), "cuda:N", or "auto" (the first GPU
  // when there is one, else the CPU). INVALID_ARGUMENT for another name; FAILED_PRECONDITION
  // naming the device and why when it is a GPU this process cannot use.
  absl::StatusOr<std::shared_ptr<const Backend>> Get(absl::string_view device);

  // A KV-cache pool of `num_blocks` blocks of `block_bytes` where `device` keeps memory
  // (host memory for "cpu", attended on the CPU backend's pool; the GPU's for "cuda:N"),
  // for sessions. Get's errors for the name; RESOURCE_EXHAUSTED when it does not fit.
  absl::StatusOr<std::unique_ptr<kv_cache::KvStorage>> CreateKvStorage(absl::string_view device,
                                                                       int64_t num_blocks,
                                                                       int64_t block_bytes);

  // Memory another process on this host exported from GPU `device` with cudaIpcGetMemHandle
  // (`handle`: kCudaIpcHandleBytes), as a region of `byte_size` bytes. FAILED_PRECONDITION
  // naming device_id when this process cannot use that GPU; the plugin's refusals otherwise.
  absl::StatusOr<std::unique_ptr<SharedDeviceMemory>> OpenIpcMemory(int64_t device,
                                                                    absl::string_view handle,
                                                                    uint64_t byte_size);

 private:
  const std::shared_ptr<const CpuBackend> cpu_;
  Mutex mu_;
  std::map<int, std::shared_ptr<const Backend>> gpus_ ABSL_GUARDED_BY(mu_);  // by index
};

}  // namespace attention::core

#endif  // ATTENTION_CORE_DEVICES_H_

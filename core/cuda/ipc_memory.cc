#include "core/cuda/ipc_memory.h"

#include <cuda.h>  // the driver's types, for its entry point (the plugin links no libcuda)
#include <cuda_runtime.h>

#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/kernels.h"
#include "core/status_macros.h"

namespace attention::core::cuda {
namespace {

class IpcDeviceMemory final : public SharedDeviceMemory {
 public:
  IpcDeviceMemory(int device, char* base, uint64_t byte_size)
      : device_(device), base_(base), byte_size_(byte_size) {}
  ~IpcDeviceMemory() override {
    cudaSetDevice(device_);
    cudaIpcCloseMemHandle(base_);
  }

  absl::Status CopyToHost(uint64_t offset, uint64_t bytes, void* host) const override {
    RETURN_IF_ERROR(CheckRange(offset, bytes));
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    return CudaStatus(cudaMemcpy(host, base_ + offset, bytes, cudaMemcpyDeviceToHost),
                      absl::StrCat("cudaMemcpy of ", bytes, " bytes from cuda:", device_));
  }
  absl::Status CopyFromHost(uint64_t offset, const void* host, uint64_t bytes) const override {
    RETURN_IF_ERROR(CheckRange(offset, bytes));
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    return CudaStatus(cudaMemcpy(base_ + offset, host, bytes, cudaMemcpyHostToDevice),
                      absl::StrCat("cudaMemcpy of ", bytes, " bytes to cuda:", device_));
  }
  int device() const override { return device_; }
  char* data() const override { return base_; }

  absl::StatusOr<int64_t> FindNonFinite(uint64_t offset, int64_t count,
                                        DType dtype) const override {
    const int element_bytes = static_cast<int>(ElementSize(dtype));
    RETURN_IF_ERROR(CheckRange(offset, static_cast<uint64_t>(count) * element_bytes));
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    // On this thread's own stream, so that no batch worker's stream waits for it.
    const cudaStream_t stream = cudaStreamPerThread;
    unsigned long long* first = nullptr;
    RETURN_IF_ERROR(
        CudaStatus(cudaMallocAsync(reinterpret_cast<void**>(&first), sizeof(*first), stream),
                   "cudaMallocAsync(non-finite index)"));
    unsigned long long found = ~0ull;  // none: every bit set, as the memset writes it
    absl::Status status = CudaStatus(cudaMemsetAsync(first, 0xff, sizeof(*first), stream),
                                     "cudaMemsetAsync(non-finite index)");
    if (status.ok()) {
      status = CudaStatus(LaunchFindNonFinite(base_ + offset, count, element_bytes,
                                              dtype == DType::kBFloat16, first, stream),
                          "non-finite search kernel");
    }
    if (status.ok()) {
      status =
          CudaStatus(cudaMemcpyAsync(&found, first, sizeof(found), cudaMemcpyDeviceToHost, stream),
                     "cudaMemcpyAsync(non-finite index)");
    }
    cudaFreeAsync(first, stream);
    if (status.ok()) status = CudaStatus(cudaStreamSynchronize(stream), "non-finite search");
    RETURN_IF_ERROR(status);
    return found == ~0ull ? int64_t{-1} : static_cast<int64_t>(found);
  }

 private:
  // The server checks slices against the region; this guards the device itself.
  absl::Status CheckRange(uint64_t offset, uint64_t bytes) const {
    if (offset > byte_size_ || bytes > byte_size_ - offset) {
      return absl::InternalError(
          absl::StrCat("bytes [", offset, ", +", bytes, ") past the region's ", byte_size_));
    }
    return absl::OkStatus();
  }

  const int device_;
  char* const base_;
  const uint64_t byte_size_;
};

// The bytes from `pointer` to the end of its allocation, from the driver; nullopt when it
// cannot say.
std::optional<uint64_t> AllocationBytesFrom(void* pointer) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const GetAddressRange get_address_range = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &function, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return GetAddressRange{nullptr};
    }
    return reinterpret_cast<GetAddressRange>(function);
  }();
  if (get_address_range == nullptr) return std::nullopt;
  CUdeviceptr base = 0;
  size_t size = 0;
  const auto address = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(pointer));
  if (get_address_range(&base, &size, address) != CUDA_SUCCESS) return std::nullopt;
  return size - (address - base);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedDeviceMemory>> OpenIpcMemory(int device,
                                                                  absl::string_view handle,
                                                                  uint64_t byte_size) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle has ", handle.size(),
                                                   " bytes; a cudaIpcMemHandle_t has ",
                                                   sizeof(cudaIpcMemHandle_t)));
  }
  cudaIpcMemHandle_t ipc_handle;
  std::memcpy(&ipc_handle, handle.data(), sizeof(ipc_handle));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")")));
  void* base = nullptr;
  const cudaError_t error = cudaIpcOpenMemHandle(&base, ipc_handle, cudaIpcMemLazyEnablePeerAccess);
  if (error != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it for the next call on this thread
    return absl::InvalidArgumentError(
        absl::StrCat("raw_handle: cudaIpcOpenMemHandle on cuda:", device, " refused it (",
                     cudaGetErrorString(error),
                     "); send the handle cudaIpcGetMemHandle gave another process on this host"));
  }
  auto memory = std::make_unique<IpcDeviceMemory>(device, static_cast<char*>(base), byte_size);
  // Each return from here closes the handle (the destructor).
  const std::optional<uint64_t> allocation_bytes = AllocationBytesFrom(base);
  if (!allocation_bytes.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the CUDA driver cannot say how large the allocation raw_handle exports is (cuda:", device,
        "), so byte_size = ", byte_size, " cannot be checked"));
  }
  if (*allocation_bytes < byte_size) {
    return absl::InvalidArgumentError(absl::StrCat("byte_size = ", byte_size,
                                                   " is past the exported allocation's ",
                                                   *allocation_bytes, " bytes on cuda:", device));
  }
  return std::unique_ptr<SharedDeviceMemory>(std::move(memory));
}

}  // namespace attention::core::cuda

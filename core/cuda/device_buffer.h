// Memory of one call: buffers on the device, or pinned on the host, that grow to the
// largest request and are reused, and the arena that lays a call's arrays out in one.
#ifndef ATTENTION_CORE_CUDA_DEVICE_BUFFER_H_
#define ATTENTION_CORE_CUDA_DEVICE_BUFFER_H_

#include <cstdint>

#include <cuda_runtime.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status_macros.h"

namespace attention::core::cuda {

// Thread-compatible.
template <bool kPinnedHost>
class GrowingBuffer {
 public:
  GrowingBuffer() = default;
  GrowingBuffer(const GrowingBuffer&) = delete;
  GrowingBuffer& operator=(const GrowingBuffer&) = delete;
  ~GrowingBuffer() { Free(); }

  // At least `bytes`; the contents are not kept.
  absl::StatusOr<char*> Reserve(int64_t bytes) {
    if (bytes <= capacity_) return data_;
    Free();
    void* data = nullptr;
    const cudaError_t error = kPinnedHost ? cudaMallocHost(&data, bytes) : cudaMalloc(&data, bytes);
    RETURN_IF_ERROR(CudaStatus(
        error, absl::StrCat(kPinnedHost ? "cudaMallocHost(" : "cudaMalloc(", bytes, " bytes)")));
    data_ = static_cast<char*>(data);
    capacity_ = bytes;
    return data_;
  }

 private:
  void Free() {
    if (data_ == nullptr) return;
    if (kPinnedHost) {
      cudaFreeHost(data_);
    } else {
      cudaFree(data_);
    }
    data_ = nullptr;
    capacity_ = 0;
  }

  char* data_ = nullptr;
  int64_t capacity_ = 0;
};
using DeviceBuffer = GrowingBuffer<false>;
using PinnedBuffer = GrowingBuffer<true>;

// Byte offsets of the arrays of one call inside one allocation, 256-byte aligned.
class Arena {
 public:
  int64_t Add(int64_t bytes) {
    const int64_t offset = (size_ + 255) / 256 * 256;
    size_ = offset + bytes;
    return offset;
  }
  int64_t size() const { return size_; }

 private:
  int64_t size_ = 0;
};

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_DEVICE_BUFFER_H_

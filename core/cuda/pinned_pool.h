// Page-locked host buffers that a call's inputs are read straight into (Backend::
// PinnedHostBuffer), so that each is one DMA from the GPU. Pinning costs milliseconds and
// freeing waits for the device, so a buffer its last holder drops goes back to the pool, by
// power-of-two size class, and is kept up to a bound on the bytes kept. Locked memory is
// taken from the host's, so the pool also bounds what it holds at once (callers then read
// into ordinary memory). Plain C++ (the allocation is given), so that every machine tests it.
#ifndef ATTENTION_CORE_CUDA_PINNED_POOL_H_
#define ATTENTION_CORE_CUDA_PINNED_POOL_H_

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "core/mutex.h"

namespace attention::core::cuda {

class PinnedBufferPool : public std::enable_shared_from_this<PinnedBufferPool> {
 public:
  // Allocates `bytes` of page-locked memory (null on failure), and frees what it gave.
  struct Allocator {
    std::function<void*(size_t bytes)> allocate;
    std::function<void(void* buffer)> release;
  };
  // The smallest size class.
  static constexpr size_t kMinBytes = size_t{64} << 10;

  // Made by Create only: buffers hold the pool. At most `max_allocated_bytes` are allocated
  // at once, of which at most `max_kept_bytes` are kept while unused.
  static std::shared_ptr<PinnedBufferPool> Create(Allocator allocator, size_t max_kept_bytes,
                                                  size_t max_allocated_bytes);
  ~PinnedBufferPool();

  // A buffer of at least `bytes` (its size class), kept or allocated; null when the
  // allocation fails or would pass max_allocated_bytes. It returns to the pool when its
  // last holder drops it.
  std::shared_ptr<char> Get(size_t bytes);

  // Bytes of the buffers kept for reuse, and of every buffer allocated and not freed.
  size_t kept_bytes() const;
  size_t allocated_bytes() const;

  // The size class of `bytes`: a power of two, at least kMinBytes.
  static size_t SizeClass(size_t bytes);

 private:
  PinnedBufferPool(Allocator allocator, size_t max_kept_bytes, size_t max_allocated_bytes)
      : allocator_(std::move(allocator)),
        max_kept_bytes_(max_kept_bytes),
        max_allocated_bytes_(max_allocated_bytes) {}
  // Keeps `buffer` of `size` for reuse, or frees it when the pool keeps enough.
  void Return(void* buffer, size_t size);

  const Allocator allocator_;
  const size_t max_kept_bytes_;
  const size_t max_allocated_bytes_;
  mutable Mutex mu_;
  std::map<size_t, std::vector<void*>> kept_ ABSL_GUARDED_BY(mu_);
  size_t kept_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t allocated_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_PINNED_POOL_H_

#include "core/cuda/pinned_pool.h"

namespace attention::core::cuda {

std::shared_ptr<PinnedBufferPool> PinnedBufferPool::Create(Allocator allocator,
                                                           size_t max_kept_bytes,
                                                           size_t max_allocated_bytes) {
  return std::shared_ptr<PinnedBufferPool>(
      new PinnedBufferPool(std::move(allocator), max_kept_bytes, max_allocated_bytes));
}

PinnedBufferPool::~PinnedBufferPool() {
  for (auto& [size, buffers] : kept_) {
    for (void* buffer : buffers) allocator_.release(buffer);
  }
}

size_t PinnedBufferPool::SizeClass(size_t bytes) {
  size_t size = kMinBytes;
  while (size < bytes) size *= 2;
  return size;
}

std::shared_ptr<char> PinnedBufferPool::Get(size_t bytes) {
  const size_t size = SizeClass(bytes);
  void* buffer = nullptr;
  {
    MutexLock lock(mu_);
    auto kept = kept_.find(size);
    if (kept != kept_.end() && !kept->second.empty()) {
      buffer = kept->second.back();
      kept->second.pop_back();
      kept_bytes_ -= size;
    } else if (allocated_bytes_ + size > max_allocated_bytes_) {
      return nullptr;
    } else {
      allocated_bytes_ += size;  // counted before allocating, so that no race passes the bound
    }
  }
  if (buffer == nullptr) {
    buffer = allocator_.allocate(size);
    if (buffer == nullptr) {
      MutexLock lock(mu_);
      allocated_bytes_ -= size;
      return nullptr;
    }
  }
  std::shared_ptr<PinnedBufferPool> pool = shared_from_this();
  return std::shared_ptr<char>(static_cast<char*>(buffer),
                               [pool, size](char* held) { pool->Return(held, size); });
}

void PinnedBufferPool::Return(void* buffer, size_t size) {
  {
    MutexLock lock(mu_);
    if (kept_bytes_ + size <= max_kept_bytes_) {
      kept_[size].push_back(buffer);
      kept_bytes_ += size;
      return;
    }
    allocated_bytes_ -= size;
  }
  allocator_.release(buffer);
}

size_t PinnedBufferPool::kept_bytes() const {
  MutexLock lock(mu_);
  return kept_bytes_;
}

size_t PinnedBufferPool::allocated_bytes() const {
  MutexLock lock(mu_);
  return allocated_bytes_;
}

}  // namespace attention::core::cuda

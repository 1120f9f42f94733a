#include "server/app/malloc_tuning.h"

#include <malloc.h>

#include <cstdlib>

namespace attention::server {

void KeepLargeBuffersInHeap(size_t retained_bytes) {
  if (std::getenv("GLIBC_TUNABLES") != nullptr) return;
  // glibc's largest mmap threshold (HEAP_MAX_SIZE / 2 on 64-bit): larger blocks stay mapped.
  constexpr int kLargestHeapBlock = 32 << 20;
  mallopt(M_MMAP_THRESHOLD, kLargestHeapBlock);
  mallopt(M_TRIM_THRESHOLD, static_cast<int>(retained_bytes));
}

}  // namespace attention::server

// The pool of page-locked buffers (core/cuda/pinned_pool.h) over plain host memory: buffers
// are reused by size class, kept only up to the bound, never allocated past the other bound,
// outlive the pool that made them, and an allocation that fails gives null.
#include "core/cuda/pinned_pool.h"

#include <cstdlib>
#include <set>

#include "gtest/gtest.h"

namespace attention::core::cuda {
namespace {

// malloc and free, counted; `fail` makes allocations fail.
struct CountingAllocator {
  int allocations = 0, releases = 0;
  bool fail = false;
  PinnedBufferPool::Allocator Get() {
    return {[this](size_t bytes) -> void* {
              if (fail) return nullptr;
              ++allocations;
              return std::malloc(bytes);
            },
            [this](void* buffer) {
              ++releases;
              std::free(buffer);
            }};
  }
};

TEST(PinnedBufferPoolTest, BuffersAreReusedBySizeClass) {
  CountingAllocator counts;
  auto pool = PinnedBufferPool::Create(counts.Get(), size_t{1} << 20, size_t{16} << 20);
  EXPECT_EQ(PinnedBufferPool::SizeClass(1), PinnedBufferPool::kMinBytes);
  EXPECT_EQ(PinnedBufferPool::SizeClass(100 << 10), size_t{128} << 10);
  EXPECT_EQ(PinnedBufferPool::SizeClass(128 << 10), size_t{128} << 10);
  const char* first = nullptr;
  {
    std::shared_ptr<char> buffer = pool->Get(100 << 10);
    ASSERT_NE(buffer, nullptr);
    first = buffer.get();
    EXPECT_EQ(pool->allocated_bytes(), size_t{128} << 10);
  }
  EXPECT_EQ(pool->kept_bytes(), size_t{128} << 10);
  std::shared_ptr<char> again = pool->Get(120 << 10);  // the same class: the same buffer
  EXPECT_EQ(again.get(), first);
  EXPECT_EQ(counts.allocations, 1);
  std::shared_ptr<char> other = pool->Get(200 << 10);  // another class, or the one in use
  std::shared_ptr<char> third = pool->Get(100 << 10);
  EXPECT_EQ(counts.allocations, 3);
  const std::set<const char*> distinct = {again.get(), other.get(), third.get()};
  EXPECT_EQ(distinct.size(), 3u);
}

TEST(PinnedBufferPoolTest, KeepsNoMoreThanItsBoundAndFreesTheRest) {
  CountingAllocator counts;
  auto pool = PinnedBufferPool::Create(counts.Get(), size_t{256} << 10, size_t{512} << 10);
  {
    std::vector<std::shared_ptr<char>> held;
    for (int n = 0; n < 6; ++n) held.push_back(pool->Get(64 << 10));
    EXPECT_EQ(pool->allocated_bytes(), size_t{384} << 10);
    EXPECT_EQ(pool->Get(256 << 10), nullptr);  // 640 KiB would pass the 512 KiB bound
    EXPECT_EQ(counts.allocations, 6);
    EXPECT_NE(pool->Get(128 << 10), nullptr);  // 512 KiB in all: within it
  }
  // The 128 KiB one and two of 64 KiB kept (256 KiB), the other four freed.
  EXPECT_EQ(pool->kept_bytes(), size_t{256} << 10);
  EXPECT_EQ(counts.allocations, 7);
  EXPECT_EQ(counts.releases, 4);
  EXPECT_EQ(pool->allocated_bytes(), size_t{256} << 10);
}

TEST(PinnedBufferPoolTest, BuffersOutliveThePoolAndFailuresGiveNull) {
  CountingAllocator counts;
  auto pool = PinnedBufferPool::Create(counts.Get(), size_t{1} << 20, size_t{16} << 20);
  std::shared_ptr<char> kept_alive = pool->Get(10);
  { std::shared_ptr<char> returned = pool->Get(10); }
  counts.fail = true;
  EXPECT_EQ(pool->Get(1 << 20), nullptr);  // nothing of that class kept: allocation fails
  EXPECT_NE(pool->Get(10), nullptr);       // a kept one needs no allocation
  pool.reset();                            // the buffer holds what it needs
  kept_alive.get()[0] = 1;
  kept_alive.reset();
  EXPECT_EQ(counts.releases, counts.allocations);
}

}  // namespace
}  // namespace attention::core::cuda

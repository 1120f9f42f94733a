// The compute pool: every item runs exactly once, for one caller and for several at once,
// whatever the pool size (1 = the caller alone). Also run under ThreadSanitizer in CI.
#include "core/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace attention::core {
namespace {

TEST(ThreadPoolTest, EveryItemRunsOnceForConcurrentCallers) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    constexpr int kCallers = 4, kItems = 97, kRounds = 50;
    std::vector<std::vector<std::atomic<int>>> runs(kCallers);
    for (auto& counts : runs) counts = std::vector<std::atomic<int>>(kItems);
    std::vector<std::thread> callers;
    for (int c = 0; c < kCallers; ++c) {
      callers.emplace_back([&, c] {
        for (int round = 0; round < kRounds; ++round) {
          pool.ParallelFor(kItems, [&](int64_t i) { runs[c][i].fetch_add(1); });
        }
      });
    }
    for (std::thread& caller : callers) caller.join();
    for (int c = 0; c < kCallers; ++c) {
      for (int i = 0; i < kItems; ++i) {
        ASSERT_EQ(runs[c][i].load(), kRounds) << "threads " << threads << " caller " << c
                                              << " item " << i;
      }
    }
  }
}

TEST(ThreadPoolTest, ReturnsOnlyAfterEveryItemFinished) {
  ThreadPool pool(2);
  for (int64_t n : {0, 1, 2, 5, 64}) {
    std::atomic<int64_t> finished{0};
    pool.ParallelFor(n, [&](int64_t) {
      // A slow item: the call must not return before it is done.
      volatile double sink = 0;
      for (int k = 0; k < 20000; ++k) sink = sink + k;
      finished.fetch_add(1);
    });
    EXPECT_EQ(finished.load(), n);
  }
}

TEST(ThreadPoolTest, ParallelCopyCopiesEveryByteAndNoMore) {
  const uint64_t seed = 26;
  std::mt19937_64 rng(seed);
  for (int threads : {1, 3, 8}) {
    ThreadPool pool(threads);
    // Below one piece, exactly pieces, and sizes that leave a ragged last piece.
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{4097}, size_t{1} << 20,
                         (size_t{3} << 20) + 77, (size_t{9} << 20) + 13}) {
      std::vector<uint8_t> from(bytes), to(bytes + 64, 0xAB);
      for (uint8_t& b : from) b = static_cast<uint8_t>(rng());
      ParallelCopy(pool, to.data(), from.data(), bytes);
      ASSERT_TRUE(std::equal(from.begin(), from.end(), to.begin()))
          << "threads " << threads << " bytes " << bytes << " seed " << seed;
      for (size_t i = bytes; i < to.size(); ++i) {
        ASSERT_EQ(to[i], 0xAB) << "wrote past the end at " << i << ", bytes " << bytes;
      }
    }
  }
}

}  // namespace
}  // namespace attention::core

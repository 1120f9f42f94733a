// The compute pool: every item runs exactly once, for one caller and for several at once,
// whatever the pool size (1 = the caller alone). Also run under ThreadSanitizer in CI.
#include "core/cpu/thread_pool.h"

#include <atomic>
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

}  // namespace
}  // namespace attention::core

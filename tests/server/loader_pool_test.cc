// The loader pool's bound: jobs past max_jobs are refused at once, never queued.
#include "server/loader_pool.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

TEST(LoaderPoolTest, RefusesJobsPastTheBoundAndAcceptsAgainWhenOneFinishes) {
  LoaderPool pool(2);
  absl::Notification release, first_done;
  std::atomic<int> started{0};
  absl::Notification both_started;
  auto blocking = [&] {
    return [&]() -> absl::Status {
      if (++started == 2) both_started.Notify();
      release.WaitForNotification();
      return absl::OkStatus();
    };
  };
  auto ignore = [](const absl::Status&) {};
  ASSERT_TRUE(pool.TrySubmit(blocking(), [&](const absl::Status&) {
    // The slot is free before `done` runs: a caller told the result may submit at once.
    EXPECT_TRUE(pool.TrySubmit([] { return absl::CancelledError("third"); },
                               [&](const absl::Status& s) {
                                 EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
                                 first_done.Notify();
                               }));
  }));
  ASSERT_TRUE(pool.TrySubmit(blocking(), ignore));
  both_started.WaitForNotification();
  bool ran = false;
  EXPECT_FALSE(pool.TrySubmit([&ran] { ran = true; return absl::OkStatus(); }, ignore))
      << "a third job must be refused";
  release.Notify();
  first_done.WaitForNotification();
  pool.Shutdown();
  EXPECT_FALSE(ran);
  EXPECT_FALSE(pool.TrySubmit([] { return absl::OkStatus(); }, ignore))
      << "no jobs after Shutdown";
}

TEST(LoaderPoolTest, ShutdownRunsEveryJobTaken) {
  std::atomic<int> runs{0};
  {
    LoaderPool pool(3);
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(pool.TrySubmit([] { return absl::OkStatus(); },
                                 [&runs](const absl::Status&) { ++runs; }));
    }
    pool.Shutdown();
    EXPECT_EQ(runs.load(), 3);
  }
}

}  // namespace
}  // namespace attention::server

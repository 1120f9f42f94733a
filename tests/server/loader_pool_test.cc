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
  auto blocking = [&](absl::Notification* done) {
    return [&, done] {
      if (++started == 2) both_started.Notify();
      release.WaitForNotification();
      if (done != nullptr) done->Notify();
    };
  };
  ASSERT_TRUE(pool.TrySubmit(blocking(&first_done)));
  ASSERT_TRUE(pool.TrySubmit(blocking(nullptr)));
  both_started.WaitForNotification();
  bool ran = false;
  EXPECT_FALSE(pool.TrySubmit([&ran] { ran = true; })) << "a third job must be refused";
  release.Notify();
  first_done.WaitForNotification();
  // A finished job frees its slot (the counter drops right after the job returns).
  absl::Notification third_done;
  while (!pool.TrySubmit([&third_done] { third_done.Notify(); })) {
  }
  third_done.WaitForNotification();
  pool.Shutdown();
  EXPECT_FALSE(ran);
  EXPECT_FALSE(pool.TrySubmit([] {})) << "no jobs after Shutdown";
}

TEST(LoaderPoolTest, ShutdownRunsEveryJobTaken) {
  std::atomic<int> runs{0};
  {
    LoaderPool pool(3);
    for (int i = 0; i < 3; ++i) pool.TrySubmit([&runs] { ++runs; });
    pool.Shutdown();
    EXPECT_EQ(runs.load(), 3);
  }
}

}  // namespace
}  // namespace attention::server

// The loader pool's queue: jobs past max_jobs wait in FIFO order, within their deadlines; only a
// full queue (its length, or max_queued_bytes) refuses, naming the bound.
#include "server/batching/loader_pool.h"

#include <atomic>
#include <new>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

// A job that blocks its loader thread until released.
struct Blocker {
  absl::Notification started, release, finished;
  LoaderJob Job() {
    LoaderJob job;
    job.work = [this] {
      started.Notify();
      release.WaitForNotification();
      return absl::OkStatus();
    };
    job.done = [this](const absl::Status&) { finished.Notify(); };
    return job;
  }
};

TEST(LoaderPoolTest, JobsPastTheRunningOnesWaitAndRunInArrivalOrder) {
  LoaderPool pool(LoaderPoolOptions{1, 8});
  Blocker blocker;
  ASSERT_TRUE(pool.Submit(blocker.Job()).ok());
  blocker.started.WaitForNotification();
  std::vector<int> order;  // written by the one loader thread
  absl::Notification all_done;
  for (int i = 0; i < 5; ++i) {
    LoaderJob job;
    job.work = [&order, i] {
      order.push_back(i);
      return absl::OkStatus();
    };
    job.done = [&all_done, i](const absl::Status& status) {
      EXPECT_TRUE(status.ok()) << status;
      if (i == 4) all_done.Notify();
    };
    ASSERT_TRUE(pool.Submit(std::move(job)).ok()) << "job " << i << " must wait, not be refused";
  }
  EXPECT_EQ(pool.queued(), 5);
  blocker.release.Notify();
  all_done.WaitForNotification();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST(LoaderPoolTest, AJobThatThrowsIsAnsweredInternalAndTheThreadGoesOn) {
  LoaderPool pool(LoaderPoolOptions{1, 8});
  std::vector<absl::Status> answers(2);
  absl::Notification both;
  for (int i = 0; i < 2; ++i) {
    LoaderJob job;
    job.work = [i]() -> absl::Status {
      if (i == 0) throw std::bad_alloc();
      return absl::OkStatus();
    };
    job.done = [&answers, &both, i](const absl::Status& status) {
      answers[i] = status;
      if (i == 1) both.Notify();
    };
    ASSERT_TRUE(pool.Submit(std::move(job)).ok());
  }
  both.WaitForNotification();
  EXPECT_EQ(answers[0].code(), absl::StatusCode::kInternal) << answers[0];
  EXPECT_NE(answers[0].message().find("a loader job failed on an internal error"),
            std::string::npos)
      << answers[0];
  EXPECT_TRUE(answers[1].ok()) << answers[1];
}

TEST(LoaderPoolTest, AFullQueueRefusesNamingItsLength) {
  LoaderPool pool(LoaderPoolOptions{1, 1});
  Blocker running, waiting;
  ASSERT_TRUE(pool.Submit(running.Job()).ok());
  running.started.WaitForNotification();
  ASSERT_TRUE(pool.Submit(waiting.Job()).ok());
  bool ran = false;
  LoaderJob refused;
  refused.work = [&ran] {
    ran = true;
    return absl::OkStatus();
  };
  refused.done = [](const absl::Status&) { ADD_FAILURE() << "a refused job is not answered"; };
  const absl::Status status = pool.Submit(std::move(refused));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(),
            "the layer-build queue is full: 1 builds (LoadLayer and inline layers) are running "
            "(--max_concurrent_loads = 1) and 1 are waiting (--max_queued_loads = 1); retry "
            "later");
  running.release.Notify();
  waiting.release.Notify();
  waiting.finished.WaitForNotification();
  // Room again once the waiting job has started.
  Blocker later;
  later.release.Notify();
  EXPECT_TRUE(pool.Submit(later.Job()).ok());
  later.finished.WaitForNotification();
  EXPECT_FALSE(ran);
}

TEST(LoaderPoolTest, WaitingBytesCountAgainstMaxQueuedBytes) {
  BatcherOptions batcher_options;
  batcher_options.num_workers = 1;
  batcher_options.max_queued_bytes = 1000;
  Batcher batcher(batcher_options);
  LoaderPool pool(LoaderPoolOptions{1, 8}, &batcher);
  Blocker running, waiting;
  ASSERT_TRUE(pool.Submit(running.Job()).ok());
  running.started.WaitForNotification();
  LoaderJob big = waiting.Job();
  big.bytes = 600;
  ASSERT_TRUE(pool.Submit(std::move(big)).ok());
  LoaderJob over = Blocker().Job();
  over.bytes = 500;
  const absl::Status status = pool.Submit(std::move(over));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(),
            "the server's queued requests hold 600 bytes and this one needs 500 to wait for a "
            "layer build, over the limit of 1000 (--max_queued_bytes); retry later");
  // The batcher's queue shares the bound.
  EXPECT_EQ(batcher.ReserveQueuedBytes(401, "here").code(), absl::StatusCode::kResourceExhausted);
  running.release.Notify();
  waiting.started.WaitForNotification();  // a started job no longer holds queued bytes
  EXPECT_TRUE(batcher.ReserveQueuedBytes(1000, "here").ok());
  batcher.ReleaseQueuedBytes(1000);
  waiting.release.Notify();
  waiting.finished.WaitForNotification();
}

TEST(LoaderPoolTest, ExpiredAndCancelledJobsAreAnsweredWithoutRunning) {
  LoaderPool pool(LoaderPoolOptions{1, 8});
  Blocker running;
  ASSERT_TRUE(pool.Submit(running.Job()).ok());
  running.started.WaitForNotification();
  std::atomic<int> ran{0};
  absl::Notification late_done, cancelled_done;
  absl::Status late_status, cancelled_status;
  LoaderJob late;
  late.work = [&ran] {
    ++ran;
    return absl::OkStatus();
  };
  late.deadline = absl::Now() - absl::Seconds(1);  // passes while it waits
  late.done = [&](const absl::Status& s) {
    late_status = s;
    late_done.Notify();
  };
  LoaderJob cancelled;
  cancelled.work = late.work;
  cancelled.is_cancelled = [] { return true; };
  cancelled.done = [&](const absl::Status& s) {
    cancelled_status = s;
    cancelled_done.Notify();
  };
  ASSERT_TRUE(pool.Submit(std::move(late)).ok());
  ASSERT_TRUE(pool.Submit(std::move(cancelled)).ok());
  running.release.Notify();
  late_done.WaitForNotification();
  cancelled_done.WaitForNotification();
  EXPECT_EQ(late_status.code(), absl::StatusCode::kDeadlineExceeded) << late_status;
  EXPECT_NE(late_status.message().find("nothing was built"), std::string::npos);
  EXPECT_EQ(cancelled_status.code(), absl::StatusCode::kCancelled) << cancelled_status;
  EXPECT_EQ(ran.load(), 0);
}

TEST(LoaderPoolTest, ShutdownRunsEveryJobTakenAndRefusesLaterOnes) {
  std::atomic<int> runs{0};
  LoaderPool pool(LoaderPoolOptions{2, 8});
  for (int i = 0; i < 6; ++i) {
    LoaderJob counted;
    counted.work = [] { return absl::OkStatus(); };
    counted.done = [&runs](const absl::Status&) { ++runs; };
    EXPECT_TRUE(pool.Submit(std::move(counted)).ok());
  }
  pool.Shutdown();
  EXPECT_EQ(runs.load(), 6);
  LoaderJob job;
  job.work = [] { return absl::OkStatus(); };
  job.done = [](const absl::Status&) {};
  EXPECT_EQ(pool.Submit(std::move(job)).code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attention::server

// Batcher policy on its own: queue bound, deadlines, cancellation, priority, packing.
// Workers are held with notifications, never with sleeps.
#include "server/batcher.h"

#include <random>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

// An item that runs alone, records its tag, and can hold the worker until released.
std::unique_ptr<WorkItem> TaggedItem(int tag, std::vector<int>* order, absl::Mutex* mu,
                                     absl::Notification* started = nullptr,
                                     absl::Notification* release = nullptr) {
  auto item = std::make_unique<WorkItem>();
  item->run_alone = [=](core::ThreadPool&) {
    if (started != nullptr) started->Notify();
    if (release != nullptr) release->WaitForNotification();
    return core::AttentionResult{};
  };
  item->done = [=](absl::StatusOr<core::AttentionResult> result) {
    absl::MutexLock lock(mu);
    order->push_back(result.ok() ? tag : -static_cast<int>(result.status().code()));
  };
  return item;
}

class BatcherTest : public ::testing::Test {
 protected:
  BatcherTest() : pool_(1) {}
  core::ThreadPool pool_;
  absl::Mutex mu_;
  std::vector<int> order_;
};

TEST_F(BatcherTest, RejectsInvalidOptions) {
  BatcherOptions options;
  options.max_queue_requests = 0;
  EXPECT_EQ(options.Validate().message(), "max_queue_requests = 0 must be >= 1");
}

TEST_F(BatcherTest, FullQueueAnswersResourceExhaustedAtOnce) {
  BatcherOptions options;
  options.max_queue_requests = 1;
  Batcher batcher(options, pool_);
  absl::Notification started, release;
  ASSERT_TRUE(batcher.Submit(TaggedItem(1, &order_, &mu_, &started, &release)).ok());
  started.WaitForNotification();  // the worker holds item 1; the queue is empty
  ASSERT_TRUE(batcher.Submit(TaggedItem(2, &order_, &mu_)).ok());
  const absl::Status full = batcher.Submit(TaggedItem(3, &order_, &mu_));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("1 requests waiting"), std::string::npos) << full;
  release.Notify();
  batcher.Shutdown();
  EXPECT_EQ(order_, (std::vector<int>{1, 2}));
  EXPECT_EQ(batcher.Submit(TaggedItem(4, &order_, &mu_)).code(), absl::StatusCode::kUnavailable);
}

TEST_F(BatcherTest, ExpiredAndCancelledItemsAreNotComputed) {
  Batcher batcher(BatcherOptions(), pool_);
  absl::Notification started, release;
  ASSERT_TRUE(batcher.Submit(TaggedItem(1, &order_, &mu_, &started, &release)).ok());
  started.WaitForNotification();
  auto expired = TaggedItem(2, &order_, &mu_);
  expired->deadline = absl::Now() - absl::Seconds(1);
  auto cancelled = TaggedItem(3, &order_, &mu_);
  cancelled->is_cancelled = [] { return true; };
  ASSERT_TRUE(batcher.Submit(std::move(expired)).ok());
  ASSERT_TRUE(batcher.Submit(std::move(cancelled)).ok());
  ASSERT_TRUE(batcher.Submit(TaggedItem(4, &order_, &mu_)).ok());
  release.Notify();
  batcher.Shutdown();
  EXPECT_EQ(order_, (std::vector<int>{1, -static_cast<int>(absl::StatusCode::kDeadlineExceeded),
                                      -static_cast<int>(absl::StatusCode::kCancelled), 4}));
}

TEST_F(BatcherTest, HigherPriorityRunsFirstEqualPrioritiesInOrder) {
  Batcher batcher(BatcherOptions(), pool_);
  absl::Notification started, release;
  ASSERT_TRUE(batcher.Submit(TaggedItem(0, &order_, &mu_, &started, &release)).ok());
  started.WaitForNotification();
  const int priorities[] = {0, 5, 0, 9, 5};
  for (int tag = 1; tag <= 5; ++tag) {
    auto item = TaggedItem(tag, &order_, &mu_);
    item->priority = priorities[tag - 1];
    ASSERT_TRUE(batcher.Submit(std::move(item)).ok());
  }
  release.Notify();
  batcher.Shutdown();
  EXPECT_EQ(order_, (std::vector<int>{0, 4, 2, 5, 1, 3}));
}

TEST_F(BatcherTest, PacksRequestsOfOneLayerAndMatchesEachAlone) {
  core::MhaConfig config;
  config.embed_dim = 16;
  config.num_heads = 4;
  const core::MhaConfig resolved = *core::MhaConfig::Resolve(config);
  auto snapshot = std::make_shared<LayerSnapshot>();
  snapshot->name = "l";
  snapshot->layer = *core::MhaLayer::Create(resolved, core::MhaWeights::Random(resolved, 3));
  BatcherOptions options;
  options.max_batch_requests = 8;
  Batcher batcher(options, pool_);
  absl::Notification started, release;
  ASSERT_TRUE(batcher.Submit(TaggedItem(0, &order_, &mu_, &started, &release)).ok());
  started.WaitForNotification();  // everything below queues up and is packed together
  std::mt19937_64 rng(8);
  std::vector<std::vector<float>> outputs(5);
  std::vector<core::AttentionResult> alone(5);
  for (int n = 0; n < 5; ++n) {
    auto item = std::make_unique<WorkItem>();
    item->layer = snapshot;
    item->input.batch = 1 + n % 2;
    item->input.q_len = item->input.kv_len = 1 + 3 * n;
    std::uniform_real_distribution<float> uniform(-1, 1);
    std::vector<float> query(item->input.batch * item->input.q_len * 16);
    for (float& v : query) v = uniform(rng);
    item->storage.push_back(query);
    item->input.query = item->storage.back();
    item->input.options.causal = n % 2 == 0;
    item->tokens = item->input.batch * item->input.q_len;
    alone[n] = snapshot->layer->ForwardReference(item->input);
    item->done = [&outputs, n](absl::StatusOr<core::AttentionResult> result) {
      outputs[n] = result->output;
    };
    ASSERT_TRUE(batcher.Submit(std::move(item)).ok());
  }
  EXPECT_EQ(batcher.QueueDepth(), 5);
  release.Notify();
  batcher.Shutdown();
  for (int n = 0; n < 5; ++n) {
    ASSERT_EQ(outputs[n].size(), alone[n].output.size()) << n;
    for (size_t e = 0; e < outputs[n].size(); ++e) {
      ASSERT_NEAR(outputs[n][e], alone[n].output[e], 1e-4) << "request " << n;
    }
  }
}

}  // namespace
}  // namespace attention::server

// Batcher policy on its own: queue bound, deadlines, cancellation, priority, packing.
// Workers are held with notifications, never with sleeps.
#include "server/batching/batcher.h"

#include <map>
#include <random>

#include "absl/synchronization/notification.h"
#include "core/cpu/cpu_backend.h"
#include "prometheus/metric_family.h"
#include "gtest/gtest.h"

namespace attention::server {
namespace {

// Records `tag` (or minus the error code) when the item is answered.
void RecordTagWhenDone(WorkItem& item, int tag, std::vector<int>* order, absl::Mutex* mu) {
  item.done = [=](const absl::StatusOr<core::AttentionResult>& result) {
    absl::MutexLock lock(mu);
    order->push_back(result.ok() ? tag : -static_cast<int>(result.status().code()));
  };
}

// An item that runs alone, records its tag, and can hold the worker until released.
std::unique_ptr<WorkItem> TaggedItem(int tag, std::vector<int>* order, absl::Mutex* mu,
                                     absl::Notification* started = nullptr,
                                     absl::Notification* release = nullptr) {
  auto item = std::make_unique<SoloWorkItem>();
  item->run = [=]() -> absl::StatusOr<core::AttentionResult> {
    if (started != nullptr) started->Notify();
    if (release != nullptr) release->WaitForNotification();
    return core::AttentionResult{};
  };
  RecordTagWhenDone(*item, tag, order, mu);
  return item;
}

class BatcherTest : public ::testing::Test {
 protected:
  // One worker, which the tests hold, so that everything submitted meanwhile queues up.
  static BatcherOptions OneWorker() {
    BatcherOptions options;
    options.num_workers = 1;
    return options;
  }
  std::shared_ptr<const core::Backend> cpu_ = std::make_shared<core::CpuBackend>(1);
  absl::Mutex mu_;
  std::vector<int> order_;
};

TEST_F(BatcherTest, RejectsInvalidOptions) {
  BatcherOptions options;
  options.limits.max_queue_requests = 0;
  EXPECT_EQ(options.Validate().message(), "max_queue_requests = 0 must be >= 1");
  options = BatcherOptions{};
  options.limits.queue_timeout = -absl::Seconds(1);
  EXPECT_EQ(options.Validate().message(), "queue_timeout = -1s must be >= 0");
}

TEST_F(BatcherTest, FullQueueAnswersResourceExhaustedAtOnce) {
  BatcherOptions options = OneWorker();
  options.limits.max_queue_requests = 1;
  Batcher batcher(options);
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

// The gauge `name`{layer=...} as the registry reports it, or -1.
double LayerGauge(Metrics& metrics, const std::string& name, const std::string& layer) {
  for (const prometheus::MetricFamily& family : metrics.registry().Collect()) {
    if (family.name != name) continue;
    for (const prometheus::ClientMetric& metric : family.metric) {
      for (const prometheus::ClientMetric::Label& label : metric.label) {
        if (label.name == "layer" && label.value == layer) return metric.gauge.value;
      }
    }
  }
  return -1;
}

double QueueDepthGauge(Metrics& metrics, const std::string& layer) {
  return LayerGauge(metrics, "attention_queue_depth_requests", layer);
}

// A small named layer and a one-token request for it that records its tag when answered.
std::shared_ptr<LayerSnapshot> SmallLayer(const std::string& name) {
  core::MhaConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  const core::MhaConfig resolved = *core::MhaConfig::Resolve(config);
  auto snapshot = std::make_shared<LayerSnapshot>();
  snapshot->name = name;
  snapshot->layer = *core::MhaLayer::Create(resolved, core::MhaWeights::Random(resolved, 1),
                                            std::make_shared<core::CpuBackend>(1));
  return snapshot;
}

std::unique_ptr<WorkItem> LayerItem(std::shared_ptr<LayerSnapshot> layer, int tag,
                                    std::vector<int>* order, absl::Mutex* mu) {
  auto item = std::make_unique<LayerWorkItem>();
  RecordTagWhenDone(*item, tag, order, mu);
  item->snapshot = std::move(layer);
  item->input.batch = item->input.q_len = item->input.kv_len = 1;
  item->storage.push_back(std::vector<float>(8, 0.5f));
  item->input.query = item->storage.back();
  item->tokens = 1;
  return item;
}

TEST_F(BatcherTest, EachLayerHasItsOwnQueueWithTheServersLimitOrItsOwn) {
  BatcherOptions options = OneWorker();
  options.limits.max_queue_requests = 2;
  Metrics metrics;
  Batcher batcher(options, &metrics);
  absl::Notification started, release;
  ASSERT_TRUE(batcher.Submit(TaggedItem(0, &order_, &mu_, &started, &release)).ok());
  started.WaitForNotification();  // the worker is held; everything below stays queued
  const auto a = SmallLayer("a"), b = SmallLayer("b");
  b->batching.max_queue_requests = 1;  // b's own limit; a has the server's
  ASSERT_TRUE(batcher.Submit(LayerItem(a, 1, &order_, &mu_)).ok());
  ASSERT_TRUE(batcher.Submit(LayerItem(a, 2, &order_, &mu_)).ok());
  const absl::Status a_full = batcher.Submit(LayerItem(a, 3, &order_, &mu_));
  EXPECT_EQ(a_full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(a_full.message().find("queue of layer \"a\" is full (2 requests waiting, limit 2)"),
            std::string::npos)
      << a_full;
  ASSERT_TRUE(batcher.Submit(LayerItem(b, 4, &order_, &mu_)).ok());  // b is not held back by a
  const absl::Status b_full = batcher.Submit(LayerItem(b, 5, &order_, &mu_));
  EXPECT_EQ(b_full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b_full.message().find("queue of layer \"b\" is full (1 requests waiting, limit 1)"),
            std::string::npos)
      << b_full;
  EXPECT_EQ(batcher.QueueDepth(), 3);
  EXPECT_EQ(QueueDepthGauge(metrics, "a"), 2);
  EXPECT_EQ(QueueDepthGauge(metrics, "b"), 1);
  EXPECT_EQ(LayerGauge(metrics, "attention_queue_capacity_requests", "a"), 2);
  EXPECT_EQ(LayerGauge(metrics, "attention_queue_capacity_requests", "b"), 1);
  release.Notify();
  batcher.Shutdown();
  EXPECT_EQ(order_, (std::vector<int>{0, 1, 2, 4}));
  EXPECT_EQ(QueueDepthGauge(metrics, "a"), 0);
  EXPECT_EQ(QueueDepthGauge(metrics, "b"), 0);
}

TEST_F(BatcherTest, ItemsPastTheirLayersQueueTimeoutAreNotComputed) {
  Batcher batcher(OneWorker());  // the server's limits: no queue timeout
  absl::Notification started, release;
  ASSERT_TRUE(batcher.Submit(TaggedItem(1, &order_, &mu_, &started, &release)).ok());
  started.WaitForNotification();
  const auto layer = SmallLayer("strict");
  layer->batching.queue_timeout = absl::Nanoseconds(1);  // expires behind the held item 1
  ASSERT_TRUE(batcher.Submit(LayerItem(layer, 2, &order_, &mu_)).ok());
  release.Notify();
  batcher.Shutdown();
  EXPECT_EQ(order_, (std::vector<int>{1, -static_cast<int>(absl::StatusCode::kDeadlineExceeded)}));
}

TEST_F(BatcherTest, ExpiredAndCancelledItemsAreNotComputed) {
  Batcher batcher(OneWorker());
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
  BatcherOptions options = OneWorker();
  options.starvation_limit = absl::Hours(1);  // however slow this machine, nothing starves
  Batcher batcher(options);
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
  snapshot->layer = *core::MhaLayer::Create(resolved, core::MhaWeights::Random(resolved, 3), cpu_);
  BatcherOptions options = OneWorker();
  options.limits.max_batch_requests = 8;
  Batcher batcher(options);
  absl::Notification started, release;
  ASSERT_TRUE(batcher.Submit(TaggedItem(0, &order_, &mu_, &started, &release)).ok());
  started.WaitForNotification();  // everything below queues up and is packed together
  std::mt19937_64 rng(8);
  std::vector<std::vector<float>> outputs(5);
  std::vector<core::AttentionResult> alone(5), alone_fast(5);
  for (int n = 0; n < 5; ++n) {
    auto item = std::make_unique<LayerWorkItem>();
    item->snapshot = snapshot;
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
    const core::MhaInput* one[] = {&item->input};
    alone_fast[n] = snapshot->layer->ForwardBatch(one)->front();
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
      // Packing changes only float rounding: OpenBLAS picks kernels by matrix size, so
      // results are not always bitwise equal (seen: ~0.3% of values, by < 5e-7).
      ASSERT_NEAR(outputs[n][e], alone_fast[n].output[e], 1e-6) << "request " << n;
    }
  }
}

// A backend whose every forward pass fails, as a GPU out of memory does.
class FailingBackend final : public core::Backend {
 public:
  const std::string& name() const override { return name_; }
  absl::Status Supports(const core::MhaConfig&, const core::AttentionOptions&) const override {
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<core::PreparedLayer>> Prepare(
      const core::MhaConfig&, const core::MhaWeightsView&) const override {
    return std::make_unique<Prepared>();
  }
  absl::StatusOr<core::AttentionResult> ScaledDotProductAttention(
      const core::SdpaInput&) const override {
    return absl::ResourceExhaustedError("out of device memory");
  }

 private:
  struct Prepared final : core::PreparedLayer {
    absl::StatusOr<std::vector<core::AttentionResult>> ForwardBatch(
        absl::Span<const core::MhaInput* const>) const override {
      return absl::ResourceExhaustedError("out of device memory");
    }
    int64_t DeviceWeightBytes() const override { return 0; }
  };
  const std::string name_ = "failing";
};

TEST_F(BatcherTest, BackendErrorFailsEveryRequestOfItsBatchAndTheWorkerGoesOn) {
  core::MhaConfig config;
  config.embed_dim = 4;
  config.num_heads = 2;
  const core::MhaConfig resolved = *core::MhaConfig::Resolve(config);
  auto snapshot = std::make_shared<LayerSnapshot>();
  snapshot->name = "on-failing-device";
  snapshot->layer = *core::MhaLayer::Create(resolved, core::MhaWeights::Random(resolved, 1),
                                            std::make_shared<FailingBackend>());
  Batcher batcher(OneWorker());
  absl::Notification started, release;
  ASSERT_TRUE(batcher.Submit(TaggedItem(0, &order_, &mu_, &started, &release)).ok());
  started.WaitForNotification();  // the next three are packed into one batch
  const std::vector<float> query(4, 0.5f);
  for (int tag = 1; tag <= 3; ++tag) {
    auto item = std::make_unique<LayerWorkItem>();
    item->snapshot = snapshot;
    item->input.query = query;
    item->tokens = 1;
    item->done = [this, tag](const absl::StatusOr<core::AttentionResult>& result) {
      absl::MutexLock lock(&mu_);
      order_.push_back(result.ok() ? tag : -static_cast<int>(result.status().code()));
    };
    ASSERT_TRUE(batcher.Submit(std::move(item)).ok());
  }
  ASSERT_TRUE(batcher.Submit(TaggedItem(4, &order_, &mu_)).ok());
  release.Notify();
  batcher.Shutdown();
  const int exhausted = -static_cast<int>(absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(order_, (std::vector<int>{0, exhausted, exhausted, exhausted, 4}));
}

TEST_F(BatcherTest, AComputeThatThrowsAnswersItsBatchInternalAndTheWorkerGoesOn) {
  Batcher batcher(OneWorker());
  auto throwing = std::make_unique<SoloWorkItem>();
  throwing->run = []() -> absl::StatusOr<core::AttentionResult> {
    std::vector<float> too_many;
    too_many.resize(too_many.max_size() + 1);  // throws std::length_error
    return core::AttentionResult{};
  };
  absl::Status answered;
  throwing->done = [&](const absl::StatusOr<core::AttentionResult>& result) {
    answered = result.status();
  };
  ASSERT_TRUE(batcher.Submit(std::move(throwing)).ok());
  ASSERT_TRUE(batcher.Submit(TaggedItem(1, &order_, &mu_)).ok());
  batcher.Shutdown();
  EXPECT_EQ(answered.code(), absl::StatusCode::kInternal) << answered;
  EXPECT_NE(answered.message().find("failed on an internal error (vector"), std::string::npos)
      << answered;
  EXPECT_EQ(order_, (std::vector<int>{1}));
}

}  // namespace
}  // namespace attention::server

namespace attention::server {
namespace {

// The policy on a fake clock: times are given, nothing sleeps.
class BatchQueueTest : public ::testing::Test {
 protected:
  BatchQueueTest() {
    layer_ = std::make_shared<LayerSnapshot>();
    layer_->name = "a";
    other_layer_ = std::make_shared<LayerSnapshot>();
    other_layer_->name = "b";
  }

  std::unique_ptr<WorkItem> Item(int tag, int64_t tokens, int priority = 0,
                                 bool other_layer = false) {
    auto item = std::make_unique<LayerWorkItem>();
    item->snapshot = other_layer ? other_layer_ : layer_;
    item->tokens = tokens;
    item->priority = priority;
    tags_[item.get()] = tag;
    return item;
  }

  std::vector<int> Tags(const std::vector<std::unique_ptr<WorkItem>>& batch) {
    std::vector<int> tags;
    for (const auto& item : batch) tags.push_back(tags_[item.get()]);
    return tags;
  }

  void Push(BatchQueue& queue, std::unique_ptr<WorkItem> item, absl::Time now) {
    ASSERT_TRUE(queue.Push(item, now).ok());
  }

  const absl::Time t0_ = absl::FromUnixSeconds(1000);
  std::shared_ptr<LayerSnapshot> layer_, other_layer_;
  std::map<const WorkItem*, int> tags_;
};

TEST_F(BatchQueueTest, WaitsForTheDelayThenCloses) {
  BatcherOptions options;
  options.limits.max_queue_delay = absl::Milliseconds(10);
  BatchQueue queue(options);
  Push(queue, Item(1, 4), t0_);
  Push(queue, Item(2, 4), t0_ + absl::Milliseconds(3));
  absl::Time due;
  EXPECT_TRUE(queue.PopDue(t0_ + absl::Milliseconds(9), false, &due).empty());
  EXPECT_EQ(due, t0_ + absl::Milliseconds(10));
  EXPECT_EQ(Tags(queue.PopDue(t0_ + absl::Milliseconds(10), false, &due)),
            (std::vector<int>{1, 2}));
  EXPECT_EQ(queue.size(), 0);
  EXPECT_EQ(queue.tokens(), 0);
}

TEST_F(BatchQueueTest, ClosesEarlyWhenFullByRequestsOrTokens) {
  BatcherOptions options;
  options.limits.max_queue_delay = absl::Seconds(1);
  options.limits.max_batch_requests = 2;
  options.limits.max_batch_tokens = 10;
  BatchQueue queue(options);
  absl::Time due;
  Push(queue, Item(1, 3), t0_);
  Push(queue, Item(2, 3), t0_);
  Push(queue, Item(3, 3), t0_);
  EXPECT_EQ(Tags(queue.PopDue(t0_, false, &due)), (std::vector<int>{1, 2}));  // 2 requests
  Push(queue, Item(4, 8), t0_);
  EXPECT_EQ(Tags(queue.PopDue(t0_, false, &due)), (std::vector<int>{3}));  // 3 + 8 > 10 tokens
  EXPECT_TRUE(queue.PopDue(t0_, false, &due).empty());  // 4 alone is not full: it waits
  EXPECT_EQ(Tags(queue.PopDue(t0_, true, &due)), (std::vector<int>{4}));  // flush
}

TEST_F(BatchQueueTest, ZeroDelayClosesAtOnceAndKeepsLayersApart) {
  BatchQueue queue(BatcherOptions{});
  absl::Time due;
  Push(queue, Item(1, 1), t0_);
  Push(queue, Item(2, 1, 0, /*other_layer=*/true), t0_);
  Push(queue, Item(3, 1), t0_);
  EXPECT_EQ(Tags(queue.PopDue(t0_, false, &due)), (std::vector<int>{1, 3}));
  EXPECT_EQ(Tags(queue.PopDue(t0_, false, &due)), (std::vector<int>{2}));
  EXPECT_TRUE(queue.PopDue(t0_, false, &due).empty());
  EXPECT_EQ(due, absl::InfiniteFuture());
}

TEST_F(BatchQueueTest, QueuedBytesAreBoundedAcrossLayers) {
  BatcherOptions options;
  options.max_queued_bytes = 1000;
  BatchQueue queue(options);
  auto sized = [&](int tag, int64_t bytes, bool other_layer) {
    auto item = Item(tag, 1, 0, other_layer);
    item->bytes = bytes;
    return item;
  };
  Push(queue, sized(1, 600, false), t0_);
  Push(queue, sized(2, 400, true), t0_);  // another layer counts against the same bound
  EXPECT_EQ(queue.bytes(), 1000);
  auto over = sized(3, 1, false);
  const absl::Status status = queue.Push(over, t0_);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("the server's queued requests hold 1000 bytes and this one "
                                  "needs 1, over the limit of 1000 (--max_queued_bytes)"),
            std::string::npos)
      << status;
  absl::Time due;
  EXPECT_EQ(queue.PopDue(t0_, false, &due).size(), 1u);  // popping frees its bytes
  EXPECT_LT(queue.bytes(), 1000);
  Push(queue, std::move(over), t0_);
  // Alone, an item larger than the bound is admitted (RequestBudget bounds it).
  BatchQueue empty(options);
  Push(empty, sized(4, 5000, false), t0_);
  EXPECT_EQ(empty.bytes(), 5000);
  options.max_queued_bytes = 0;
  EXPECT_EQ(options.Validate().message(), "max_queued_bytes = 0 must be >= 1");
}

TEST_F(BatchQueueTest, RequestLargerThanTheTokenBoundIsRefusedEvenByAnEmptyQueue) {
  BatcherOptions options;
  options.limits.max_queue_tokens = 10;
  BatchQueue queue(options);
  auto too_large = Item(1, 11);
  const absl::Status status = queue.Push(too_large, t0_);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("the request has 11 query tokens, more than the 10 that layer "
                                  "\"a\" may queue (max_queue_tokens)"),
            std::string::npos)
      << status;
  EXPECT_EQ(queue.size(), 0);
  Push(queue, Item(2, 10), t0_);  // exactly the bound is fine
  EXPECT_EQ(queue.tokens(), 10);
}

TEST_F(BatchQueueTest, QueueLimitsAnswerResourceExhausted) {
  BatcherOptions options;
  options.limits.max_queue_requests = 2;
  options.limits.max_queue_tokens = 10;
  BatchQueue queue(options);
  Push(queue, Item(1, 6), t0_);
  auto too_many_tokens = Item(2, 5);
  const absl::Status tokens = queue.Push(too_many_tokens, t0_);
  EXPECT_EQ(tokens.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(tokens.message().find("queue of layer \"a\" is full (6 tokens waiting, limit 10)"),
            std::string::npos)
      << tokens;
  ASSERT_NE(too_many_tokens, nullptr);  // a refused item stays with the caller
  Push(queue, Item(3, 4), t0_);
  auto too_many_requests = Item(4, 1);
  const absl::Status requests = queue.Push(too_many_requests, t0_);
  EXPECT_EQ(requests.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(requests.message().find("(2 requests waiting, limit 2)"), std::string::npos)
      << requests;
  // Each layer has its own limits: layer "b" is still admitted while "a" is full.
  Push(queue, Item(5, 10, 0, /*other_layer=*/true), t0_);
  Push(queue, Item(6, 0, 0, /*other_layer=*/true), t0_);
  EXPECT_EQ(queue.size("a"), 2);
  EXPECT_EQ(queue.size("b"), 2);
  EXPECT_EQ(queue.size(), 4);
  EXPECT_EQ(queue.tokens(), 20);
  // Popping a's batch frees a's queue only.
  absl::Time due;
  EXPECT_EQ(Tags(queue.PopDue(t0_, false, &due)), (std::vector<int>{1, 3}));
  EXPECT_EQ(queue.size("a"), 0);
  Push(queue, Item(7, 10), t0_);
  auto b_full = Item(8, 0, 0, /*other_layer=*/true);
  EXPECT_EQ(queue.Push(b_full, t0_).code(), absl::StatusCode::kResourceExhausted);
}

TEST_F(BatchQueueTest, ALayerWaitingForItsDelayDoesNotHoldBackAnotherLayersDueBatch) {
  BatcherOptions options;
  options.limits.max_queue_delay = absl::Milliseconds(10);
  options.limits.max_batch_requests = 2;
  BatchQueue queue(options);
  absl::Time due;
  Push(queue, Item(1, 1), t0_);  // a: waits up to 10 ms for a second request
  Push(queue, Item(2, 1, 0, /*other_layer=*/true), t0_ + absl::Milliseconds(1));
  EXPECT_TRUE(queue.PopDue(t0_ + absl::Milliseconds(2), false, &due).empty());
  EXPECT_EQ(due, t0_ + absl::Milliseconds(10));  // a's delay ends first
  Push(queue, Item(3, 1, 0, /*other_layer=*/true), t0_ + absl::Milliseconds(2));
  // b is full (2 requests) and runs at once although a, older, is still waiting.
  EXPECT_EQ(Tags(queue.PopDue(t0_ + absl::Milliseconds(2), false, &due)),
            (std::vector<int>{2, 3}));
  EXPECT_TRUE(queue.PopDue(t0_ + absl::Milliseconds(9), false, &due).empty());
  EXPECT_EQ(Tags(queue.PopDue(t0_ + absl::Milliseconds(10), false, &due)),
            (std::vector<int>{1}));
}

TEST_F(BatchQueueTest, ALayersOwnLimitsApplyToThatLayerOnly) {
  BatcherOptions options;  // the server's: 64 requests, no delay, 1024 queued
  layer_->batching.max_batch_requests = 2;
  layer_->batching.max_queue_delay = absl::Milliseconds(10);
  layer_->batching.max_queue_requests = 3;
  BatchQueue queue(options);
  absl::Time due;
  Push(queue, Item(1, 1), t0_);
  Push(queue, Item(2, 1, 0, /*other_layer=*/true), t0_);
  // b has no delay and runs at once; a waits out its own 10 ms.
  EXPECT_EQ(Tags(queue.PopDue(t0_, false, &due)), (std::vector<int>{2}));
  EXPECT_TRUE(queue.PopDue(t0_, false, &due).empty());
  EXPECT_EQ(due, t0_ + absl::Milliseconds(10));
  const absl::Time t1 = t0_ + absl::Milliseconds(1);
  Push(queue, Item(3, 1), t1);
  Push(queue, Item(4, 1), t1);
  auto past_limit = Item(5, 1);
  const absl::Status full = queue.Push(past_limit, t1);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("(3 requests waiting, limit 3)"), std::string::npos) << full;
  // a's batch is full at 2 requests, so it closes before the delay; the third waits.
  EXPECT_EQ(Tags(queue.PopDue(t1, false, &due)), (std::vector<int>{1, 3}));
  EXPECT_TRUE(queue.PopDue(t1, false, &due).empty());
  EXPECT_EQ(due, t1 + absl::Milliseconds(10));
  // b keeps the server's limits: five requests make one batch.
  for (int tag = 6; tag <= 10; ++tag) Push(queue, Item(tag, 1, 0, /*other_layer=*/true), t1);
  EXPECT_EQ(Tags(queue.PopDue(t1, false, &due)), (std::vector<int>{6, 7, 8, 9, 10}));
  EXPECT_EQ(Tags(queue.PopDue(t1 + absl::Milliseconds(10), false, &due)), (std::vector<int>{4}));
}

TEST_F(BatchQueueTest, QueueTimeoutShortensTheDeadlineOfItsLayerOnly) {
  BatcherOptions options;
  options.limits.queue_timeout = absl::Milliseconds(50);  // the server's
  other_layer_->batching.queue_timeout = absl::ZeroDuration();  // b: no limit of its own
  BatchQueue queue(options);
  auto soon = Item(1, 1);
  soon->deadline = t0_ + absl::Milliseconds(20);  // the call's deadline is earlier: kept
  auto late = Item(2, 1);
  late->deadline = t0_ + absl::Seconds(5);
  WorkItem* soon_item = soon.get();
  WorkItem* late_item = late.get();
  WorkItem* unlimited = nullptr;
  {
    auto item = Item(3, 1, 0, /*other_layer=*/true);
    unlimited = item.get();
    Push(queue, std::move(item), t0_);
  }
  Push(queue, std::move(soon), t0_);
  Push(queue, std::move(late), t0_ + absl::Milliseconds(10));
  EXPECT_EQ(soon_item->deadline, t0_ + absl::Milliseconds(20));
  EXPECT_EQ(late_item->deadline, t0_ + absl::Milliseconds(60));
  EXPECT_EQ(unlimited->deadline, absl::InfiniteFuture());
}

TEST_F(BatchQueueTest, OfSeveralDueBatchesTheHighestRankedLeaderRunsFirst) {
  BatchQueue queue(BatcherOptions{});
  absl::Time due;
  Push(queue, Item(1, 1), t0_);
  Push(queue, Item(2, 1, /*priority=*/3, /*other_layer=*/true), t0_);
  Push(queue, Item(3, 1), t0_);
  Push(queue, Item(4, 1, /*priority=*/0, /*other_layer=*/true), t0_);
  // b's batch is led by priority 3; a's batch, older, goes next; priority orders members.
  EXPECT_EQ(Tags(queue.PopDue(t0_, false, &due)), (std::vector<int>{2, 4}));
  EXPECT_EQ(Tags(queue.PopDue(t0_, false, &due)), (std::vector<int>{1, 3}));
}

TEST_F(BatchQueueTest, PriorityFirstButStarvingRequestsGoAhead) {
  BatcherOptions options;
  options.limits.max_batch_requests = 1;
  options.starvation_limit = absl::Milliseconds(100);
  BatchQueue queue(options);
  absl::Time due;
  Push(queue, Item(1, 1, /*priority=*/0), t0_);
  Push(queue, Item(2, 1, /*priority=*/5), t0_ + absl::Milliseconds(50));
  Push(queue, Item(3, 1, /*priority=*/5), t0_ + absl::Milliseconds(60));
  // At 90 ms nothing starves: priority 5 first, in arrival order.
  EXPECT_EQ(Tags(queue.PopDue(t0_ + absl::Milliseconds(90), false, &due)), (std::vector<int>{2}));
  // At 150 ms request 1 has waited 150 ms > 100 ms and goes ahead of priority 5.
  EXPECT_EQ(Tags(queue.PopDue(t0_ + absl::Milliseconds(150), false, &due)),
            (std::vector<int>{1}));
  EXPECT_EQ(Tags(queue.PopDue(t0_ + absl::Milliseconds(150), false, &due)),
            (std::vector<int>{3}));
}

}  // namespace
}  // namespace attention::server

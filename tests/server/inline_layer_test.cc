// Inline layers under concurrency (issue 23): builds wait for a loader thread instead of being
// refused, a full queue says which bound it hit, and recently built inline layers are cached by a
// hash of their config and weights.
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/barrier.h"
#include "absl/synchronization/notification.h"
#include "test_server.h"

namespace attention::server::testing {
namespace {

constexpr int64_t kEmbedDim = 32;
constexpr int kDistinctLayers = 6;

uint64_t Seed(uint64_t fallback) {
  const char* env = std::getenv("ATTENTION_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : fallback;
}

// A request of [1, tokens, kEmbedDim] carrying inline layer `layer` (seeded random init); odd
// layers ask for dropout, a per-request option that is not part of the layer.
v1::MultiHeadAttentionRequest InlineRequest(std::mt19937_64& rng, int layer, int64_t tokens) {
  v1::MultiHeadAttentionRequest request;
  v1::LayerSpec* spec = request.mutable_inline_layer();
  spec->mutable_config()->set_embed_dim(kEmbedDim);
  spec->mutable_config()->set_num_heads(2);
  spec->mutable_random_init()->set_seed(1000 + layer);
  if (layer % 2 == 1) {
    request.mutable_options()->set_dropout_p(0.25f);
    request.mutable_options()->set_dropout_seed(7);
  }
  wire::EncodeTensor(RandomValues(rng, tokens * kEmbedDim), {1, tokens, kEmbedDim},
                     core::DType::kFloat32, request.mutable_query());
  return request;
}

// The same config with explicit weights: every tensor from `rng`.
void SetInlineWeights(std::mt19937_64& rng, v1::LayerSpec* spec) {
  spec->mutable_config()->set_embed_dim(kEmbedDim);
  spec->mutable_config()->set_num_heads(2);
  auto* tensors = spec->mutable_inline_weights()->mutable_tensors();
  for (const char* projection : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
    wire::EncodeTensor(RandomValues(rng, kEmbedDim * kEmbedDim), {kEmbedDim, kEmbedDim},
                       core::DType::kFloat32, &(*tensors)[std::string(projection) + ".weight"]);
    wire::EncodeTensor(RandomValues(rng, kEmbedDim), {kEmbedDim}, core::DType::kFloat32,
                       &(*tensors)[std::string(projection) + ".bias"]);
  }
}

double CounterValue(AttentionServer& server, const std::string& name) {
  for (const auto& family : server.metrics().registry().Collect()) {
    if (family.name == name && !family.metric.empty()) return family.metric[0].counter.value;
  }
  ADD_FAILURE() << name << " is not exported";
  return -1;
}

class InlineLayerTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.demo_layer = false;
    options.max_concurrent_loads = 2;
    return options;
  }

  // `callers` threads at once, each sending `per_caller` requests of the distinct layers.
  void ExpectAllOk(int callers, int per_caller) {
    const uint64_t seed = Seed(2301);
    SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
    absl::Barrier* start = new absl::Barrier(callers);  // deletes itself
    std::vector<std::thread> threads;
    std::vector<std::string> failures(callers);
    for (int c = 0; c < callers; ++c) {
      threads.emplace_back([&, c] {
        std::mt19937_64 rng(seed + c);
        if (start->Block()) delete start;
        for (int r = 0; r < per_caller; ++r) {
          auto answer = client_->MultiHeadAttention(
              InlineRequest(rng, (c + r) % kDistinctLayers, 1 + (c + r) % 5));
          if (!answer.ok() && failures[c].empty()) failures[c] = answer.status().ToString();
        }
      });
    }
    for (auto& thread : threads) thread.join();
    for (int c = 0; c < callers; ++c) EXPECT_EQ(failures[c], "") << "caller " << c;
    // Each distinct layer built once; every other request was a hit.
    const auto& cache = server_->inline_layer_cache();
    EXPECT_EQ(cache.builds(), kDistinctLayers);
    EXPECT_EQ(cache.builds() + cache.hits(), callers * per_caller);
  }
};

TEST_F(InlineLayerTest, EightConcurrentCallersAllGetOk) { ExpectAllOk(8, 6); }

TEST_F(InlineLayerTest, SixtyFourConcurrentCallersAllGetOk) { ExpectAllOk(64, 2); }

TEST_F(InlineLayerTest, StreamsWithInlineLayersAllGetOk) {
  const uint64_t seed = Seed(2302);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  constexpr int kStreams = 8, kPerStream = 12;
  auto stub = v1::AttentionService::NewStub(client_->channel());
  std::vector<std::thread> threads;
  std::vector<int> ok(kStreams, 0);
  for (int s = 0; s < kStreams; ++s) {
    threads.emplace_back([&, s] {
      std::mt19937_64 rng(seed + s);
      grpc::ClientContext context;
      auto stream = stub->MultiHeadAttentionStream(&context);
      // Written all at once, so a stream's requests wait for builds together.
      for (int r = 0; r < kPerStream; ++r) {
        v1::MultiHeadAttentionRequest request = InlineRequest(rng, (s + r) % kDistinctLayers, 3);
        request.set_request_id(std::to_string(r));
        ASSERT_TRUE(stream->Write(request));
      }
      stream->WritesDone();
      for (v1::MultiHeadAttentionStreamResponse answer; stream->Read(&answer);) {
        EXPECT_EQ(answer.error_code(), 0) << answer.error_message();
        if (answer.error_code() == 0) ++ok[s];
      }
      EXPECT_TRUE(stream->Finish().ok());
    });
  }
  for (auto& thread : threads) thread.join();
  for (int s = 0; s < kStreams; ++s) EXPECT_EQ(ok[s], kPerStream) << "stream " << s;
  EXPECT_EQ(server_->inline_layer_cache().builds(), kDistinctLayers);
}

// One request a batch, so that identical requests run identical computations on every
// device: a GPU's cuBLAS picks its kernels by a batch's row count, and the same request
// batched differently differs there in the last bits.
class InlineLayerUnbatchedTest : public InlineLayerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = InlineLayerTest::Options();
    options.batcher.limits.max_batch_requests = 1;
    return options;
  }
};

TEST_F(InlineLayerUnbatchedTest, ConcurrentIdenticalRequestsBuildOnce) {
  constexpr int kCallers = 8;
  std::mt19937_64 rng(Seed(2303));
  const v1::MultiHeadAttentionRequest request = InlineRequest(rng, 0, 4);
  absl::Barrier* start = new absl::Barrier(kCallers);
  std::vector<std::thread> threads;
  std::vector<std::string> outputs(kCallers);
  for (int c = 0; c < kCallers; ++c) {
    threads.emplace_back([&, c] {
      if (start->Block()) delete start;
      auto answer = client_->MultiHeadAttention(request);
      ASSERT_TRUE(answer.ok()) << answer.status();
      outputs[c] = answer->output().raw_data();
    });
  }
  for (auto& thread : threads) thread.join();
  for (int c = 1; c < kCallers; ++c) EXPECT_EQ(outputs[c], outputs[0]) << "caller " << c;
  EXPECT_EQ(server_->inline_layer_cache().builds(), 1);
  EXPECT_EQ(CounterValue(*server_, "attention_inline_layer_cache_misses_total"), 1);
  EXPECT_EQ(CounterValue(*server_, "attention_inline_layer_cache_hits_total"), kCallers - 1);
  EXPECT_GT(server_->inline_layer_cache().bytes(), 0);
}

TEST_F(InlineLayerTest, ACacheHitIsBitwiseEqualToAFreshBuild) {
  std::mt19937_64 rng(Seed(2304));
  v1::MultiHeadAttentionRequest request = InlineRequest(rng, 1, 5);  // with dropout
  SetInlineWeights(rng, request.mutable_inline_layer());
  auto built = client_->MultiHeadAttention(request);
  auto hit = client_->MultiHeadAttention(request);
  ASSERT_TRUE(built.ok()) << built.status();
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(server_->inline_layer_cache().builds(), 1);
  EXPECT_EQ(server_->inline_layer_cache().hits(), 1);
  EXPECT_EQ(hit->output().raw_data(), built->output().raw_data());
  // A server without the cache builds the layer for every request.
  ServerOptions options = Options();
  options.inline_layer_cache_bytes = 0;
  auto uncached = AttentionServer::Start(options);
  ASSERT_TRUE(uncached.ok()) << uncached.status();
  client::AttentionClient client("127.0.0.1:" + std::to_string((*uncached)->port()));
  auto fresh = client.MultiHeadAttention(request);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->output().raw_data(), hit->output().raw_data());
  EXPECT_EQ((*uncached)->inline_layer_cache().bytes(), 0);
}

TEST_F(InlineLayerTest, DifferentWeightsWithTheSameConfigNeverShareAnEntry) {
  const uint64_t seed = Seed(2305);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  v1::MultiHeadAttentionRequest first = InlineRequest(rng, 0, 3);
  SetInlineWeights(rng, first.mutable_inline_layer());
  // One weight differs in its sign bit (little-endian float32: the top bit of byte 3).
  v1::MultiHeadAttentionRequest second = first;
  std::string& raw = *(*second.mutable_inline_layer()
                            ->mutable_inline_weights()
                            ->mutable_tensors())["out_proj.weight"]
                          .mutable_raw_data();
  raw[3] = static_cast<char>(raw[3] ^ 0x80);
  // Another seed of random init.
  v1::MultiHeadAttentionRequest third = InlineRequest(rng, 0, 3);
  third.mutable_query()->CopyFrom(first.query());
  third.mutable_inline_layer()->mutable_random_init()->set_seed(5000);
  v1::MultiHeadAttentionRequest fourth = third;
  fourth.mutable_inline_layer()->mutable_random_init()->set_seed(5001);
  std::vector<std::string> outputs;
  for (const auto* request : {&first, &second, &third, &fourth}) {
    auto answer = client_->MultiHeadAttention(*request);
    ASSERT_TRUE(answer.ok()) << answer.status();
    outputs.push_back(answer->output().raw_data());
  }
  EXPECT_NE(outputs[0], outputs[1]);
  EXPECT_NE(outputs[2], outputs[3]);
  EXPECT_EQ(server_->inline_layer_cache().builds(), 4);
  EXPECT_EQ(server_->inline_layer_cache().hits(), 0);
}

// A server with one loader thread, a queue of two, and a small max_queued_bytes; the tests hold the
// thread and fill the queue with jobs of their own.
class FullLoaderQueueTest : public InlineLayerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = InlineLayerTest::Options();
    options.max_concurrent_loads = 1;
    options.max_queued_loads = 2;
    options.batcher.max_queued_bytes = 100000;
    return options;
  }

  void TearDown() override {
    if (!release_.HasBeenNotified()) release_.Notify();
    finished_.WaitForNotification();
  }

  // Occupies the only loader thread until the test ends.
  void HoldTheLoader() {
    LoaderJob job;
    job.work = [this] {
      started_.Notify();
      release_.WaitForNotification();
      return absl::OkStatus();
    };
    job.done = [this](const absl::Status&) { finished_.Notify(); };
    ASSERT_TRUE(server_->loader().Submit(std::move(job)).ok());
    started_.WaitForNotification();
  }

  absl::Notification started_, release_, finished_;
};

TEST_F(FullLoaderQueueTest, AQueueFullByLengthRefusesNamingTheFlag) {
  HoldTheLoader();
  absl::Notification waiters_done[2];
  for (absl::Notification& done : waiters_done) {
    LoaderJob waiter;
    waiter.work = [] { return absl::OkStatus(); };
    waiter.done = [&done](const absl::Status&) { done.Notify(); };
    ASSERT_TRUE(server_->loader().Submit(std::move(waiter)).ok());
  }
  std::mt19937_64 rng(Seed(2306));
  auto refused = client_->MultiHeadAttention(InlineRequest(rng, 2, 2));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("are waiting (--max_queued_loads = 2)"),
            std::string::npos)
      << refused.status();
  release_.Notify();
  for (absl::Notification& done : waiters_done) done.WaitForNotification();
  // Room again: the same request waits its turn and is answered.
  EXPECT_TRUE(client_->MultiHeadAttention(InlineRequest(rng, 2, 2)).ok());
}

TEST_F(FullLoaderQueueTest, AQueueFullByBytesRefusesNamingTheFlag) {
  HoldTheLoader();
  // The request's inline weights, over the bytes another waiting request already holds.
  std::mt19937_64 rng(Seed(2307));
  v1::MultiHeadAttentionRequest request = InlineRequest(rng, 0, 2);
  SetInlineWeights(rng, request.mutable_inline_layer());
  absl::Notification waiter_done;
  LoaderJob waiter;
  waiter.work = [] { return absl::OkStatus(); };
  waiter.done = [&](const absl::Status&) { waiter_done.Notify(); };
  waiter.bytes = 100000 - 1000;  // the queue's length (2) is not the bound here
  ASSERT_TRUE(server_->loader().Submit(std::move(waiter)).ok());
  auto refused = client_->MultiHeadAttention(request);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("to wait for a layer build, over the limit of "
                                            "100000 (--max_queued_bytes)"),
            std::string::npos)
      << refused.status();
  release_.Notify();
  waiter_done.WaitForNotification();
}

TEST_F(InlineLayerTest, CachedLayersCountAgainstMaxWeightBytesAndGiveWayToLoads) {
  std::mt19937_64 rng(Seed(2308));
  ASSERT_TRUE(client_->MultiHeadAttention(InlineRequest(rng, 0, 2)).ok());
  const int64_t cached = server_->inline_layer_cache().bytes();
  ASSERT_GT(cached, 0);
  // A second server whose weight budget holds one such layer: the cached one must yield.
  ServerOptions options = Options();
  options.registry.max_weight_bytes = cached + cached / 2;
  auto tight = AttentionServer::Start(options);
  ASSERT_TRUE(tight.ok()) << tight.status();
  client::AttentionClient client("127.0.0.1:" + std::to_string((*tight)->port()));
  ASSERT_TRUE(client.MultiHeadAttention(InlineRequest(rng, 0, 2)).ok());
  EXPECT_EQ((*tight)->inline_layer_cache().bytes(), cached);
  auto loaded = client.LoadLayer(RandomLayerRequest("loaded", kEmbedDim, 9));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*tight)->inline_layer_cache().bytes(), 0);
  // With the budget held by a loaded layer, inline layers are served, just not cached.
  ASSERT_TRUE(client.MultiHeadAttention(InlineRequest(rng, 3, 2)).ok());
  EXPECT_EQ((*tight)->inline_layer_cache().bytes(), 0);
}

}  // namespace
}  // namespace attention::server::testing

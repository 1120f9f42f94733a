// End to end through a real gRPC server on a loopback port: results against the core
// reference, seed 002 numbers, half precision, layer management, concurrency, health.
#include <algorithm>
#include <map>
#include <thread>

#include <grpcpp/client_context.h>

#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

using wire::DecodeFloatTensor;
using wire::EncodeTensor;

constexpr float kTolerance = 1e-4f;  // float32 GEMMs vs the double reference, values ~1

void ExpectNear(const std::vector<float>& actual, const std::vector<float>& expected,
                float tolerance, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_NEAR(actual[i], expected[i], tolerance) << what << " element " << i;
  }
}

// What the core reference computes for a request on `layer`.
core::AttentionResult ReferenceFor(const core::MhaLayer& layer,
                                   const v1::MultiHeadAttentionRequest& request,
                                   core::NeedWeights need, bool causal = false) {
  auto query = DecodeFloatTensor(request.query(), "query");
  EXPECT_TRUE(query.ok()) << query.status();
  core::MhaInput input;
  input.batch = query->shape[0];
  input.q_len = input.kv_len = query->shape[1];
  input.query = query->values;
  input.options.need_weights = need;
  input.options.causal = causal;
  return layer.ForwardReference(input);
}

TEST_F(ServerTest, MultiHeadAttentionMatchesCoreReference) {
  std::mt19937_64 rng(11);
  v1::MultiHeadAttentionRequest request = DemoRequest(rng, 2, 7);
  request.set_request_id("abc");
  request.mutable_options()->set_need_weights(v1::NEED_WEIGHTS_PER_HEAD);
  auto response = client_->MultiHeadAttention(request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->request_id(), "abc");
  EXPECT_EQ(response->layer_version(), 1u);
  auto output = DecodeFloatTensor(response->output(), "output");
  auto weights = DecodeFloatTensor(response->attention_weights(), "weights");
  ASSERT_TRUE(output.ok() && weights.ok());
  EXPECT_EQ(output->shape, (std::vector<int64_t>{2, 7, 768}));
  EXPECT_EQ(weights->shape, (std::vector<int64_t>{2, 12, 7, 7}));
  const core::AttentionResult expected =
      ReferenceFor(*DemoLayer(), request, core::NeedWeights::kPerHead);
  ExpectNear(output->values, expected.output, kTolerance, "output");
  ExpectNear(weights->values, expected.weights, kTolerance, "weights");
}

TEST_F(ServerTest, DropoutIsDeterministicAndMatchesTheReference) {
  std::mt19937_64 rng(14);
  v1::MultiHeadAttentionRequest request = DemoRequest(rng, 2, 6);
  auto* options = request.mutable_options();
  options->set_dropout_p(0.25f);
  options->set_dropout_seed(99);
  options->set_priority(3);
  options->set_need_weights(v1::NEED_WEIGHTS_PER_HEAD);
  auto first = client_->MultiHeadAttention(request);
  auto second = client_->MultiHeadAttention(request);
  ASSERT_TRUE(first.ok() && second.ok()) << first.status() << second.status();
  EXPECT_EQ(first->output().raw_data(), second->output().raw_data());
  // The same keep decisions as the core reference, keyed by (seed, b, h, i, j).
  auto query = DecodeFloatTensor(request.query(), "query");
  core::MhaInput input;
  input.batch = 2;
  input.q_len = input.kv_len = 6;
  input.query = query->values;
  input.options.dropout_p = 0.25f;
  input.options.dropout_seed = 99;
  input.options.need_weights = core::NeedWeights::kPerHead;
  const core::AttentionResult expected = DemoLayer()->ForwardReference(input);
  ExpectNear(DecodeFloatTensor(first->output(), "output")->values, expected.output, kTolerance,
             "output");
  const auto weights = DecodeFloatTensor(first->attention_weights(), "weights")->values;
  ExpectNear(weights, expected.weights, kTolerance, "weights");
  const int64_t dropped = std::count(weights.begin(), weights.end(), 0.0f);
  EXPECT_GT(dropped, 0);  // 2*12*6*6 = 864 weights, about a quarter dropped
  options->set_dropout_seed(100);
  auto reseeded = client_->MultiHeadAttention(request);
  ASSERT_TRUE(reseeded.ok());
  EXPECT_NE(reseeded->output().raw_data(), first->output().raw_data());
}

TEST_F(ServerTest, ScaledDotProductAttentionReproducesSeed002) {
  // Seed 002's naive attention: softmax(X X^T) X, unscaled, printed to 4 decimals.
  const std::vector<float> inputs = {0.43f, 0.15f, 0.89f, 0.55f, 0.87f, 0.66f,
                                     0.57f, 0.85f, 0.64f, 0.22f, 0.58f, 0.33f,
                                     0.77f, 0.25f, 0.10f, 0.05f, 0.80f, 0.55f};
  const std::vector<float> printed_context = {
      0.4421f, 0.5931f, 0.5790f, 0.4419f, 0.6515f, 0.5683f, 0.4431f, 0.6496f, 0.5671f,
      0.4304f, 0.6298f, 0.5510f, 0.4671f, 0.5910f, 0.5266f, 0.4177f, 0.6503f, 0.5645f};
  const std::vector<float> printed_first_row = {0.2098f, 0.2006f, 0.1981f,
                                                0.1242f, 0.1220f, 0.1452f};
  v1::ScaledDotProductAttentionRequest request;
  const std::vector<int64_t> shape = {1, 1, 6, 3};
  for (v1::Tensor* tensor : {request.mutable_query(), request.mutable_key(), request.mutable_value()}) {
    EncodeTensor(inputs, shape, core::DType::kFloat32, tensor);
  }
  request.mutable_options()->set_scale(1.0f);
  request.mutable_options()->set_need_weights(v1::NEED_WEIGHTS_PER_HEAD);
  auto response = client_->ScaledDotProductAttention(request);
  ASSERT_TRUE(response.ok()) << response.status();
  auto output = DecodeFloatTensor(response->output(), "output");
  auto weights = DecodeFloatTensor(response->attention_weights(), "weights");
  ASSERT_TRUE(output.ok() && weights.ok());
  EXPECT_EQ(output->shape, shape);
  ExpectNear(output->values, printed_context, 5e-5f, "context");
  ExpectNear(std::vector<float>(weights->values.begin(), weights->values.begin() + 6),
             printed_first_row, 5e-5f, "weights row 0");
}

TEST_F(ServerTest, HalfPrecisionInAndOut) {
  std::mt19937_64 rng(12);
  v1::MultiHeadAttentionRequest request = DemoRequest(rng, 1, 5);
  const core::AttentionResult expected =
      ReferenceFor(*DemoLayer(), request, core::NeedWeights::kNone);
  auto query = DecodeFloatTensor(request.query(), "query");
  for (auto [wire_type, dtype, tolerance] :
       {std::tuple{v1::FLOAT16, core::DType::kFloat16, 5e-3f},
        std::tuple{v1::BFLOAT16, core::DType::kBFloat16, 4e-2f}}) {
    EncodeTensor(query->values, query->shape, dtype, request.mutable_query());
    auto response = client_->MultiHeadAttention(request);
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_EQ(response->output().dtype(), wire_type);
    EXPECT_EQ(response->output().raw_data().size(), 5u * 768 * 2);
    auto output = DecodeFloatTensor(response->output(), "output");
    ExpectNear(output->values, expected.output, tolerance, v1::DataType_Name(wire_type));
  }
  // output_dtype overrides the query's dtype.
  request.set_output_dtype(v1::FLOAT32);
  auto response = client_->MultiHeadAttention(request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(response->output().dtype(), v1::FLOAT32);
}

// A BFLOAT16 answer is the FLOAT32 answer rounded, bit for bit, on a float32 layer (rounded
// on delivery) and on a bf16 layer (whose output projection writes bf16 into the response).
TEST_F(ServerTest, Bf16AnswersAreTheFloat32AnswersRounded) {
  v1::LoadLayerRequest bf16_layer = RandomLayerRequest("bf16-answers", 64, 31);
  bf16_layer.mutable_spec()->mutable_config()->set_compute_dtype(v1::BFLOAT16);
  ASSERT_TRUE(client_->LoadLayer(bf16_layer).ok());
  std::mt19937_64 rng(32);
  for (const auto& [layer, embed_dim] :
       {std::pair<std::string, int64_t>{kDemoLayerName, kDemoEmbedDim}, {"bf16-answers", 64}}) {
    v1::MultiHeadAttentionRequest request;
    request.set_layer(layer);
    EncodeTensor(RandomValues(rng, 2 * 9 * embed_dim), std::vector<int64_t>{2, 9, embed_dim},
                 core::DType::kFloat32, request.mutable_query());
    request.set_output_dtype(v1::FLOAT32);
    auto float32 = client_->MultiHeadAttention(request);
    request.set_output_dtype(v1::BFLOAT16);
    auto bf16 = client_->MultiHeadAttention(request);
    ASSERT_TRUE(float32.ok() && bf16.ok()) << float32.status() << " " << bf16.status();
    ASSERT_EQ(bf16->output().dtype(), v1::BFLOAT16);
    EXPECT_EQ(bf16->output().raw_data(),
              core::EncodeFloats(DecodeFloatTensor(float32->output(), "output")->values,
                                 core::DType::kBFloat16))
        << layer;
  }
}

TEST_F(ServerTest, FloatDataOutputCarriesTheRawValues) {
  std::mt19937_64 rng(21);
  v1::MultiHeadAttentionRequest request = DemoRequest(rng, 2, 3);
  request.mutable_options()->set_need_weights(v1::NEED_WEIGHTS_AVERAGED);
  auto raw = client_->MultiHeadAttention(request);
  ASSERT_TRUE(raw.ok()) << raw.status();
  request.set_float_data_output(true);
  auto typed = client_->MultiHeadAttention(request);
  ASSERT_TRUE(typed.ok()) << typed.status();
  for (auto [raw_tensor, typed_tensor] :
       {std::pair{&raw->output(), &typed->output()},
        std::pair{&raw->attention_weights(), &typed->attention_weights()}}) {
    EXPECT_TRUE(typed_tensor->raw_data().empty());
    EXPECT_EQ(typed_tensor->dtype(), v1::FLOAT32);
    auto expected = DecodeFloatTensor(*raw_tensor, "raw");
    EXPECT_EQ(std::vector<float>(typed_tensor->float_data().begin(),
                                 typed_tensor->float_data().end()),
              expected->values);
  }
}

// Native-named weights for a tiny layer: E = 4, H = 2, with biases.
v1::LoadLayerRequest TinyLayerRequest(const std::string& name, const core::MhaWeights& weights,
                                      bool fused) {
  v1::LoadLayerRequest request;
  request.set_name(name);
  v1::LayerSpec* spec = request.mutable_spec();
  spec->mutable_config()->set_embed_dim(4);
  spec->mutable_config()->set_num_heads(2);
  auto* tensors = spec->mutable_inline_weights()->mutable_tensors();
  auto put = [tensors](const std::string& tensor_name, const std::vector<float>& values,
                       const std::vector<int64_t>& shape) {
    EncodeTensor(values, shape, core::DType::kFloat32, &(*tensors)[tensor_name]);
  };
  if (fused) {
    std::vector<float> w = weights.q_weight, b = weights.q_bias;
    w.insert(w.end(), weights.k_weight.begin(), weights.k_weight.end());
    w.insert(w.end(), weights.v_weight.begin(), weights.v_weight.end());
    b.insert(b.end(), weights.k_bias.begin(), weights.k_bias.end());
    b.insert(b.end(), weights.v_bias.begin(), weights.v_bias.end());
    put("qkv_proj.weight", w, {12, 4});
    put("qkv_proj.bias", b, {12});
  } else {
    put("q_proj.weight", weights.q_weight, {4, 4});
    put("k_proj.weight", weights.k_weight, {4, 4});
    put("v_proj.weight", weights.v_weight, {4, 4});
    put("q_proj.bias", weights.q_bias, {4});
    put("k_proj.bias", weights.k_bias, {4});
    put("v_proj.bias", weights.v_bias, {4});
  }
  put("out_proj.weight", weights.out_weight, {4, 4});
  put("out_proj.bias", weights.out_bias, {4});
  return request;
}

TEST_F(ServerTest, LoadInlineWeightsFusedAndSeparate) {
  core::MhaConfig config;
  config.embed_dim = 4;
  config.num_heads = 2;
  const core::MhaConfig resolved = *core::MhaConfig::Resolve(config);
  const core::MhaWeights weights = core::MhaWeights::Random(resolved, 77);
  const auto layer = *core::MhaLayer::Create(resolved, weights, std::make_shared<core::CpuBackend>(1));
  std::mt19937_64 rng(13);
  const std::vector<float> query = RandomValues(rng, 3 * 4);
  for (bool fused : {false, true}) {
    const std::string name = fused ? "tiny-fused" : "tiny";
    auto info = client_->LoadLayer(TinyLayerRequest(name, weights, fused));
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->parameter_count(), 4 * 4 * 4 + 4 * 4);
    EXPECT_EQ(info->config().head_dim(), 2);
    v1::MultiHeadAttentionRequest request;
    request.set_layer(name);
    EncodeTensor(query, std::vector<int64_t>{1, 3, 4}, core::DType::kFloat32,
                 request.mutable_query());
    auto response = client_->MultiHeadAttention(request);
    ASSERT_TRUE(response.ok()) << response.status();
    ExpectNear(DecodeFloatTensor(response->output(), "output")->values,
               ReferenceFor(*layer, request, core::NeedWeights::kNone).output, kTolerance, name);
  }
}

TEST_F(ServerTest, ReloadBumpsVersionAndUnloadRemoves) {
  const v1::LoadLayerRequest load = RandomLayerRequest("scratch", 8, 5);
  auto first = client_->LoadLayer(load);
  auto second = client_->LoadLayer(load);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_GT(second->version(), first->version());
  auto layers = client_->ListLayers();
  ASSERT_TRUE(layers.ok());
  ASSERT_EQ(layers->size(), 2u);
  EXPECT_EQ((*layers)[0].name(), kDemoLayerName);
  EXPECT_EQ((*layers)[1].name(), "scratch");
  ASSERT_TRUE(client_->UnloadLayer("scratch").ok());
  EXPECT_EQ(client_->GetLayer("scratch").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->UnloadLayer("scratch").code(), absl::StatusCode::kNotFound);
}

TEST_F(ServerTest, LayerInfoReportsTheBatchingPolicyResolved) {
  v1::LoadLayerRequest load = RandomLayerRequest("tuned", 8, 5);
  load.mutable_batching()->set_max_batch_requests(4);
  load.mutable_batching()->set_max_queue_delay_us(2500);
  load.mutable_batching()->set_queue_timeout_us(300000);
  auto loaded = client_->LoadLayer(load);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const BatchLimits server = Options().batcher.limits;
  for (const v1::LayerInfo& info : {*loaded, *client_->GetLayer("tuned")}) {
    EXPECT_EQ(info.batching().max_batch_requests(), 4);
    EXPECT_EQ(info.batching().max_queue_delay_us(), 2500);
    EXPECT_EQ(info.batching().max_batch_tokens(), server.max_batch_tokens);
    EXPECT_EQ(info.batching().max_queue_requests(), server.max_queue_requests);
    EXPECT_EQ(info.batching().max_queue_tokens(), server.max_queue_tokens);
    EXPECT_EQ(info.batching().queue_timeout_us(), 300000);
  }
  auto demo = client_->GetLayer(kDemoLayerName);  // loaded without a policy: the server's
  ASSERT_TRUE(demo.ok());
  EXPECT_EQ(demo->batching().max_batch_requests(), server.max_batch_requests);
  EXPECT_EQ(demo->batching().max_queue_delay_us(), absl::ToInt64Microseconds(server.max_queue_delay));
  EXPECT_TRUE(demo->batching().has_queue_timeout_us());
  EXPECT_EQ(demo->batching().queue_timeout_us(), 0);  // no limit
  // The layer answers through its own queue.
  std::mt19937_64 rng(11);
  v1::MultiHeadAttentionRequest request;
  request.set_layer("tuned");
  wire::EncodeTensor(RandomValues(rng, 3 * 8), std::vector<int64_t>{1, 3, 8},
                     core::DType::kFloat32, request.mutable_query());
  EXPECT_TRUE(client_->MultiHeadAttention(request).ok());
}

TEST_F(ServerTest, ConcurrentCallersGetTheirOwnAnswers) {
  // Many callers at once, so the batcher packs requests of different shapes and options
  // together; interleaved bad requests must not disturb anyone else's result.
  const uint64_t seed = 2026;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto layer = DemoLayer();
  constexpr int kThreads = 6, kRequestsPerThread = 6;
  std::vector<std::thread> threads;
  std::atomic<int> checked{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      for (int r = 0; r < kRequestsPerThread; ++r) {
        const int64_t batch = 1 + rng() % 2, tokens = 1 + rng() % 20;
        v1::MultiHeadAttentionRequest request = DemoRequest(rng, batch, tokens);
        const bool causal = rng() % 2;
        request.mutable_options()->set_causal(causal);
        request.set_request_id(std::to_string(t) + "/" + std::to_string(r));
        if (r % 3 == 2) {  // a malformed neighbour in the same stream of work
          v1::MultiHeadAttentionRequest bad = request;
          bad.mutable_query()->mutable_raw_data()->pop_back();
          EXPECT_EQ(client_->MultiHeadAttention(bad).status().code(),
                    absl::StatusCode::kInvalidArgument);
        }
        auto response = client_->MultiHeadAttention(request);
        ASSERT_TRUE(response.ok()) << response.status();
        EXPECT_EQ(response->request_id(), request.request_id());
        const auto expected = ReferenceFor(*layer, request, core::NeedWeights::kNone, causal);
        ExpectNear(DecodeFloatTensor(response->output(), "output")->values, expected.output,
                   kTolerance, request.request_id());
        ++checked;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(checked.load(), kThreads * kRequestsPerThread);
}

TEST_F(ServerTest, HealthReportsServing) {
  for (const std::string service : {"", "attention.v1.AttentionService"}) {
    auto serving = client_->IsServing(service);
    ASSERT_TRUE(serving.ok()) << serving.status();
    EXPECT_TRUE(*serving) << service;
  }
  EXPECT_EQ(client_->IsServing("no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ServerTest, StreamAnswersEveryRequestByIdIncludingErrors) {
  // More requests than a stream may hold pending, so reading pauses and resumes; a writer
  // thread and the reader run at once, as a real client would.
  constexpr int kRequests = 100;
  const auto layer = DemoLayer();
  std::mt19937_64 rng(31);
  std::vector<v1::MultiHeadAttentionRequest> requests;
  for (int r = 0; r < kRequests; ++r) {
    requests.push_back(DemoRequest(rng, 1, 1 + r % 9));
    requests.back().set_request_id("r" + std::to_string(r));
    if (r % 10 == 7) requests.back().set_layer("missing");
    // The stream's per-request queue bound: a generous one is met, a negative one refused.
    if (r % 10 == 3) requests.back().mutable_options()->set_queue_timeout_us(60'000'000);
    if (r % 10 == 5) requests.back().mutable_options()->set_queue_timeout_us(-1);
  }
  auto stub = v1::AttentionService::NewStub(client_->channel());
  grpc::ClientContext context;
  auto stream = stub->MultiHeadAttentionStream(&context);
  std::thread writer([&] {
    for (const auto& request : requests) ASSERT_TRUE(stream->Write(request));
    stream->WritesDone();
  });
  std::map<std::string, v1::MultiHeadAttentionStreamResponse> answers;
  for (v1::MultiHeadAttentionStreamResponse answer; stream->Read(&answer);) {
    answers[answer.request_id()] = answer;
  }
  writer.join();
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_EQ(answers.size(), static_cast<size_t>(kRequests));
  for (const auto& request : requests) {
    const auto& answer = answers[request.request_id()];
    if (request.layer() == "missing") {
      EXPECT_EQ(answer.error_code(), static_cast<int>(absl::StatusCode::kNotFound));
      EXPECT_NE(answer.error_message().find("\"missing\" is not loaded"), std::string::npos);
      continue;
    }
    if (request.options().queue_timeout_us() < 0) {
      EXPECT_EQ(answer.error_code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
      EXPECT_NE(answer.error_message().find("options.queue_timeout_us = -1 must be >= 0"),
                std::string::npos)
          << answer.error_message();
      continue;
    }
    ASSERT_EQ(answer.error_code(), 0) << answer.error_message();
    ExpectNear(DecodeFloatTensor(answer.response().output(), "output")->values,
               ReferenceFor(*layer, request, core::NeedWeights::kNone).output, kTolerance,
               request.request_id());
  }
}

TEST_F(ServerTest, EmptyStreamFinishesOk) {
  auto stub = v1::AttentionService::NewStub(client_->channel());
  grpc::ClientContext context;
  auto stream = stub->MultiHeadAttentionStream(&context);
  stream->WritesDone();
  v1::MultiHeadAttentionStreamResponse answer;
  EXPECT_FALSE(stream->Read(&answer));
  EXPECT_TRUE(stream->Finish().ok());
}

}  // namespace
}  // namespace attention::server::testing

namespace attention::server::testing {
namespace {

class DrainTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    // Long enough for the checks below on a loaded machine; the test waits it out once.
    options.drain_delay = absl::Seconds(2);
    return options;
  }
};

TEST_F(DrainTest, HealthAnswersNotServingWhileStillAcceptingCalls) {
  std::thread stopper([this] { server_->Shutdown(absl::Seconds(1)); });
  // Poll until the drain is visible; Shutdown sleeps drain_delay before closing the port.
  absl::StatusOr<bool> serving = true;
  const absl::Time give_up = absl::Now() + absl::Seconds(2);
  while (serving.ok() && *serving && absl::Now() < give_up) serving = client_->IsServing();
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_FALSE(*serving);
  std::mt19937_64 rng(5);
  EXPECT_TRUE(client_->MultiHeadAttention(DemoRequest(rng, 1, 3)).ok())
      << "calls are still served during the drain delay";
  stopper.join();
  EXPECT_FALSE(client_->IsServing("", absl::Seconds(1)).ok()) << "the listener is closed";
}

}  // namespace
}  // namespace attention::server::testing

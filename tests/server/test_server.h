// An in-process server on a free loopback port plus a client connected to it.
#ifndef ATTENTION_TESTS_SERVER_TEST_SERVER_H_
#define ATTENTION_TESTS_SERVER_TEST_SERVER_H_

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "client/attention_client.h"
#include "gtest/gtest.h"
#include "server/app/server.h"
#include "tensor_codec.h"

namespace attention::server::testing {

class ServerTest : public ::testing::Test {
 protected:
  // Metrics are off by default: stopping the HTTP exposer costs about 2 s per server.
  virtual ServerOptions Options() {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = "";
    options.compute_threads = 2;
    options.demo_layer = true;  // most tests send requests to it
    options.sessions.kv_cache_bytes = 16 << 20;  // small under the sanitizers
    return options;
  }

  void SetUp() override {
    auto started = AttentionServer::Start(Options());
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(*started);
    client_ = std::make_unique<client::AttentionClient>("127.0.0.1:" +
                                                        std::to_string(server_->port()));
  }

  std::shared_ptr<const core::MhaLayer> DemoLayer() {
    return (*server_->registry().Get(kDemoLayerName))->layer;
  }

  std::unique_ptr<AttentionServer> server_;
  std::unique_ptr<client::AttentionClient> client_;
};

inline std::vector<float> RandomValues(std::mt19937_64& rng, size_t count) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = uniform(rng);
  return values;
}

// Loads a layer of `embed_dim` with two heads, seeded random weights.
inline v1::LoadLayerRequest RandomLayerRequest(const std::string& name, int64_t embed_dim,
                                               uint64_t seed) {
  v1::LoadLayerRequest request;
  request.set_name(name);
  request.mutable_spec()->mutable_config()->set_embed_dim(embed_dim);
  request.mutable_spec()->mutable_config()->set_num_heads(2);
  request.mutable_spec()->mutable_random_init()->set_seed(seed);
  return request;
}

// A valid request for the demo layer: query [batch, tokens, 768] of random values.
inline v1::MultiHeadAttentionRequest DemoRequest(std::mt19937_64& rng, int64_t batch,
                                                 int64_t tokens) {
  v1::MultiHeadAttentionRequest request;
  request.set_layer(kDemoLayerName);
  const std::vector<int64_t> shape = {batch, tokens, kDemoEmbedDim};
  wire::EncodeTensor(RandomValues(rng, batch * tokens * kDemoEmbedDim), shape,
                     core::DType::kFloat32, request.mutable_query());
  return request;
}

// A one-layer session over one KV head of 8 dims, shared by `num_heads` query heads, with
// `reserved_tokens` reserved: the smallest session a test of the session calls needs.
inline v1::CreateSessionRequest OneLayerSessionRequest(int64_t num_heads, int64_t reserved_tokens) {
  v1::CreateSessionRequest request;
  v1::SessionConfig& config = *request.mutable_config();
  config.set_num_layers(1);
  config.set_num_heads(num_heads);
  config.set_num_kv_heads(1);
  config.set_head_dim(8);
  request.set_reserved_tokens(reserved_tokens);
  return request;
}

}  // namespace attention::server::testing

#endif  // ATTENTION_TESTS_SERVER_TEST_SERVER_H_

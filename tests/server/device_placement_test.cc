// Per-layer device placement through the API: the device reported, the errors for devices
// that are not there, and (on a GPU machine) a layer on the GPU answering as on the CPU.
#include <cmath>

#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

TEST_F(ServerTest, LayersReportTheDeviceTheyComputeOn) {
  auto demo = client_->GetLayer(kDemoLayerName);
  ASSERT_TRUE(demo.ok()) << demo.status();
  EXPECT_EQ(demo->device(), server_->default_backend().name());

  v1::LoadLayerRequest request = RandomLayerRequest("on-cpu", 8, 1);
  request.set_device("cpu");
  auto loaded = client_->LoadLayer(request);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->device(), "cpu");
  EXPECT_EQ(client_->GetLayer("on-cpu")->device(), "cpu");
}

TEST_F(ServerTest, UnknownOrAbsentDevicesAreRefusedAndNothingIsLoaded) {
  v1::LoadLayerRequest request = RandomLayerRequest("nowhere", 8, 1);
  request.set_device("tpu:0");
  absl::Status status = client_->LoadLayer(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_EQ(status.message(), "device: device \"tpu:0\" is not one of auto, cpu, cuda, cuda:N");
  request.set_device("cuda:64");  // no machine here has 65 GPUs
  status = client_->LoadLayer(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_NE(status.message().find("device: device cuda:64 is not available: "), std::string::npos)
      << status;
  EXPECT_EQ(client_->GetLayer("nowhere").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ServerTest, LayerOnTheGpuAnswersAsOnTheCpu) {
  core::Devices probe(1);
  std::string why_none;
  if (probe.GpuCount(&why_none) == 0) GTEST_SKIP() << "no GPU: " << why_none;
  const uint64_t seed = 41;
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const char* device : {"cpu", "cuda"}) {
    v1::LoadLayerRequest request = RandomLayerRequest(std::string("l-") + device, 64, seed);
    request.mutable_spec()->mutable_config()->set_num_heads(4);
    request.set_device(device);
    ASSERT_TRUE(client_->LoadLayer(request).ok()) << device;
  }
  std::mt19937_64 rng(seed);
  v1::MultiHeadAttentionRequest request;
  wire::EncodeTensor(RandomValues(rng, 3 * 37 * 64), std::vector<int64_t>{3, 37, 64},
                     core::DType::kFloat32, request.mutable_query());
  request.mutable_options()->set_causal(true);
  request.mutable_options()->set_need_weights(v1::NEED_WEIGHTS_PER_HEAD);
  request.mutable_options()->set_dropout_p(0.25f);
  request.mutable_options()->set_dropout_seed(9);
  request.mutable_options()->add_key_lengths(37);
  request.mutable_options()->add_key_lengths(20);
  request.mutable_options()->add_key_lengths(0);  // fully masked: zeros on both
  std::vector<std::vector<float>> outputs, weights;
  for (const char* layer : {"l-cpu", "l-cuda"}) {
    request.set_layer(layer);
    auto response = client_->MultiHeadAttention(request);
    ASSERT_TRUE(response.ok()) << layer << ": " << response.status();
    outputs.push_back(wire::DecodeFloatTensor(response->output(), "output")->values);
    weights.push_back(wire::DecodeFloatTensor(response->attention_weights(), "weights")->values);
  }
  ASSERT_EQ(outputs[0].size(), outputs[1].size());
  for (size_t e = 0; e < outputs[0].size(); ++e) {
    ASSERT_NEAR(outputs[1][e], outputs[0][e], 1e-4) << "output " << e;
  }
  ASSERT_EQ(weights[0].size(), weights[1].size());
  for (size_t e = 0; e < weights[0].size(); ++e) {
    ASSERT_NEAR(weights[1][e], weights[0][e], 1e-5) << "weight " << e;
  }
}

}  // namespace
}  // namespace attention::server::testing

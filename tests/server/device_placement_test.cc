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

// A device that only holds weights: enough for the registry's per-device budget.
class NamedDevice final : public core::Backend {
 public:
  explicit NamedDevice(std::string name) : name_(std::move(name)) {}
  const std::string& name() const override { return name_; }
  absl::Status Supports(const core::MhaConfig&, const core::AttentionOptions&) const override {
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<core::PreparedLayer>> Prepare(
      const core::MhaConfig& config, const core::MhaWeightsView&) const override {
    return std::make_unique<Prepared>(config.ParameterCount() * 4);
  }
  absl::StatusOr<core::AttentionResult> ScaledDotProductAttention(
      const core::SdpaInput&) const override {
    return absl::UnimplementedError("weights only");
  }

 private:
  struct Prepared final : core::PreparedLayer {
    explicit Prepared(int64_t bytes) : bytes(bytes) {}
    absl::StatusOr<std::vector<core::AttentionResult>> ForwardBatch(
        absl::Span<const core::MhaInput* const>) const override {
      return absl::UnimplementedError("weights only");
    }
    int64_t DeviceWeightBytes() const override { return bytes; }
    const int64_t bytes;
  };
  const std::string name_;
};

TEST(DeviceBudgetTest, EachDeviceCountsOnlyItsOwnLayers) {
  core::MhaConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  const core::MhaConfig resolved = *core::MhaConfig::Resolve(config);
  const int64_t layer_bytes = resolved.ParameterCount() * 4;  // 1152
  auto on = [&](const std::string& device) {
    return *core::MhaLayer::Create(resolved, core::MhaWeights::Random(resolved, 1),
                                   std::make_shared<NamedDevice>(device));
  };
  LayerRegistry registry;
  LayerRegistryOptions options;
  options.max_device_weight_bytes = layer_bytes;  // one layer per GPU
  ASSERT_TRUE(registry.Configure(options).ok());
  ASSERT_TRUE(registry.Publish("a", on("cuda:0")).ok());
  ASSERT_TRUE(registry.Publish("b", on("cuda:1")).ok());  // another device: its own budget
  ASSERT_TRUE(registry.Publish("c", on("cpu")).ok());     // the host has no device budget
  ASSERT_TRUE(registry.Publish("a", on("cuda:0")).ok());  // replacing does not count twice
  const absl::Status status = registry.Publish("d", on("cuda:0")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(),
            "layer \"d\" needs 1152 weight bytes on cuda:0 but only 0 of "
            "max_device_weight_bytes = 1152 are free there (1152 in use by 1 other layer(s)); "
            "unload a layer or raise --max_device_weight_bytes");
  EXPECT_EQ(registry.CheckBudget("d", layer_bytes, layer_bytes, "cuda:2"), absl::OkStatus());
  options.max_device_weight_bytes = -1;
  EXPECT_EQ(options.Validate().message(), "max_device_weight_bytes = -1 must be >= 0 (0 = unlimited)");
}

TEST(DeviceBudgetTest, HostBudgetNamesThePackedCopyOnlyForCpuLayers) {
  LayerRegistry registry;
  LayerRegistryOptions options;
  options.max_weight_bytes = 1000;
  ASSERT_TRUE(registry.Configure(options).ok());
  EXPECT_EQ(registry.CheckBudget("g", 1152, 1152, "cuda:0").message(),
            "layer \"g\" needs 1152 bytes of host memory for its weights but only 1000 of "
            "max_weight_bytes = 1000 are free (0 in use by 0 other layer(s)); unload a layer "
            "or raise --max_weight_bytes");
  EXPECT_EQ(registry.CheckBudget("c", 2304, 1152, "cpu").message(),
            "layer \"c\" needs 2304 bytes of host memory for its weights (with the CPU's "
            "packed copy) but only 1000 of max_weight_bytes = 1000 are free (0 in use by 0 "
            "other layer(s)); unload a layer or raise --max_weight_bytes");
}

}  // namespace
}  // namespace attention::server::testing

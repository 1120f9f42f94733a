#include "core/mha_layer.h"

#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "tests/core/fidelity.h"
#include "tests/core/random_options.h"
#include "tests/core/test_backends.h"

namespace attention::core {
namespace {

using testing::Describe;
using testing::FidelityStats;
using testing::RandomFloats;
using testing::RandomOptions;
using testing::TestSeed;
using testing::CpuForTests;

// Runs on every backend compiled in (see test_backends.h).
class MhaBackendTest : public testing::BackendTest {};

TEST(MhaConfigTest, ResolvesDefaults) {
  MhaConfig config;
  config.embed_dim = 768;
  config.num_heads = 12;
  auto resolved = MhaConfig::Resolve(config);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  EXPECT_EQ(resolved->head_dim, 64);
  EXPECT_EQ(resolved->v_head_dim, 64);
  EXPECT_EQ(resolved->num_kv_heads, 12);
  EXPECT_EQ(resolved->output_dim, 768);
  EXPECT_EQ(resolved->ParameterCount(), 4 * 768 * 768 + 4 * 768);
}

TEST(MhaConfigTest, RejectsImpossibleConfigs) {
  MhaConfig config;
  config.embed_dim = 10;
  config.num_heads = 3;
  EXPECT_EQ(MhaConfig::Resolve(config).status().message(),
            "config.num_heads = 3 does not divide config.embed_dim = 10 (set config.head_dim to "
            "choose the head size explicitly)");
  config.num_heads = 2;
  config.num_kv_heads = 3;
  EXPECT_EQ(MhaConfig::Resolve(config).status().message(),
            "config.num_kv_heads = 3 must be >= 1 and divide config.num_heads = 2");
  config.num_kv_heads = 0;
  config.rope_theta = 10000;
  config.head_dim = 3;
  EXPECT_EQ(MhaConfig::Resolve(config).status().message(),
            "config.head_dim = 3 must be even when config.rope_theta is set");
  config = {};
  config.embed_dim = 0;
  config.num_heads = 1;
  EXPECT_EQ(MhaConfig::Resolve(config).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MhaLayerTest, ResolveRejectsBadRopeScalingAndWindows) {
  MhaConfig config;
  config.embed_dim = 16;
  config.num_heads = 2;
  config.rope_scaling.type = RopeScaling::kLinear;
  config.rope_scaling.factor = 2.0;
  EXPECT_EQ(MhaConfig::Resolve(config).status().message(),
            "config.rope_scaling needs config.rope_theta > 0");
  config.rope_theta = 10000;
  EXPECT_TRUE(MhaConfig::Resolve(config).ok());
  config.rope_scaling.factor = 0;
  EXPECT_EQ(MhaConfig::Resolve(config).status().message(),
            "config.rope_scaling.factor = 0 must be finite and > 0");
  config.rope_scaling.factor = 8;
  config.rope_scaling.type = RopeScaling::kLlama3;
  EXPECT_EQ(MhaConfig::Resolve(config).status().message(),
            "config.rope_scaling.original_max_position_embeddings = 0 must be >= 1");
  config.rope_scaling.original_max_positions = 8192;
  config.rope_scaling.low_freq_factor = 4;
  config.rope_scaling.high_freq_factor = 1;
  EXPECT_EQ(MhaConfig::Resolve(config).status().message(),
            "config.rope_scaling.low_freq_factor = 4 and high_freq_factor = 1 must satisfy "
            "0 < low_freq_factor < high_freq_factor");
  config.rope_scaling.type = RopeScaling::kDynamic;
  config.head_dim = 2;
  EXPECT_EQ(MhaConfig::Resolve(config).status().message(),
            "config.head_dim = 2 must be > 2 for dynamic rope scaling");
  config = {};
  config.embed_dim = 16;
  config.num_heads = 2;
  config.sliding_window = 4;
  EXPECT_EQ(MhaConfig::Resolve(config).status().message(),
            "config.sliding_window = 4 needs config.always_causal (the window applies with "
            "causal)");
  config.sliding_window = -1;
  EXPECT_EQ(MhaConfig::Resolve(config).status().message(),
            "config.sliding_window = -1 must be >= 0");
  config.sliding_window = 4;
  config.always_causal = true;
  EXPECT_TRUE(MhaConfig::Resolve(config).ok());
}

TEST(MhaLayerTest, CreateRejectsMisShapedWeights) {
  MhaConfig config;
  config.embed_dim = 4;
  config.num_heads = 2;
  const MhaConfig resolved = *MhaConfig::Resolve(config);
  MhaWeights weights = MhaWeights::Random(resolved, 1);
  weights.k_weight.pop_back();
  EXPECT_EQ(MhaLayer::Create(resolved, weights, CpuForTests()).status().message(),
            "weight k_proj.weight has 15 elements; expected shape [4, 4]");
}

TEST(MhaLayerTest, RandomInitIsSeededAndBounded) {
  MhaConfig config;
  config.embed_dim = 16;
  config.num_heads = 4;
  const MhaConfig resolved = *MhaConfig::Resolve(config);
  const MhaWeights a = MhaWeights::Random(resolved, 42), b = MhaWeights::Random(resolved, 42),
                   c = MhaWeights::Random(resolved, 43);
  EXPECT_EQ(a.q_weight, b.q_weight);
  EXPECT_NE(a.q_weight, c.q_weight);
  EXPECT_NE(a.q_weight, a.k_weight);
  for (float w : a.out_weight) EXPECT_LE(std::abs(w), 0.25f);
}

TEST_P(MhaBackendTest, BatchedForwardMatchesReferenceOnRandomConfigs) {
  const uint64_t seed = TestSeed(1234);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  auto uniform = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  auto coin = [&rng](double p) { return std::bernoulli_distribution(p)(rng); };
  FidelityStats outputs("MHA packed batches output (" + GetParam() + ")"),
      weights("MHA packed batches weights (" + GetParam() + ")");
  for (int trial = 0; trial < 60 && !HasFailure(); ++trial) {
    MhaConfig config;
    config.num_kv_heads = uniform(1, 3);
    config.num_heads = config.num_kv_heads * uniform(1, 3);
    config.head_dim = 2 * uniform(1, 6);
    config.v_head_dim = coin(0.5) ? 0 : uniform(1, 9);
    config.embed_dim = uniform(1, 19);
    config.kdim = coin(0.5) ? 0 : uniform(1, 11);
    config.vdim = coin(0.5) ? 0 : uniform(1, 11);
    config.qkv_bias = coin(0.5);
    config.output_bias = coin(0.5);
    config.output_projection = coin(0.8);
    if (config.output_projection && coin(0.5)) config.output_dim = uniform(1, 13);
    config.rope_theta = coin(0.3) ? 10000.0 : 0.0;
    config.always_causal = coin(0.1);
    if (config.rope_theta > 0.0 && coin(0.5)) {
      // Short contexts, so that 70-token requests cross them.
      config.rope_scaling.type = static_cast<int>(uniform(RopeScaling::kLinear, RopeScaling::kLlama3));
      config.rope_scaling.factor = 1.5 + uniform(0, 6);
      config.rope_scaling.low_freq_factor = 1.0;
      config.rope_scaling.high_freq_factor = 4.0;
      config.rope_scaling.original_max_positions = uniform(4, 40);
      if (config.head_dim == 2) config.head_dim = 4;  // dynamic needs dk > 2
    }
    if (config.always_causal && coin(0.6)) config.sliding_window = uniform(1, 20);
    auto resolved = MhaConfig::Resolve(config);
    ASSERT_TRUE(resolved.ok()) << resolved.status();
    auto layer = MhaLayer::Create(*resolved, MhaWeights::Random(*resolved, rng()), backend_);
    ASSERT_TRUE(layer.ok()) << layer.status();
    const MhaConfig& c = (*layer)->config();
    const bool can_self_attend = c.kdim == c.embed_dim && c.vdim == c.embed_dim;
    // Several requests of different shapes packed into one batch.
    const int count = static_cast<int>(uniform(1, 4));
    std::vector<std::vector<float>> storage;
    std::vector<MhaInput> inputs(count);
    for (MhaInput& in : inputs) {
      in.batch = uniform(1, 3);
      in.q_len = uniform(1, 70);
      const bool cross = !can_self_attend || coin(0.3);
      in.kv_len = cross ? uniform(1, 70) : in.q_len;
      storage.push_back(RandomFloats(rng, in.batch * in.q_len * c.embed_dim));
      in.query = storage.back();
      if (cross) {
        storage.push_back(RandomFloats(rng, in.batch * in.kv_len * c.kdim));
        in.key = storage.back();
        storage.push_back(RandomFloats(rng, in.batch * in.kv_len * c.vdim));
        in.value = storage.back();
      }
      in.options = RandomOptions(rng, {in.batch, c.num_heads, c.num_kv_heads, in.q_len,
                                       in.kv_len, c.head_dim, c.v_head_dim});
      ASSERT_TRUE((*layer)->ValidateInput(in).ok()) << (*layer)->ValidateInput(in);
    }
    std::vector<const MhaInput*> pointers;
    for (const MhaInput& in : inputs) pointers.push_back(&in);
    const absl::StatusOr<std::vector<AttentionResult>> forward = (*layer)->ForwardBatch(pointers);
    ASSERT_TRUE(forward.ok()) << forward.status();
    const std::vector<AttentionResult>& actual = *forward;
    for (int n = 0; n < count; ++n) {
      const std::string what =
          "trial " + std::to_string(trial) + " input " + std::to_string(n) + ": E=" +
          std::to_string(c.embed_dim) + " kdim=" + std::to_string(c.kdim) +
          " vdim=" + std::to_string(c.vdim) + " out=" + std::to_string(c.output_dim) +
          " rope=" + std::to_string(c.rope_theta) + " scaling=" +
          std::to_string(c.rope_scaling.type) + " window=" + std::to_string(c.sliding_window) +
          " " +
          Describe({inputs[n].batch, c.num_heads, c.num_kv_heads, inputs[n].q_len,
                    inputs[n].kv_len, c.head_dim, c.v_head_dim},
                   inputs[n].options);
      const TextbookResult<float> textbook = (*layer)->ForwardTextbook<float>(inputs[n]);
      const TextbookResult<double> oracle = (*layer)->ForwardTextbook<double>(inputs[n]);
      EXPECT_TRUE(outputs.Check(actual[n].output, textbook.output, oracle.output))
          << what << " output";
      EXPECT_TRUE(weights.Check(actual[n].weights, textbook.weights, oracle.weights))
          << what << " weights";
    }
  }
}

TEST_P(MhaBackendTest, HalfInputsMatchTheirFloatDecoding) {
  // 16-bit inputs as the wire sends them (converted on the device by backends that can,
  // decoded on the host otherwise) give exactly what their float32 values give.
  const uint64_t seed = TestSeed(99);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  MhaConfig config;
  config.embed_dim = 24;
  config.num_heads = 3;
  config.kdim = 10;
  config.vdim = 6;
  const MhaConfig resolved = *MhaConfig::Resolve(config);
  auto layer = *MhaLayer::Create(resolved, MhaWeights::Random(resolved, rng()), backend_);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    auto bits_of = [&](int64_t count) {
      std::vector<uint16_t> bits(count);
      for (uint16_t& b : bits) {
        const float v = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
        b = dtype == DType::kFloat16 ? FloatToHalf(v) : FloatToBFloat16(v);
      }
      return bits;
    };
    const std::vector<uint16_t> q = bits_of(2 * 5 * 24), k = bits_of(2 * 7 * 10),
                                v = bits_of(2 * 7 * 6);
    MhaInput half;
    half.batch = 2;
    half.q_len = 5;
    half.kv_len = 7;
    half.half_dtype = dtype;
    half.query_half = q;
    half.key_half = k;
    half.value_half = v;
    half.options.causal = true;
    ASSERT_TRUE(layer->ValidateInput(half).ok()) << layer->ValidateInput(half);
    std::deque<std::vector<float>> storage;
    const MhaInput decoded = WithFloatInputs(half, &storage);
    ASSERT_EQ(decoded.query.size(), q.size());
    EXPECT_EQ(decoded.query[3], dtype == DType::kFloat16 ? HalfToFloat(q[3]) : BFloat16ToFloat(q[3]));
    const MhaInput* one_half[] = {&half};
    const MhaInput* one_float[] = {&decoded};
    auto from_half = layer->ForwardBatch(one_half);
    auto from_float = layer->ForwardBatch(one_float);
    ASSERT_TRUE(from_half.ok() && from_float.ok());
    EXPECT_EQ((*from_half)[0].output, (*from_float)[0].output) << DTypeName(dtype);
  }
}

TEST_P(MhaBackendTest, OutputDestinationHoldsWhatTheResultWouldHold) {
  // The server computes answers straight into the response: a lone input (with and without
  // an output projection) and a batch where only some inputs give a destination.
  const uint64_t seed = TestSeed(7);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  for (const bool output_projection : {true, false}) {
    MhaConfig config;
    config.embed_dim = 16;
    config.num_heads = 2;
    config.output_projection = output_projection;
    const MhaConfig resolved = *MhaConfig::Resolve(config);
    auto layer = *MhaLayer::Create(resolved, MhaWeights::Random(resolved, rng()), backend_);
    std::vector<std::vector<float>> queries;
    std::vector<MhaInput> inputs(3);
    for (MhaInput& in : inputs) {
      in.batch = 2;
      in.q_len = in.kv_len = static_cast<int64_t>(queries.size()) + 3;
      queries.push_back(RandomFloats(rng, in.batch * in.q_len * resolved.embed_dim));
      in.query = queries.back();
    }
    const MhaInput* lone[] = {&inputs[0]};
    const auto plain = layer->ForwardBatch(lone);  // without a destination
    ASSERT_TRUE(plain.ok()) << plain.status();
    std::vector<std::vector<float>> destinations;
    for (const MhaInput& in : inputs) {
      destinations.emplace_back(in.batch * in.q_len * resolved.output_dim, -1.0f);
    }
    // Alone, into its destination.
    inputs[0].output_destination = absl::MakeSpan(destinations[0]);
    ASSERT_TRUE(layer->ValidateInput(inputs[0]).ok()) << layer->ValidateInput(inputs[0]);
    const auto alone = layer->ForwardBatch(lone);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_TRUE((*alone)[0].output.empty());
    EXPECT_EQ(destinations[0], (*plain)[0].output) << "projection " << output_projection;
    // Packed with others: inputs 0 and 2 into destinations, input 1 into its result, against
    // the same packed batch without destinations (cuBLAS picks its GEMM kernel by shape, so a
    // row's rounding may depend on the rows packed around it).
    inputs[0].output_destination = {};
    const MhaInput* packed[] = {&inputs[0], &inputs[1], &inputs[2]};
    const auto packed_plain = layer->ForwardBatch(packed);
    ASSERT_TRUE(packed_plain.ok()) << packed_plain.status();
    std::fill(destinations[0].begin(), destinations[0].end(), -1.0f);
    inputs[0].output_destination = absl::MakeSpan(destinations[0]);
    inputs[2].output_destination = absl::MakeSpan(destinations[2]);
    const auto batch = layer->ForwardBatch(packed);
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_EQ(destinations[0], (*packed_plain)[0].output) << "projection " << output_projection;
    EXPECT_EQ((*batch)[1].output, (*packed_plain)[1].output) << "projection " << output_projection;
    EXPECT_EQ(destinations[2], (*packed_plain)[2].output) << "projection " << output_projection;
    EXPECT_TRUE((*batch)[0].output.empty() && (*batch)[2].output.empty());
  }
}

TEST(MhaLayerTest, ValidateInputNamesShapes) {
  MhaConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  config.kdim = 3;
  config.vdim = 3;
  const MhaConfig resolved = *MhaConfig::Resolve(config);
  auto layer = *MhaLayer::Create(resolved, MhaWeights::Random(resolved, 1), CpuForTests());
  std::vector<float> query(2 * 4 * 8), key(2 * 5 * 4), value(2 * 5 * 3);
  MhaInput in;
  in.batch = 2;
  in.q_len = 4;
  in.kv_len = 5;
  in.query = query;
  in.key = key;
  in.value = value;
  EXPECT_EQ(layer->ValidateInput(in).message(),
            "key has 40 values; expected [B, Nk, kdim] = [2, 5, 3]");
  key.resize(2 * 5 * 3);
  in.key = key;
  std::vector<float> destination(2 * 4 * 8 - 1);
  in.output_destination = absl::MakeSpan(destination);
  EXPECT_EQ(layer->ValidateInput(in).message(),
            "output_destination has 63 values; expected [B, Nq, output_dim] = [2, 4, 8]");
  std::vector<uint16_t> bf16_destination(2 * 4 * 8 + 1);
  in.output_destination_bf16 = absl::MakeSpan(bf16_destination);
  EXPECT_EQ(layer->ValidateInput(in).message(),
            "output_destination and output_destination_bf16 are both set; give at most one");
  in.output_destination = {};
  EXPECT_EQ(layer->ValidateInput(in).message(),
            "output_destination_bf16 has 65 values; expected [B, Nq, output_dim] = [2, 4, 8]");
}

INSTANTIATE_TEST_SUITE_P(Devices, MhaBackendTest, ::testing::ValuesIn(testing::CompiledDevices()),
                         testing::DeviceTestName);

}  // namespace
}  // namespace attention::core

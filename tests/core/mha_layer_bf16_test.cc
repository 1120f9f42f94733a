// BFLOAT16 layers (MhaConfig::compute_dtype) on the CPU backend, with its AVX512-BF16 kernel
// and with the float32 fallback of hosts without bf16 instructions: fidelity by issue 26's
// rule against the same computation in bf16 (MhaLayer::ForwardBf16Textbook, PyTorch's
// stages), the memory held, and bf16 inputs taken as sent.
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/cpu/batch_groups.h"
#include "core/cpu/cpu_backend.h"
#include "core/mha_layer.h"
#include "gtest/gtest.h"
#include "tests/core/fidelity.h"
#include "tests/core/random_options.h"
#include "tests/core/test_backends.h"

namespace attention::core {
namespace {

using testing::FidelityStats;
using testing::RandomFloats;
using testing::RandomOptions;
using testing::TestSeed;
using testing::TrialsForThisBuild;

// How a bf16 layer multiplies: attention's products and the projections' kernel, and
// (both float32) whether it runs as a float32 layer, as the server runs it, or on the bf16
// layer's own path (grouped batches), which hosts with bf16 arithmetic run.
struct Bf16Path {
  Bf16Kernel kernel;
  Bf16Projection projection;
  bool as_float32_layer = true;
};

void PrintTo(const Bf16Path& path, std::ostream* os) {
  *os << Bf16KernelName(path.kernel) << " products, " << Bf16ProjectionName(path.projection)
      << " projections" << (path.as_float32_layer ? "" : ", the bf16 layer's own path");
}

class Bf16LayerTest : public ::testing::TestWithParam<Bf16Path> {
 protected:
  void SetUp() override {
    if (!CpuSupports(GetParam().kernel) || !CpuSupports(GetParam().projection)) {
      GTEST_SKIP() << "this CPU has no " << Bf16KernelName(GetParam().kernel) << " or "
                   << Bf16ProjectionName(GetParam().projection) << " instructions";
    }
    CpuKernelChoice forced;
    forced.bf16_products = GetParam().kernel;
    forced.bf16_projection = GetParam().projection;
    forced.bf16_layers_as_float32 = GetParam().as_float32_layer;
    cpu_backend_ = std::make_shared<CpuBackend>(2, forced);
    backend_ = cpu_backend_;
  }

  // The layer of `config` (compute_dtype set to `dtype`) with `weights`.
  std::shared_ptr<const MhaLayer> Layer(MhaConfig config, DType dtype, const MhaWeights& weights) {
    config.compute_dtype = dtype;
    auto layer = MhaLayer::Create(config, weights, backend_);
    EXPECT_TRUE(layer.ok()) << layer.status();
    return layer.ok() ? *layer : nullptr;
  }

  std::shared_ptr<const CpuBackend> cpu_backend_;
  std::shared_ptr<const Backend> backend_;
};

// Which calls ExpectBf16RuleOnRandomConfigs makes.
enum class Bf16Calls {
  kAny,              // odd head sizes, every mask, weights
  kTensorCoreHeads,  // head sizes multiples of 16 up to 128, several 64-key tiles, few weights
  kCudnnCalls,       // what cuDNN's SDPA takes (cudnn_sdpa_plan.h): heads multiples of 8 up to
                     // 128, no weights, no dropout, causal or sliding windows or no mask
};

// Random configs (GQA, odd head sizes, cross-attention, RoPE with scaling, causal and
// windows, no output projection) and options (masks, fully masked rows, weights), several
// requests packed into a batch, on `backend`. The oracle is the float64 forward of the
// float32 layer on the original weights and inputs. `calls` narrows them to the shapes one
// GPU path takes.
void ExpectBf16RuleOnRandomConfigs(const std::shared_ptr<const Backend>& backend,
                                   const std::string& name, uint64_t seed,
                                   Bf16Calls calls = Bf16Calls::kAny) {
  const bool tensor_core_heads = calls != Bf16Calls::kAny;
  const bool cudnn_calls = calls == Bf16Calls::kCudnnCalls;
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  auto uniform = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  auto coin = [&rng](double p) { return std::bernoulli_distribution(p)(rng); };
  FidelityStats outputs("bf16 layer output (" + name + "), fast/bf16-reference"),
      weights("bf16 layer weights (" + name + "), fast/bf16-reference");
  for (int trial = 0; trial < TrialsForThisBuild(40) && !::testing::Test::HasFailure(); ++trial) {
    MhaConfig config;
    config.num_kv_heads = uniform(1, 3);
    config.num_heads = config.num_kv_heads * uniform(1, 3);
    const int64_t tensor_core_step = cudnn_calls ? 8 : 16;
    auto head_size = [&] { return tensor_core_step * uniform(1, 128 / tensor_core_step); };
    config.head_dim = tensor_core_heads ? head_size() : 2 * uniform(1, 20);
    config.v_head_dim = coin(0.5) ? 0 : tensor_core_heads ? head_size() : uniform(1, 33);
    config.embed_dim = uniform(1, 80);
    config.kdim = coin(0.7) ? 0 : uniform(1, 40);
    config.vdim = coin(0.7) ? 0 : uniform(1, 40);
    config.qkv_bias = coin(0.5);
    config.output_bias = coin(0.5);
    config.output_projection = coin(0.8);
    if (config.output_projection && coin(0.5)) config.output_dim = uniform(1, 50);
    config.rope_theta = coin(0.3) ? 10000.0 : 0.0;
    if (config.rope_theta > 0.0 && coin(0.5)) {
      config.rope_scaling.type = RopeScaling::kLinear;
      config.rope_scaling.factor = 2.0;
    }
    config.always_causal = coin(0.2);
    if (config.always_causal && coin(0.5)) config.sliding_window = uniform(1, 20);
    auto resolved = MhaConfig::Resolve(config);
    ASSERT_TRUE(resolved.ok()) << resolved.status();
    const MhaWeights random = MhaWeights::Random(*resolved, rng());
    MhaConfig bf16_config = *resolved;
    bf16_config.compute_dtype = DType::kBFloat16;
    auto bf16 = MhaLayer::Create(bf16_config, random, backend);
    auto f32 = MhaLayer::Create(*resolved, random, backend);
    ASSERT_TRUE(bf16.ok() && f32.ok()) << bf16.status() << " " << f32.status();
    const MhaConfig& c = (*bf16)->config();
    const bool can_self_attend = c.kdim == c.embed_dim && c.vdim == c.embed_dim;
    const int count = static_cast<int>(uniform(1, 4));
    std::vector<std::vector<float>> storage;
    std::vector<MhaInput> inputs(count);
    for (MhaInput& in : inputs) {
      in.batch = uniform(1, 3);
      const int64_t longest = tensor_core_heads ? 200 : 70;
      in.q_len = uniform(1, longest);
      const bool cross = !can_self_attend || coin(0.3);  // also on a layer stored fused
      in.kv_len = cross ? uniform(1, longest) : in.q_len;
      storage.push_back(RandomFloats(rng, in.batch * in.q_len * c.embed_dim));
      in.query = storage.back();
      if (cross) {
        storage.push_back(RandomFloats(rng, in.batch * in.kv_len * c.kdim));
        in.key = storage.back();
        storage.push_back(RandomFloats(rng, in.batch * in.kv_len * c.vdim));
        in.value = storage.back();
      }
      in.options = RandomOptions(rng, {in.batch, c.num_heads, c.num_kv_heads, in.q_len, in.kv_len,
                                       c.head_dim, c.v_head_dim});
      if (tensor_core_heads && coin(0.8)) in.options.need_weights = NeedWeights::kNone;
      if (cudnn_calls) {
        AttentionOptions plain;  // causal (bottom-right), key lengths or nothing; scales
        plain.causal = in.q_len <= in.kv_len && coin(0.5);
        if (!plain.causal && coin(0.4)) {  // key lengths, or a right-padded mask
          const bool as_mask = coin(0.5);
          for (int64_t b = 0; b < in.batch; ++b) {
            const int64_t valid = uniform(1, in.kv_len);
            if (!as_mask) plain.key_lengths.push_back(valid);
            for (int64_t j = 0; as_mask && j < in.kv_len; ++j) {
              plain.key_padding_keep.push_back(j < valid ? 1 : 0);
            }
          }
        }
        if (coin(0.3)) plain.scale = 0.5f / static_cast<float>(c.head_dim);
        in.options = plain;
      }
      ASSERT_TRUE((*bf16)->ValidateInput(in).ok()) << (*bf16)->ValidateInput(in);
    }
    std::vector<const MhaInput*> pointers;
    for (const MhaInput& in : inputs) pointers.push_back(&in);
    const auto forward = (*bf16)->ForwardBatch(pointers);
    ASSERT_TRUE(forward.ok()) << forward.status();
    for (int n = 0; n < count; ++n) {
      const std::string what =
          "trial " + std::to_string(trial) + " input " + std::to_string(n) +
          ": E=" + std::to_string(c.embed_dim) + " kdim=" + std::to_string(c.kdim) +
          " vdim=" + std::to_string(c.vdim) + " rope=" + std::to_string(c.rope_theta) +
          " window=" + std::to_string(c.sliding_window) + " " +
          testing::Describe({inputs[n].batch, c.num_heads, c.num_kv_heads, inputs[n].q_len,
                             inputs[n].kv_len, c.head_dim, c.v_head_dim},
                            inputs[n].options);
      const TextbookResult<float> reference = (*bf16)->ForwardBf16Textbook(inputs[n]);
      const TextbookResult<double> oracle = (*f32)->ForwardTextbook<double>(inputs[n]);
      EXPECT_TRUE(outputs.CheckBf16((*forward)[n].output, reference.output, oracle.output))
          << what << " output";
      EXPECT_TRUE(weights.CheckBf16((*forward)[n].weights, reference.weights, oracle.weights))
          << what << " weights";
    }
  }
}

TEST_P(Bf16LayerTest, BatchedForwardFollowsTheBf16RuleOnRandomConfigs) {
  ExpectBf16RuleOnRandomConfigs(backend_, Bf16ProjectionName(GetParam().projection),
                                TestSeed(2610));
}

TEST_P(Bf16LayerTest, LongerSequencesOfWideHeadsFollowTheBf16Rule) {
  ExpectBf16RuleOnRandomConfigs(
      backend_, std::string(Bf16ProjectionName(GetParam().projection)) + ", wide heads",
      TestSeed(2616), Bf16Calls::kTensorCoreHeads);
}

// The calls the GPU hands to cuDNN, on the CPU's kernels: the same rule on every host (and a
// check of those calls' generation where no GPU runs them).
TEST_P(Bf16LayerTest, CudnnShapedCallsFollowTheBf16Rule) {
  ExpectBf16RuleOnRandomConfigs(
      backend_, std::string(Bf16ProjectionName(GetParam().projection)) + ", cuDNN calls",
      TestSeed(2618), Bf16Calls::kCudnnCalls);
}

// The same on the GPU: projections on tensor cores (cuBLAS bf16 GEMMs, float32
// accumulation), attention in float32. SKIPPED where no GPU can run.
TEST(Bf16CudaLayerTest, BatchedForwardFollowsTheBf16RuleOnRandomConfigs) {
  auto backend = testing::TestDevices().Get("cuda");
  if (!backend.ok()) GTEST_SKIP() << "backend cuda cannot run here: " << backend.status().message();
  ExpectBf16RuleOnRandomConfigs(*backend, "cuda", TestSeed(2614));
}

// Head sizes the mma kernel takes (both attention products on tensor cores), several key
// tiles, mostly without weights. SKIPPED where no GPU can run.
TEST(Bf16CudaLayerTest, TensorCoreHeadsFollowTheBf16Rule) {
  auto backend = testing::TestDevices().Get("cuda");
  if (!backend.ok()) GTEST_SKIP() << "backend cuda cannot run here: " << backend.status().message();
  ExpectBf16RuleOnRandomConfigs(*backend, "cuda, tensor-core heads", TestSeed(2615),
                                Bf16Calls::kTensorCoreHeads);
}

// Calls cuDNN's fused SDPA takes (issue 40): they must run there (a GPU machine whose cuDNN
// cannot load fails here; its start-up line says why) and follow the bf16 rule. SKIPPED
// where no GPU can run.
TEST(Bf16CudaLayerTest, CudnnCallsFollowTheBf16Rule) {
  auto backend = testing::TestDevices().Get("cuda");
  if (!backend.ok()) GTEST_SKIP() << "backend cuda cannot run here: " << backend.status().message();
  const int64_t before = (*backend)->AttentionCallsByPath()["cudnn"];
  ExpectBf16RuleOnRandomConfigs(*backend, "cuda, cuDNN calls", TestSeed(2617),
                                Bf16Calls::kCudnnCalls);
  EXPECT_GT((*backend)->AttentionCallsByPath()["cudnn"], before)
      << "no call ran on cuDNN's SDPA (ATTENTION_CUDNN_SDPA, or the plugin's start-up line)";
}

// Mutation check of the rule above: a layer that multiplied in bf16 but rounded nothing
// else would pass; one whose weights were rounded twice as coarsely (8 mantissa bits
// dropped to 4) must fail it, so the rule can tell.
TEST_P(Bf16LayerTest, RuleRejectsACoarserLayer) {
  const uint64_t seed = TestSeed(2611);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  MhaConfig config;
  config.embed_dim = 64;
  config.num_heads = 4;
  const MhaConfig resolved = *MhaConfig::Resolve(config);
  const MhaWeights random = MhaWeights::Random(resolved, rng());
  MhaWeights coarse = random;
  for (std::vector<float>* tensor :
       {&coarse.q_weight, &coarse.k_weight, &coarse.v_weight, &coarse.out_weight}) {
    for (float& w : *tensor) {
      uint32_t bits;
      std::memcpy(&bits, &w, sizeof(bits));
      bits &= 0xfff00000u;  // 4 mantissa bits
      std::memcpy(&w, &bits, sizeof(bits));
    }
  }
  const auto bf16 = Layer(resolved, DType::kBFloat16, random);
  const auto coarse_layer = Layer(resolved, DType::kBFloat16, coarse);
  const auto f32 = Layer(resolved, DType::kFloat32, random);
  const std::vector<float> x = RandomFloats(rng, 2 * 50 * 64);
  MhaInput in;
  in.batch = 2;
  in.q_len = in.kv_len = 50;
  in.query = x;
  const MhaInput* one[] = {&in};
  const auto reference = bf16->ForwardBf16Textbook(in);
  const auto oracle = f32->ForwardTextbook<double>(in);
  FidelityStats stats("bf16 mutation check");
  EXPECT_TRUE(
      stats.CheckBf16((*bf16->ForwardBatch(one))[0].output, reference.output, oracle.output));
  EXPECT_FALSE(stats.CheckBf16((*coarse_layer->ForwardBatch(one))[0].output, reference.output,
                               oracle.output));
}

// bf16 inputs go into the products as sent: the same bits as their float32 values rounded;
// float16 inputs as their float32 values.
TEST_P(Bf16LayerTest, HalfInputsGiveWhatTheirFloatValuesGive) {
  const uint64_t seed = TestSeed(2612);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  MhaConfig config;
  config.embed_dim = 48;
  config.num_heads = 3;
  config.kdim = 20;
  config.vdim = 12;
  const MhaConfig resolved = *MhaConfig::Resolve(config);
  const auto layer = Layer(resolved, DType::kBFloat16, MhaWeights::Random(resolved, rng()));
  ASSERT_TRUE(layer->TakesHalfInputs());
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    auto bits_of = [&](int64_t count) {
      std::vector<uint16_t> bits(count);
      for (uint16_t& b : bits) {
        const float v = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
        b = dtype == DType::kFloat16 ? FloatToHalf(v) : FloatToBFloat16(v);
      }
      return bits;
    };
    const std::vector<uint16_t> q = bits_of(2 * 5 * 48), k = bits_of(2 * 7 * 20),
                                v = bits_of(2 * 7 * 12);
    MhaInput half;
    half.batch = 2;
    half.q_len = 5;
    half.kv_len = 7;
    half.half_dtype = dtype;
    half.query_half = q;
    half.key_half = k;
    half.value_half = v;
    std::deque<std::vector<float>> storage;
    const MhaInput decoded = WithFloatInputs(half, &storage);
    const MhaInput* one_half[] = {&half};
    const MhaInput* one_float[] = {&decoded};
    auto from_half = layer->ForwardBatch(one_half);
    auto from_float = layer->ForwardBatch(one_float);
    ASSERT_TRUE(from_half.ok() && from_float.ok());
    EXPECT_EQ((*from_half)[0].output, (*from_float)[0].output) << DTypeName(dtype);
  }
}

// A caller that asks for a bf16 answer gets the layer's float32 answer rounded, bit for
// bit, and one with a float32 destination gets the answer itself: alone (a CPU bf16 layer's
// output projection writes bf16 straight into the destination), packed with others (rounded
// on delivery), and with every caller of the batch asking for bf16 (the GPU rounds on the
// device and copies half the bytes back), on bf16 and float32 layers of `backend`.
void ExpectDestinationsHoldTheAnswer(const std::shared_ptr<const Backend>& backend, uint64_t seed) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  MhaConfig config;
  config.embed_dim = 64;
  config.num_heads = 4;
  const MhaConfig resolved = *MhaConfig::Resolve(config);
  const MhaWeights weights = MhaWeights::Random(resolved, rng());
  for (const DType compute : {DType::kBFloat16, DType::kFloat32}) {
    SCOPED_TRACE(DTypeName(compute));
    MhaConfig layer_config = resolved;
    layer_config.compute_dtype = compute;
    const auto created = MhaLayer::Create(layer_config, weights, backend);
    ASSERT_TRUE(created.ok()) << created.status();
    const std::shared_ptr<const MhaLayer>& layer = *created;
    std::vector<std::vector<float>> queries;
    std::vector<MhaInput> inputs(3);
    for (MhaInput& in : inputs) {
      in.batch = 2;
      in.q_len = in.kv_len = static_cast<int64_t>(queries.size()) + 3;
      queries.push_back(RandomFloats(rng, in.batch * in.q_len * resolved.embed_dim));
      in.query = queries.back();
    }
    const auto rounded = [](const std::vector<float>& values) {
      std::vector<uint16_t> bits(values.size());
      for (size_t i = 0; i < values.size(); ++i) bits[i] = FloatToBFloat16(values[i]);
      return bits;
    };
    const MhaInput* lone[] = {&inputs[0]};
    const MhaInput* packed[] = {&inputs[0], &inputs[1], &inputs[2]};
    const auto plain = layer->ForwardBatch(lone);
    const auto packed_plain = layer->ForwardBatch(packed);
    ASSERT_TRUE(plain.ok() && packed_plain.ok());
    std::vector<std::vector<uint16_t>> destinations;
    for (const MhaInput& in : inputs) {
      destinations.emplace_back(in.batch * in.q_len * resolved.output_dim, uint16_t{0x7777});
    }
    inputs[0].output_destination_bf16 = absl::MakeSpan(destinations[0]);
    ASSERT_TRUE(layer->ValidateInput(inputs[0]).ok()) << layer->ValidateInput(inputs[0]);
    const auto alone = layer->ForwardBatch(lone);
    ASSERT_TRUE(alone.ok()) << alone.status();
    EXPECT_TRUE((*alone)[0].output.empty());
    EXPECT_EQ(destinations[0], rounded((*plain)[0].output));
    std::fill(destinations[0].begin(), destinations[0].end(), uint16_t{0x7777});
    inputs[2].output_destination_bf16 = absl::MakeSpan(destinations[2]);
    const auto batch = layer->ForwardBatch(packed);
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_EQ(destinations[0], rounded((*packed_plain)[0].output));
    EXPECT_EQ((*batch)[1].output, (*packed_plain)[1].output);
    EXPECT_EQ(destinations[2], rounded((*packed_plain)[2].output));
    EXPECT_TRUE((*batch)[0].output.empty() && (*batch)[2].output.empty());
    // Every caller asks for bf16.
    for (auto& destination : destinations)
      std::fill(destination.begin(), destination.end(), 0x7777);
    inputs[1].output_destination_bf16 = absl::MakeSpan(destinations[1]);
    const auto all_bf16 = layer->ForwardBatch(packed);
    ASSERT_TRUE(all_bf16.ok()) << all_bf16.status();
    for (int n = 0; n < 3; ++n) {
      EXPECT_EQ(destinations[n], rounded((*packed_plain)[n].output)) << "input " << n;
      EXPECT_TRUE((*all_bf16)[n].output.empty()) << "input " << n;
    }
    // float32 destinations beside a bf16 one.
    std::vector<std::vector<float>> float_destinations;
    for (int n = 0; n < 2; ++n) {
      float_destinations.emplace_back(destinations[n].size(), -7.0f);
      inputs[n].output_destination_bf16 = {};
      inputs[n].output_destination = absl::MakeSpan(float_destinations[n]);
    }
    const auto mixed = layer->ForwardBatch(packed);
    ASSERT_TRUE(mixed.ok()) << mixed.status();
    for (int n = 0; n < 2; ++n) {
      EXPECT_EQ(float_destinations[n], (*packed_plain)[n].output) << "input " << n;
    }
    EXPECT_EQ(destinations[2], rounded((*packed_plain)[2].output));
  }
}

TEST_P(Bf16LayerTest, DestinationsHoldTheAnswer) {
  ExpectDestinationsHoldTheAnswer(backend_, TestSeed(2613));
}

// The same on the GPU. SKIPPED where no GPU can run.
TEST(Bf16CudaLayerTest, DestinationsHoldTheAnswer) {
  auto backend = testing::TestDevices().Get("cuda");
  if (!backend.ok()) GTEST_SKIP() << "backend cuda cannot run here: " << backend.status().message();
  ExpectDestinationsHoldTheAnswer(*backend, TestSeed(2617));
}

// A batch large enough to run in groups, each on one thread (core/cpu/batch_groups.h), its
// inputs taken apart into their sequences where they can be: every answer follows the bf16
// rule (masks of every kind, dropout, weights, cross-attention, GQA and RoPE, bf16 inputs),
// lands in its caller's destination when given one, and is bit for bit what the input
// alone gets.
TEST_P(Bf16LayerTest, GroupedBatchesAnswerAsEachInputAlone) {
  const uint64_t seed = TestSeed(2618);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  auto uniform = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  FidelityStats outputs("grouped bf16 batch output"), weights("grouped bf16 batch weights");
  for (int trial = 0; trial < 6 && !HasFailure(); ++trial) {
    MhaConfig config;
    config.embed_dim = 64;
    config.num_heads = 4;
    config.num_kv_heads = trial % 2 == 0 ? 4 : 2;
    config.rope_theta = trial % 3 == 2 ? 10000.0 : 0.0;
    const MhaConfig resolved = *MhaConfig::Resolve(config);
    const MhaWeights random = MhaWeights::Random(resolved, rng());
    const auto bf16 = Layer(resolved, DType::kBFloat16, random);
    const auto f32 = Layer(resolved, DType::kFloat32, random);
    const int64_t e = resolved.embed_dim;
    std::vector<std::vector<float>> storage;
    std::vector<std::vector<uint16_t>> bf16_storage;
    std::vector<MhaInput> inputs(12);
    for (size_t n = 0; n < inputs.size(); ++n) {
      MhaInput& in = inputs[n];
      in.batch = uniform(2, 4);
      in.q_len = uniform(20, 40);
      in.kv_len = n == 1 ? uniform(10, 50) : in.q_len;  // input 1: cross-attention
      storage.push_back(RandomFloats(rng, in.batch * in.q_len * e));
      if (n == 2) {  // bf16 on the wire
        bf16_storage.emplace_back(storage.back().size());
        for (size_t i = 0; i < storage.back().size(); ++i) {
          bf16_storage.back()[i] = FloatToBFloat16(storage.back()[i]);
        }
        in.half_dtype = DType::kBFloat16;
        in.query_half = bf16_storage.back();
      } else {
        in.query = storage.back();
      }
      if (n == 1) {
        storage.push_back(RandomFloats(rng, in.batch * in.kv_len * e));
        in.key = storage.back();
        storage.push_back(RandomFloats(rng, in.batch * in.kv_len * e));
        in.value = storage.back();
      }
      in.options =
          RandomOptions(rng, {in.batch, resolved.num_heads, resolved.num_kv_heads, in.q_len,
                              in.kv_len, resolved.head_dim, resolved.v_head_dim});
      // Most split: no weights, no dropout.
      if (n % 3 != 0) {
        in.options.need_weights = NeedWeights::kNone;
        in.options.dropout_p = 0.0f;
      }
    }
    std::vector<float> float_destination(inputs[3].batch * inputs[3].q_len * resolved.output_dim,
                                         -7.0f);
    std::vector<uint16_t> bf16_destination(inputs[4].batch * inputs[4].q_len * resolved.output_dim,
                                           uint16_t{0x7777});
    inputs[3].output_destination = absl::MakeSpan(float_destination);
    inputs[4].output_destination_bf16 = absl::MakeSpan(bf16_destination);
    std::vector<BatchPart> parts;
    std::vector<const MhaInput*> pointers;
    for (const MhaInput& in : inputs) {
      ASSERT_TRUE(bf16->ValidateInput(in).ok()) << bf16->ValidateInput(in);
      pointers.push_back(&in);
      const int64_t sequences = SplitsIntoSequences(in) ? in.batch : 1;
      for (int64_t s = 0; s < sequences; ++s) {
        parts.push_back({in.batch / sequences * in.q_len, in.kv_len});
      }
    }
    ASSERT_FALSE(GroupBatchParts(e, parts, 2).empty()) << "the batch should run in groups";
    const auto batch = bf16->ForwardBatch(pointers);
    ASSERT_TRUE(batch.ok()) << batch.status();
    for (size_t n = 0; n < inputs.size(); ++n) {
      MhaInput plain = inputs[n];
      plain.output_destination = {};
      plain.output_destination_bf16 = {};
      const MhaInput* alone_batch[] = {&plain};
      const auto alone = bf16->ForwardBatch(alone_batch);
      ASSERT_TRUE(alone.ok()) << alone.status();
      const std::string what =
          "trial " + std::to_string(trial) + " input " + std::to_string(n) + ": " +
          testing::Describe({plain.batch, resolved.num_heads, resolved.num_kv_heads, plain.q_len,
                             plain.kv_len, resolved.head_dim, resolved.v_head_dim},
                            plain.options);
      // Bit for bit where the batch runs in groups; a bf16 layer run as a float32 layer has
      // a float32 layer's bits, which depend on the batch's rows (OpenBLAS for many).
      const bool bitwise = !cpu_backend_->Bf16ComputesInFloat32();
      std::vector<float> answer = (*batch)[n].output;
      if (n == 3) {
        EXPECT_TRUE(answer.empty()) << what;
        answer = float_destination;
      } else if (n == 4) {
        EXPECT_TRUE(answer.empty()) << what;
        std::vector<uint16_t> rounded((*alone)[0].output.size());
        for (size_t i = 0; i < rounded.size(); ++i) {
          rounded[i] = FloatToBFloat16((*alone)[0].output[i]);
        }
        if (bitwise) {
          EXPECT_EQ(bf16_destination, rounded) << what;
        } else {
          EXPECT_EQ(bf16_destination.size(), rounded.size()) << what;
        }
        continue;
      }
      if (bitwise) {
        EXPECT_EQ(answer, (*alone)[0].output) << what;
        EXPECT_EQ((*batch)[n].weights, (*alone)[0].weights) << what;
      }
      std::deque<std::vector<float>> decoded;
      const MhaInput as_float = WithFloatInputs(plain, &decoded);
      const TextbookResult<float> reference = bf16->ForwardBf16Textbook(as_float);
      const TextbookResult<double> oracle = f32->ForwardTextbook<double>(as_float);
      EXPECT_TRUE(outputs.CheckBf16(answer, reference.output, oracle.output)) << what;
      EXPECT_TRUE(weights.CheckBf16((*batch)[n].weights, reference.weights, oracle.weights))
          << what;
    }
  }
}

// Where the host multiplies bf16 fastest in float32, a bf16 layer is the float32 layer on
// its bf16 values, bit for bit: the bf16 weights widened, the tokens rounded to bf16 (float32
// and float16 ones; bf16 ones as sent), through the batch and the sessions' decode entry.
TEST_P(Bf16LayerTest, OnFloat32KernelsIsTheFloat32LayerOnBf16Values) {
  if (!cpu_backend_->Bf16ComputesInFloat32()) {
    GTEST_SKIP() << "this path multiplies in bf16 or runs the bf16 layer's own steps";
  }
  const uint64_t seed = TestSeed(2620);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  const auto round_to_bf16 = [](const std::vector<float>& values) {
    std::vector<float> rounded(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
      rounded[i] = BFloat16ToFloat(FloatToBFloat16(values[i]));
    }
    return rounded;
  };
  for (const bool rope : {false, true}) {
    SCOPED_TRACE(rope ? "RoPE, GQA" : "cross-attention sizes");
    MhaConfig config;
    config.embed_dim = 48;
    config.num_heads = 4;
    if (rope) {
      config.num_kv_heads = 2;
      config.rope_theta = 10000.0;
    } else {
      config.kdim = 20;
      config.vdim = 12;
    }
    const MhaConfig resolved = *MhaConfig::Resolve(config);
    const auto bf16 = Layer(resolved, DType::kBFloat16, MhaWeights::Random(resolved, rng()));
    const auto f32 = Layer(resolved, DType::kFloat32, bf16->weights());
    std::vector<std::vector<float>> storage, rounded_storage;
    std::vector<uint16_t> half_query;
    std::vector<MhaInput> inputs(3), rounded(3);
    for (size_t n = 0; n < inputs.size(); ++n) {
      MhaInput& in = inputs[n];
      in.batch = 2;
      in.q_len = 5 + static_cast<int64_t>(n);
      in.kv_len = rope ? in.q_len : 7;
      const auto add = [&](int64_t count, absl::Span<const float>& given,
                           absl::Span<const float>& expected) {
        storage.push_back(RandomFloats(rng, count));
        rounded_storage.push_back(round_to_bf16(storage.back()));
        given = storage.back();
        expected = rounded_storage.back();
      };
      rounded[n] = in;
      add(in.batch * in.q_len * resolved.embed_dim, in.query, rounded[n].query);
      if (!rope) {
        add(in.batch * in.kv_len * resolved.kdim, in.key, rounded[n].key);
        add(in.batch * in.kv_len * resolved.vdim, in.value, rounded[n].value);
      }
    }
    if (rope) {  // a float16 input: rounded to bf16 from its float32 value
      half_query.resize(inputs[1].query.size());
      std::vector<float> as_float(half_query.size());
      for (size_t i = 0; i < half_query.size(); ++i) {
        half_query[i] = FloatToHalf(inputs[1].query[i]);
        as_float[i] = HalfToFloat(half_query[i]);
      }
      rounded_storage.push_back(round_to_bf16(as_float));
      rounded[1].query = rounded_storage.back();
      inputs[1].query = {};
      inputs[1].half_dtype = DType::kFloat16;
      inputs[1].query_half = half_query;
    }
    std::vector<const MhaInput*> given, expected;
    for (size_t n = 0; n < inputs.size(); ++n) {
      inputs[n].options.need_weights = NeedWeights::kAveraged;
      rounded[n].options = inputs[n].options;
      given.push_back(&inputs[n]);
      expected.push_back(&rounded[n]);
    }
    const auto ours = bf16->ForwardBatch(given);
    const auto theirs = f32->ForwardBatch(expected);
    ASSERT_TRUE(ours.ok() && theirs.ok()) << ours.status() << " " << theirs.status();
    for (size_t n = 0; n < inputs.size(); ++n) {
      EXPECT_EQ((*ours)[n].output, (*theirs)[n].output) << "input " << n;
      EXPECT_EQ((*ours)[n].weights, (*theirs)[n].weights) << "input " << n;
    }
    if (!rope) continue;
    // The decode entry: tokens rounded, Q, K, V and the output projection unrounded.
    ASSERT_TRUE(bf16->DecodeSupport().ok()) << bf16->DecodeSupport();
    const std::vector<int64_t> positions = {0, 3, 9};
    const std::vector<float> x = RandomFloats(rng, 3 * resolved.embed_dim);
    const std::vector<float> x_rounded = round_to_bf16(x);
    const auto project = [&](const MhaLayer& layer, const std::vector<float>& tokens) {
      std::vector<float> qkv(3 * (resolved.QWidth() + resolved.KWidth() + resolved.VWidth()));
      float* q = qkv.data();
      float* k = q + 3 * resolved.QWidth();
      float* v = k + 3 * resolved.KWidth();
      EXPECT_TRUE(layer.ProjectForDecode(tokens.data(), positions, q, k, v).ok());
      std::vector<float> out(3 * resolved.output_dim);
      EXPECT_TRUE(layer.ProjectDecodeOutput(q, 3, out.data()).ok());
      qkv.insert(qkv.end(), out.begin(), out.end());
      return qkv;
    };
    EXPECT_EQ(project(*bf16, x), project(*f32, x_rounded));
  }
}

// Callers running grouped batches on one layer at once (two batch workers, each batch's
// groups on the shared pool) get what each batch gets alone.
TEST_P(Bf16LayerTest, ConcurrentGroupedBatchesAnswerAsAlone) {
  const uint64_t seed = TestSeed(2619);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  MhaConfig config;
  config.embed_dim = 32;
  config.num_heads = 2;
  const MhaConfig resolved = *MhaConfig::Resolve(config);
  const auto layer = Layer(resolved, DType::kBFloat16, MhaWeights::Random(resolved, rng()));
  constexpr int kCallers = 3;
  std::vector<std::vector<float>> queries;
  std::vector<std::vector<MhaInput>> batches(kCallers, std::vector<MhaInput>(12));
  std::vector<std::vector<std::vector<float>>> expected(kCallers);
  for (int caller = 0; caller < kCallers; ++caller) {
    std::vector<const MhaInput*> pointers;
    std::vector<BatchPart> sequences;
    for (MhaInput& in : batches[caller]) {
      in.batch = 2;
      in.q_len = in.kv_len = 20 + caller;
      queries.push_back(RandomFloats(rng, in.batch * in.q_len * resolved.embed_dim));
      in.query = queries.back();
      pointers.push_back(&in);
      sequences.insert(sequences.end(), in.batch, {in.q_len, in.kv_len});
    }
    ASSERT_FALSE(GroupBatchParts(resolved.embed_dim, sequences, 2).empty()) << "caller " << caller;
    const auto alone = layer->ForwardBatch(pointers);
    ASSERT_TRUE(alone.ok()) << alone.status();
    for (const AttentionResult& result : *alone) expected[caller].push_back(result.output);
  }
  std::vector<int> mismatches(kCallers, 0);
  std::vector<std::thread> threads;
  for (int caller = 0; caller < kCallers; ++caller) {
    threads.emplace_back([&, caller] {
      std::vector<const MhaInput*> pointers;
      for (const MhaInput& in : batches[caller]) pointers.push_back(&in);
      for (int round = 0; round < 5; ++round) {
        const auto results = layer->ForwardBatch(pointers);
        for (size_t n = 0; n < pointers.size(); ++n) {
          mismatches[caller] += !results.ok() || (*results)[n].output != expected[caller][n];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int caller = 0; caller < kCallers; ++caller) {
    EXPECT_EQ(mismatches[caller], 0) << "caller " << caller;
  }
}

// The memory issue 26 asks for: a bf16 layer holds at most 0.55 x the host bytes of the
// same layer in float32 (weights and the packed copy, as the budgets count them).
TEST_P(Bf16LayerTest, HoldsAtMostHalfTheBytesOfFloat32) {
  MhaConfig config;
  config.embed_dim = 256;
  config.num_heads = 8;
  config.num_kv_heads = 2;
  const MhaConfig resolved = *MhaConfig::Resolve(config);
  const MhaWeights random = MhaWeights::Random(resolved, 7);
  const auto bf16 = Layer(resolved, DType::kBFloat16, random);
  const auto f32 = Layer(resolved, DType::kFloat32, random);
  const int64_t matrices = resolved.ParameterCount() - 256 - 256 - 2 * 64;  // less biases
  EXPECT_EQ(bf16->WeightBytes(), matrices * 2 + (resolved.ParameterCount() - matrices) * 4);
  EXPECT_EQ(f32->WeightBytes(), resolved.ParameterCount() * 4);
  if (GetParam().projection != Bf16Projection::kFloat32) {
    EXPECT_LE(bf16->HostBytes(), 0.55 * f32->HostBytes())
        << bf16->HostBytes() << " vs " << f32->HostBytes();
  }
  // The weights read back are the bf16 values, widened.
  const MhaWeights held = bf16->weights();
  ASSERT_EQ(held.q_weight.size(), random.q_weight.size());
  for (size_t i = 0; i < held.q_weight.size(); i += 97) {
    EXPECT_EQ(held.q_weight[i], BFloat16ToFloat(FloatToBFloat16(random.q_weight[i])));
  }
}

TEST(Bf16LayerConfigTest, OnlyFloat32AndBFloat16AreComputePrecisions) {
  MhaConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  config.compute_dtype = DType::kFloat16;
  const auto resolved = MhaConfig::Resolve(config);
  ASSERT_FALSE(resolved.ok());
  EXPECT_EQ(resolved.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(resolved.status().message(),
            "config.compute_dtype = FLOAT16 is not a compute precision; expected FLOAT32 or "
            "BFLOAT16");
}

// oneDNN runs everywhere (AMX tiles where the CPU has them), beside the host's own
// attention kernel, beside AMX's attention tiles where the CPU has them, and beside float32
// products (an AVX-512 Xeon without AVX512-BF16, where oneDNN may still win the projections).
INSTANTIATE_TEST_SUITE_P(
    Kernels, Bf16LayerTest,
    ::testing::Values(Bf16Path{Bf16Kernel::kAvx512Bf16, Bf16Projection::kAvx512Bf16},
                      Bf16Path{Bf16Kernel::kPortable, Bf16Projection::kFloat32},
                      Bf16Path{Bf16Kernel::kPortable, Bf16Projection::kFloat32,
                               /*as_float32_layer=*/false},
                      Bf16Path{Bf16Kernel::kAvx512Bf16, Bf16Projection::kFloat32},
                      Bf16Path{Bf16Kernel::kAvx512Bf16, Bf16Projection::kOneDnn},
                      Bf16Path{Bf16Kernel::kAmx, Bf16Projection::kOneDnn},
                      Bf16Path{Bf16Kernel::kAmx, Bf16Projection::kAmx},
                      Bf16Path{Bf16Kernel::kPortable, Bf16Projection::kOneDnn}),
    [](const ::testing::TestParamInfo<Bf16Path>& info) {
      return std::string(Bf16KernelName(info.param.kernel)) + "_" +
             Bf16ProjectionName(info.param.projection) +
             (info.param.as_float32_layer ? "" : "_grouped");
    });

}  // namespace
}  // namespace attention::core

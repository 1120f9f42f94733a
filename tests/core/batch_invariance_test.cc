// Batch invariance (issue 55): a request's answer has the same bits alone as beside
// neighbours of any row count, in either order, and on 1 or 2 compute threads, for every
// kernel set of the CPU backend that this host runs (forced as the flags force them). The
// server's tests hold the same over the wire (tests/server/batch_invariance_test.cc).
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/gemm.h"
#include "core/cpu/gemm_bf16.h"
#include "core/mha_layer.h"
#include "gtest/gtest.h"
#include "tests/core/random_options.h"

namespace attention::core {
namespace {

using testing::RandomFloats;
using testing::TestSeed;

// One kernel set of the CPU backend, as --float32_kernels, --bf16_kernels and
// --bf16_attention_kernels force it.
struct KernelSet {
  DType layer_dtype;
  Float32Projection float32_projection = Float32Projection::kOwn;
  Bf16Projection bf16_projection = Bf16Projection::kFloat32;
  Bf16Kernel bf16_products = Bf16Kernel::kPortable;
  // A bf16 layer on float32 projections and products runs as the float32 layer on its bf16
  // values (CpuBackend::Bf16ComputesInFloat32), as servers on hosts without bf16 do.
  bool bf16_as_float32_layer = false;
};

void PrintTo(const KernelSet& set, std::ostream* os) {
  if (set.layer_dtype == DType::kFloat32) {
    *os << "float32 layer, " << Float32ProjectionName(set.float32_projection) << " projections";
  } else {
    *os << "bf16 layer, " << Bf16ProjectionName(set.bf16_projection) << " projections, "
        << Bf16KernelName(set.bf16_products) << " products";
  }
  if (set.bf16_as_float32_layer) {
    *os << ", as the float32 layer (" << Float32ProjectionName(set.float32_projection) << ")";
  }
}

std::string KernelSetName(const ::testing::TestParamInfo<KernelSet>& info) {
  const KernelSet& set = info.param;
  if (set.layer_dtype == DType::kFloat32) {
    return std::string("float32_") + Float32ProjectionName(set.float32_projection);
  }
  if (set.bf16_as_float32_layer) {
    return std::string("bf16_as_float32_") + Float32ProjectionName(set.float32_projection);
  }
  return std::string("bf16_") + Bf16ProjectionName(set.bf16_projection) + "_" +
         Bf16KernelName(set.bf16_products);
}

std::vector<KernelSet> EveryKernelSet() {
  std::vector<KernelSet> sets;
  for (const Float32Projection projection : {Float32Projection::kOwn, Float32Projection::kOneDnn}) {
    sets.push_back({DType::kFloat32, projection});
    sets.push_back({DType::kBFloat16, projection, Bf16Projection::kFloat32, Bf16Kernel::kPortable,
                    /*bf16_as_float32_layer=*/true});
  }
  for (const Bf16Projection projection : kBf16Projections) {
    for (const Bf16Kernel products :
         {Bf16Kernel::kPortable, Bf16Kernel::kAvx512Bf16, Bf16Kernel::kAmx}) {
      sets.push_back({DType::kBFloat16, Float32Projection::kOwn, projection, products});
    }
  }
  return sets;
}

// Token counts of the neighbours: each side of the microkernel's tile heights, of AMX's
// 16-row threshold, of the 64 rows where float32 projections once switched kernels, of the
// 128-row chunks, and past the 256 rows where AVX2 hosts once switched to OpenBLAS.
constexpr int64_t kNeighbourRows[] = {1, 5, 16, 17, 63, 64, 65, 129, 300};

class BatchInvarianceTest : public ::testing::TestWithParam<KernelSet> {
 protected:
  void SetUp() override {
    const KernelSet& set = GetParam();
    if (set.layer_dtype == DType::kBFloat16 &&
        (!CpuSupports(set.bf16_projection) || !CpuSupports(set.bf16_products))) {
      GTEST_SKIP() << "this CPU does not run " << Bf16ProjectionName(set.bf16_projection)
                   << " projections or " << Bf16KernelName(set.bf16_products) << " products";
    }
    for (const int threads : {1, 2}) {
      CpuKernelChoice forced;
      forced.float32_projection = set.float32_projection;
      forced.bf16_projection = set.bf16_projection;
      forced.bf16_products = set.bf16_products;
      // Else a bf16 layer on float32 kernels runs its own path, as the flags let a server.
      forced.bf16_layers_as_float32 = set.bf16_as_float32_layer;
      backends_.push_back(std::make_shared<CpuBackend>(threads, forced));
    }
  }

  // Two layers of `config` (compute dtype set) with the same random weights: on 1 and on 2
  // threads.
  std::vector<std::shared_ptr<const MhaLayer>> Layers(MhaConfig config, std::mt19937_64& rng) {
    config.compute_dtype = GetParam().layer_dtype;
    auto resolved = MhaConfig::Resolve(config);
    EXPECT_TRUE(resolved.ok()) << resolved.status();
    const MhaWeights weights = MhaWeights::Random(*resolved, rng());
    std::vector<std::shared_ptr<const MhaLayer>> layers;
    for (const auto& backend : backends_) {
      auto layer = MhaLayer::Create(*resolved, weights, backend);
      EXPECT_TRUE(layer.ok()) << layer.status();
      if (layer.ok()) layers.push_back(*layer);
    }
    return layers;
  }

  std::vector<std::shared_ptr<const CpuBackend>> backends_;
};

// A request of `batch` sequences of `tokens` tokens with random embeddings (kept in
// `storage`), self-attention.
MhaInput Request(const MhaConfig& config, int64_t batch, int64_t tokens, bool causal,
                 std::mt19937_64& rng, std::vector<std::vector<float>>& storage) {
  storage.push_back(RandomFloats(rng, batch * tokens * config.embed_dim));
  MhaInput input;
  input.batch = batch;
  input.q_len = input.kv_len = tokens;
  input.query = storage.back();
  input.options.causal = causal;
  return input;
}

// The bits of `inputs[probe]`'s answer when `inputs` run as one forward pass on `layer`.
std::vector<uint32_t> AnswerBits(const MhaLayer& layer, const std::vector<MhaInput>& inputs,
                                 size_t probe) {
  std::vector<const MhaInput*> pointers;
  for (const MhaInput& input : inputs) pointers.push_back(&input);
  auto results = layer.ForwardBatch(pointers);
  EXPECT_TRUE(results.ok()) << results.status();
  if (!results.ok()) return {};
  const std::vector<float>& output = (*results)[probe].output;
  std::vector<uint32_t> bits(output.size());
  std::memcpy(bits.data(), output.data(), output.size() * sizeof(float));
  return bits;
}

// "" where `actual` has `expected`'s bits, else how many elements differ and the first.
std::string BitDifference(const std::vector<uint32_t>& expected,
                          const std::vector<uint32_t>& actual) {
  if (expected.size() != actual.size()) {
    return std::to_string(actual.size()) + " elements, not " + std::to_string(expected.size());
  }
  int64_t differing = 0, first = -1;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (expected[i] == actual[i]) continue;
    if (differing++ == 0) first = static_cast<int64_t>(i);
  }
  if (differing == 0) return "";
  float alone = 0, beside = 0;
  std::memcpy(&alone, &expected[first], sizeof(float));
  std::memcpy(&beside, &actual[first], sizeof(float));
  return std::to_string(differing) + " of " + std::to_string(expected.size()) +
         " elements differ; the first, [" + std::to_string(first) + "], is " +
         std::to_string(beside) + " against " + std::to_string(alone) + " alone";
}

// Each probe's answer alone on one thread against its answer beside every neighbour size,
// first and last, on two threads.
void ExpectSameBitsInEveryBatch(const std::vector<std::shared_ptr<const MhaLayer>>& layers,
                                const MhaConfig& config, std::mt19937_64& rng) {
  ASSERT_EQ(layers.size(), 2u);
  std::vector<std::vector<float>> storage;
  struct Probe {
    const char* name;
    int64_t batch, tokens;
    bool causal;
  };
  for (const Probe& probe : {Probe{"one token", 1, 1, false}, Probe{"five tokens", 1, 5, true},
                             Probe{"two sequences of three", 2, 3, false}}) {
    const MhaInput alone = Request(config, probe.batch, probe.tokens, probe.causal, rng, storage);
    const std::vector<uint32_t> expected = AnswerBits(*layers[0], {alone}, 0);
    ASSERT_FALSE(expected.empty());
    for (const int64_t rows : kNeighbourRows) {
      const MhaInput neighbour = Request(config, 1, rows, false, rng, storage);
      SCOPED_TRACE(std::string(probe.name) + " beside " + std::to_string(rows) + " rows");
      EXPECT_EQ(BitDifference(expected, AnswerBits(*layers[1], {alone, neighbour}, 0)), "")
          << "probe first";
      EXPECT_EQ(BitDifference(expected, AnswerBits(*layers[1], {neighbour, alone}, 1)), "")
          << "probe last";
    }
    EXPECT_EQ(BitDifference(expected, AnswerBits(*layers[1], {alone}, 0)), "")
        << probe.name << " on two threads";
    // Among many small callers, which a bf16 layer runs in groups, one thread each.
    std::vector<MhaInput> crowd;
    for (int i = 0; i < 24; ++i) crowd.push_back(Request(config, 1, 16, i % 2 == 0, rng, storage));
    crowd.insert(crowd.begin() + 5, alone);
    EXPECT_EQ(BitDifference(expected, AnswerBits(*layers[1], crowd, 5)), "")
        << probe.name << " among 24 callers of 16 tokens";
  }
}

// A session step's projections and output projection of one token alone against the same
// token among other sessions' rows (ProjectForDecode, ProjectDecodeOutput).
void ExpectSameDecodeBits(const std::vector<std::shared_ptr<const MhaLayer>>& layers,
                          std::mt19937_64& rng) {
  const MhaConfig& c = layers[0]->config();
  const std::vector<float> token = RandomFloats(rng, c.embed_dim);
  const std::vector<float> attended = RandomFloats(rng, c.AttentionWidth());
  struct Projected {
    std::vector<float> q, k, v, output;
  };
  const auto project = [&](const MhaLayer& layer, int64_t rows, int64_t at) {
    std::vector<float> x = RandomFloats(rng, rows * c.embed_dim);
    std::copy(token.begin(), token.end(), x.begin() + at * c.embed_dim);
    std::vector<float> attended_rows = RandomFloats(rng, rows * c.AttentionWidth());
    std::copy(attended.begin(), attended.end(), attended_rows.begin() + at * c.AttentionWidth());
    std::vector<int64_t> positions(rows, 3);
    Projected all{std::vector<float>(rows * c.QWidth()), std::vector<float>(rows * c.KWidth()),
                  std::vector<float>(rows * c.VWidth()), std::vector<float>(rows * c.output_dim)};
    EXPECT_TRUE(
        layer.ProjectForDecode(x.data(), positions, all.q.data(), all.k.data(), all.v.data()).ok());
    EXPECT_TRUE(layer.ProjectDecodeOutput(attended_rows.data(), rows, all.output.data()).ok());
    const auto row = [at](const std::vector<float>& m, int64_t width) {
      return std::vector<float>(m.begin() + at * width, m.begin() + (at + 1) * width);
    };
    return Projected{row(all.q, c.QWidth()), row(all.k, c.KWidth()), row(all.v, c.VWidth()),
                     row(all.output, c.output_dim)};
  };
  const auto bits = [](const std::vector<float>& v) {
    std::vector<uint32_t> b(v.size());
    std::memcpy(b.data(), v.data(), v.size() * sizeof(float));
    return b;
  };
  ASSERT_TRUE(layers[0]->DecodeSupport().ok()) << layers[0]->DecodeSupport();
  const Projected alone = project(*layers[0], 1, 0);
  for (const int64_t rows : kNeighbourRows) {
    SCOPED_TRACE("a session step beside " + std::to_string(rows) + " rows of other sessions");
    const Projected beside = project(*layers[1], rows + 1, rows / 2);
    EXPECT_EQ(BitDifference(bits(alone.q), bits(beside.q)), "") << "queries";
    EXPECT_EQ(BitDifference(bits(alone.k), bits(beside.k)), "") << "keys";
    EXPECT_EQ(BitDifference(bits(alone.v), bits(beside.v)), "") << "values";
    EXPECT_EQ(BitDifference(bits(alone.output), bits(beside.output)), "") << "output projection";
  }
}

// A GQA layer with RoPE whose depth crosses the microkernel's 64-deep sum blocks, with fused
// Q, K and V (self-attention).
MhaConfig FusedRopeConfig() {
  MhaConfig config;
  config.embed_dim = 192;
  config.num_heads = 6;
  config.num_kv_heads = 2;
  config.rope_theta = 10000.0;
  config.qkv_bias = true;
  config.output_bias = true;
  return config;
}

TEST_P(BatchInvarianceTest, LayerAnswersAreTheSameBitsInEveryBatch) {
  const uint64_t seed = TestSeed(55);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  const MhaConfig config = FusedRopeConfig();
  ExpectSameBitsInEveryBatch(Layers(config, rng), config, rng);
}

// Depth past the microkernel's 1,024-deep passes, and an output projection to another width.
TEST_P(BatchInvarianceTest, WideLayerAnswersAreTheSameBitsInEveryBatch) {
  const uint64_t seed = TestSeed(56);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  MhaConfig config;
  config.embed_dim = 1040;
  config.num_heads = 2;
  config.head_dim = 40;
  config.output_dim = 48;
  ExpectSameBitsInEveryBatch(Layers(config, rng), config, rng);
}

TEST_P(BatchInvarianceTest, SessionProjectionsAreTheSameBitsBesideOtherSessions) {
  const uint64_t seed = TestSeed(57);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  const MhaConfig config = FusedRopeConfig();
  ExpectSameDecodeBits(Layers(config, rng), rng);
}

// The projections' kernels at each SIMD level this host runs, not only its best: a row's bits
// at every row count and thread count are its bits alone (the microkernel's tile heights,
// 128-row chunks and splits by rows or by panels).
TEST(BatchInvarianceKernelTest, ProjectionRowsAreTheSameBitsAtEverySimdLevel) {
  const uint64_t seed = TestSeed(58);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  constexpr int64_t kIn = 150, kOut = 72;
  const std::vector<float> w = RandomFloats(rng, kOut * kIn), bias = RandomFloats(rng, kOut);
  std::vector<uint16_t> w_bf16(w.size());
  RoundToBf16(w.data(), static_cast<int64_t>(w.size()), w_bf16.data(), Bf16Kernel::kPortable);
  const PackedBf16Weight packed_bf16(w_bf16, kOut, kIn);
  ThreadPool one(1), two(2);
  const auto bits = [](const float* row) {
    std::vector<uint32_t> b(kOut);
    std::memcpy(b.data(), row, kOut * sizeof(float));
    return b;
  };
  for (const SimdLevel level : {SimdLevel::kPortable, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (!CpuSupports(level)) continue;
    SCOPED_TRACE(std::string("float32 microkernel, ") + SimdLevelName(level));
    std::vector<float> panels(PanelFloats(kIn, kOut));
    PackTransposed(w.data(), kOut, kIn, kIn, panels.data(), level);
    const std::vector<float> token = RandomFloats(rng, kIn);
    std::vector<float> alone(kOut);
    LinearForward(one, token.data(), 1, kIn, w, bias, kOut, alone.data(), panels.data(), level,
                  std::numeric_limits<int64_t>::max());
    for (const int64_t rows : kNeighbourRows) {
      std::vector<float> x = RandomFloats(rng, (rows + 1) * kIn), y((rows + 1) * kOut);
      std::copy(token.begin(), token.end(), x.begin() + rows * kIn);
      LinearForward(two, x.data(), rows + 1, kIn, w, bias, kOut, y.data(), panels.data(), level,
                    std::numeric_limits<int64_t>::max());
      EXPECT_EQ(BitDifference(bits(alone.data()), bits(y.data() + rows * kOut)), "")
          << "after " << rows << " rows";
    }
  }
  for (const Bf16Kernel kernel :
       {Bf16Kernel::kPortable, Bf16Kernel::kAvx512Bf16, Bf16Kernel::kAmx}) {
    if (!CpuSupports(kernel)) continue;
    SCOPED_TRACE(std::string("bf16 projection, ") + Bf16KernelName(kernel));
    std::vector<uint16_t> token(kIn);
    const std::vector<float> token_f32 = RandomFloats(rng, kIn);
    RoundToBf16(token_f32.data(), kIn, token.data(), Bf16Kernel::kPortable);
    std::vector<float> alone(kOut);
    LinearForwardBf16(one, token.data(), 1, kIn, packed_bf16, bias, kOut, alone.data(), kernel);
    for (const int64_t rows : kNeighbourRows) {
      const std::vector<float> x_f32 = RandomFloats(rng, (rows + 1) * kIn);
      std::vector<uint16_t> x((rows + 1) * kIn);
      RoundToBf16(x_f32.data(), static_cast<int64_t>(x.size()), x.data(), Bf16Kernel::kPortable);
      std::copy(token.begin(), token.end(), x.begin() + rows * kIn);
      std::vector<float> y((rows + 1) * kOut);
      LinearForwardBf16(two, x.data(), rows + 1, kIn, packed_bf16, bias, kOut, y.data(), kernel);
      EXPECT_EQ(BitDifference(bits(alone.data()), bits(y.data() + rows * kOut)), "")
          << "after " << rows << " rows";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KernelSets, BatchInvarianceTest, ::testing::ValuesIn(EveryKernelSet()),
                         KernelSetName);

}  // namespace
}  // namespace attention::core

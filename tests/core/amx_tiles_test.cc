// The AMX tile GEMM's blocking (core/cpu/amx_tiles.h) on every host, over the scalar model of
// the tile instructions: it must give the portable bf16 kernel's bits (both sum the same
// exact products in the same order) on every edge of its blocks. Where AMX runs, the
// hardware tiles must write exactly the model's elements and hold FlashAttention's rule
// against it (the hardware does not round after every product as the model does: 19% of
// one tile's sums differ in their last bits on a Xeon, family 6 model 167); elsewhere that test
// reports SKIPPED.
#include "core/cpu/amx_tiles.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/cpu/gemm_bf16.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "tests/core/fidelity.h"
#include "tests/core/random_options.h"

namespace attention::core {
namespace {

using testing::FidelityStats;
using testing::TestSeed;
using testing::UniformBf16;

// One GEMM of every block edge: rows around the 16-row tile and the 32-row block, depths
// around the 32-depth step (odd ones pair their last depth with zero), columns around the
// 16-wide panel, the two-panel block and the 16-panel pass, a range of panels, and the four
// epilogues.
struct TileCase {
  int64_t rows, depth, columns;
  int mode;  // 0: bias, 1: alpha 0.125, 2: accumulate, 3: bf16 output with bias
};

std::string Describe(const TileCase& t) {
  return "rows " + std::to_string(t.rows) + " depth " + std::to_string(t.depth) + " columns " +
         std::to_string(t.columns) + " mode " + std::to_string(t.mode);
}

// C (floats, or bf16 bits widened) after `multiply` with the case's operands (or, with
// `oracle`, the float64 answer there and 7 elsewhere); the columns outside the panel range
// and the padding past `columns` must keep their 7s.
template <typename Multiply>
std::vector<float> RunCase(const TileCase& t, uint64_t seed, Multiply multiply,
                           std::vector<double>* oracle = nullptr) {
  std::mt19937_64 rng(seed);
  const int64_t lda = t.depth + 3, ldw = t.depth + 1, ldc = t.columns + 2;
  const std::vector<uint16_t> a = UniformBf16(rng, t.rows * lda);
  const std::vector<uint16_t> w = UniformBf16(rng, t.columns * ldw);
  std::vector<float> bias(t.columns);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (float& b : bias) b = uniform(rng);
  std::vector<uint16_t> panels(Bf16PanelElements(t.depth, t.columns), 0xffff);
  PackBf16Transposed(w.data(), t.columns, t.depth, ldw, panels.data());
  std::vector<float> c(t.rows * ldc, 7.0f);
  std::vector<uint16_t> c_bf16(t.mode == 3 ? t.rows * ldc : 0, FloatToBFloat16(7.0f));
  const Bf16PanelGemm gemm{a.data(),
                           lda,
                           t.rows,
                           panels.data(),
                           t.depth,
                           t.columns,
                           t.columns > 32 ? 1 : 0,
                           PanelCount(t.columns),
                           t.mode == 1 ? 0.125f : 1.0f,
                           t.mode == 0 || t.mode == 3 ? bias.data() : nullptr,
                           t.mode == 3 ? nullptr : c.data(),
                           t.mode == 3 ? c_bf16.data() : nullptr,
                           ldc,
                           t.mode == 2};
  multiply(gemm);
  if (oracle != nullptr) {
    oracle->assign(c.size(), 7.0);
    for (int64_t r = 0; r < t.rows; ++r) {
      for (int64_t j = gemm.first_panel * kPanelWidth; j < t.columns; ++j) {
        double sum = 0;
        for (int64_t k = 0; k < t.depth; ++k) {
          sum += static_cast<double>(BFloat16ToFloat(a[r * lda + k])) *
                 BFloat16ToFloat(w[j * ldw + k]);
        }
        const double addend = gemm.accumulate ? 7.0 : gemm.bias != nullptr ? bias[j] : 0.0;
        (*oracle)[r * ldc + j] = gemm.alpha * sum + addend;
      }
    }
  }
  if (t.mode == 3) {
    for (size_t i = 0; i < c.size(); ++i) c[i] = BFloat16ToFloat(c_bf16[i]);
  }
  return c;
}

std::vector<TileCase> EdgeCases() {
  std::vector<TileCase> cases;
  int mode = 0;
  for (int64_t rows : {1, 15, 16, 17, 32, 33, 70}) {
    for (int64_t depth : {1, 2, 31, 32, 33, 64, 80, 130}) {
      for (int64_t columns : {1, 16, 17, 33, 64, 72}) {
        cases.push_back({rows, depth, columns, mode});
        mode = (mode + 1) % 4;
      }
    }
  }
  // Past one pass of panels (16): 18 and 33 panels, a partial pass last.
  for (int64_t columns : {273, 528}) {
    for (int64_t rows : {17, 70}) cases.push_back({rows, 130, columns, mode++ % 4});
  }
  return cases;
}

// The portable kernel through GemmBf16Panels: the same GEMM in plain loops.
void Portable(const Bf16PanelGemm& g) {
  if (g.c_bf16 != nullptr) {
    GemmBf16PanelsToBf16(Bf16Kernel::kPortable, g.a, g.lda, g.rows, g.panels, g.depth, g.columns,
                         g.first_panel, g.end_panel, g.alpha, g.bias, g.c_bf16, g.ldc);
    return;
  }
  GemmBf16Panels(Bf16Kernel::kPortable, g.a, g.lda, g.rows, g.panels, g.depth, g.columns,
                 g.first_panel, g.end_panel, g.alpha, g.bias, g.c, g.ldc, g.accumulate);
}

TEST(AmxTilesTest, EmulatedTilesGiveThePortableKernelsBitsOnEveryBlockEdge) {
  const uint64_t seed = TestSeed(3901);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  for (const TileCase& t : EdgeCases()) {
    SCOPED_TRACE(Describe(t));
    const std::vector<float> emulated = RunCase(t, seed, GemmBf16AmxEmulated);
    const std::vector<float> portable = RunCase(t, seed, Portable);
    ASSERT_EQ(emulated, portable);
  }
}

TEST(AmxTilesTest, HardwareTilesHoldTheRuleAgainstTheModelOnEveryBlockEdge) {
  if (!AmxTilesUsable()) GTEST_SKIP() << "no AMX here: " << AmxUnavailableReason();
  const uint64_t seed = TestSeed(3902);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  FidelityStats stats("AMX tiles against their model");
  for (const TileCase& t : EdgeCases()) {
    SCOPED_TRACE(Describe(t));
    std::vector<double> oracle;
    const std::vector<float> hardware = RunCase(t, seed, GemmBf16Amx, &oracle);
    const std::vector<float> emulated = RunCase(t, seed, GemmBf16AmxEmulated);
    for (size_t i = 0; i < hardware.size(); ++i) {
      if (oracle[i] != 7.0) continue;  // outside the panel range or past the columns
      ASSERT_EQ(hardware[i], 7.0f) << "element " << i << " was written";
      ASSERT_EQ(emulated[i], 7.0f) << "element " << i << " was written";
    }
    if (t.mode == 3) continue;  // rounded to bf16: the rule is for the float32 sums
    EXPECT_TRUE(stats.Check(hardware, emulated, oracle));
  }
}

TEST(AmxTilesTest, ReasonIsGivenExactlyWhenTilesAreUnusable) {
  EXPECT_EQ(AmxUnavailableReason().empty(), AmxTilesUsable());
  EXPECT_EQ(CpuSupports(Bf16Kernel::kAmx), AmxTilesUsable());
  EXPECT_STREQ(Bf16KernelName(Bf16Kernel::kAmx), "amx");
}

}  // namespace
}  // namespace attention::core

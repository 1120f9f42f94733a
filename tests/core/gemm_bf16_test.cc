// The CPU backend's bfloat16 GEMM (core/cpu/gemm_bf16.h) against a naive double-precision
// GEMM of the same bf16 values, for every kernel; one this CPU lacks reports SKIPPED.
#include "core/cpu/gemm_bf16.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/cpu/bf16_linear.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "tests/core/fidelity.h"
#include "tests/core/random_options.h"

namespace attention::core {
namespace {

using testing::FidelityStats;
using testing::TestSeed;
using testing::UniformBf16;

float Widen(uint16_t bits) { return BFloat16ToFloat(bits); }

class GemmBf16Test : public ::testing::TestWithParam<Bf16Kernel> {
 protected:
  void SetUp() override {
    if (!CpuSupports(GetParam())) {
      GTEST_SKIP() << "this CPU has no " << Bf16KernelName(GetParam()) << " instructions";
    }
  }
};

// Rows around the tile height (12) and past a row chunk (128), columns around the 16-wide
// panel and its pairs, odd depths (a last depth paired with zero); a range of panels only,
// bias or accumulation, alpha not 1. The float32 textbook sums the same bf16 products in
// order; both are compared with the float64 sum by FlashAttention's rule.
TEST_P(GemmBf16Test, PanelsMatchNaiveGemmOfTheSameBf16Values) {
  const uint64_t seed = TestSeed(2601);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  FidelityStats stats(std::string("bf16 panels, ") + Bf16KernelName(GetParam()));
  for (int64_t rows : {1, 5, 12, 13, 25, 200}) {
    for (int64_t columns : {1, 15, 16, 17, 32, 40, 64, 80}) {
      for (int64_t depth : {1, 2, 3, 64, 767}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " columns " + std::to_string(columns) +
                     " depth " + std::to_string(depth));
        const int64_t lda = depth + 3, ldw = depth + 1, ldc = columns + 2;
        const std::vector<uint16_t> a = UniformBf16(rng, rows * lda);
        const std::vector<uint16_t> w = UniformBf16(rng, columns * ldw);
        std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
        std::vector<float> bias(columns);
        for (float& b : bias) b = uniform(rng);
        const int mode = static_cast<int>((rows + columns + depth) % 3);  // bias, none, +=
        const float alpha = mode == 1 ? 0.125f : 1.0f;
        std::vector<uint16_t> panels(Bf16PanelElements(depth, columns), 0xffff);
        PackBf16Transposed(w.data(), columns, depth, ldw, panels.data());
        const int64_t first_panel = columns > 32 ? 1 : 0, end_panel = PanelCount(columns);
        std::vector<float> c(rows * ldc, 7.0f);
        GemmBf16Panels(GetParam(), a.data(), lda, rows, panels.data(), depth, columns, first_panel,
                       end_panel, alpha, mode == 0 ? bias.data() : nullptr, c.data(), ldc,
                       mode == 2);
        std::vector<float> fast, textbook;
        std::vector<double> oracle;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < ldc; ++j) {
            const float got = c[r * ldc + j];
            if (j < first_panel * kPanelWidth || j >= columns) {
              ASSERT_EQ(got, 7.0f) << "row " << r << " column " << j << " was written";
              continue;
            }
            double sum = 0;
            float float_sum = 0;
            for (int64_t k = 0; k < depth; ++k) {
              const float product = Widen(a[r * lda + k]) * Widen(w[j * ldw + k]);
              sum += product;  // exact: bf16 products fit a float
              float_sum += product;
            }
            const float addend = mode == 0 ? bias[j] : mode == 2 ? 7.0f : 0.0f;
            fast.push_back(got);
            textbook.push_back(alpha * float_sum + addend);
            oracle.push_back(alpha * sum + addend);
          }
        }
        EXPECT_TRUE(stats.Check(fast, textbook, oracle));
        if (mode == 2) continue;
        // Written in bf16 instead: each element the float32 answer rounded, nothing else
        // touched.
        std::vector<uint16_t> c_bf16(rows * ldc, 0x7777);
        GemmBf16PanelsToBf16(GetParam(), a.data(), lda, rows, panels.data(), depth, columns,
                             first_panel, end_panel, alpha, mode == 0 ? bias.data() : nullptr,
                             c_bf16.data(), ldc);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < ldc; ++j) {
            const bool written = j >= first_panel * kPanelWidth && j < columns;
            ASSERT_EQ(c_bf16[r * ldc + j], written ? FloatToBFloat16(c[r * ldc + j]) : 0x7777)
                << "row " << r << " column " << j;
          }
        }
      }
    }
  }
}

// The projection on 1 and 2 threads, split by columns (few rows) and by rows.
TEST_P(GemmBf16Test, LinearForwardMatchesNaiveOnBothSplits) {
  const uint64_t seed = TestSeed(2602);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  FidelityStats stats(std::string("LinearForwardBf16, ") + Bf16KernelName(GetParam()));
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    for (int64_t rows : {1, 9, 40, 300}) {
      for (int64_t out_features : {8, 40, 100}) {
        const int64_t in = 45;
        SCOPED_TRACE("threads " + std::to_string(threads) + " rows " + std::to_string(rows) +
                     " out " + std::to_string(out_features));
        const std::vector<uint16_t> x = UniformBf16(rng, rows * in);
        const std::vector<uint16_t> w = UniformBf16(rng, out_features * in);
        std::vector<float> bias(out_features, 0.5f);
        const PackedBf16Weight packed(w, out_features, in);
        std::vector<float> y(rows * out_features, 7.0f);
        LinearForwardBf16(pool, x.data(), rows, in, packed, bias, out_features, y.data(),
                          GetParam());
        std::vector<float> textbook;
        std::vector<double> oracle;
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t j = 0; j < out_features; ++j) {
            double sum = 0;
            float float_sum = 0;
            for (int64_t k = 0; k < in; ++k) {
              const float product = Widen(x[r * in + k]) * Widen(w[j * in + k]);
              sum += product;
              float_sum += product;
            }
            textbook.push_back(float_sum + 0.5f);
            oracle.push_back(sum + 0.5);
          }
        }
        EXPECT_TRUE(stats.Check(y, textbook, oracle));
        std::vector<uint16_t> y_bf16(rows * out_features, 0x7777);
        LinearForwardBf16(pool, x.data(), rows, in, packed, bias, out_features, y_bf16.data(),
                          GetParam());
        for (int64_t e = 0; e < rows * out_features; ++e) {
          ASSERT_EQ(y_bf16[e], FloatToBFloat16(y[e])) << "element " << e << ", written in bf16";
        }
      }
    }
  }
}

// Float32 operands packed with rounding (attention's keys, depth_stride 1, and values,
// column_stride 1), and bf16 operands packed as they are: the same bits as rounding each
// element and packing it one by one.
TEST_P(GemmBf16Test, PacksFloatOperandsAsRoundedElements) {
  const uint64_t seed = TestSeed(2604);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  for (int64_t depth : {1, 2, 3, 15, 31, 32, 33, 64, 65, 130}) {
    for (int64_t columns : {1, 15, 16, 17, 40}) {
      for (bool transposed : {true, false}) {
        SCOPED_TRACE("depth " + std::to_string(depth) + " columns " + std::to_string(columns) +
                     (transposed ? " keys" : " values"));
        const int64_t stride = (transposed ? depth : columns) + 3;
        std::vector<float> b((transposed ? columns : depth) * stride);
        for (float& v : b) v = uniform(rng);
        const int64_t depth_stride = transposed ? 1 : stride;
        const int64_t column_stride = transposed ? stride : 1;
        std::vector<uint16_t> packed(Bf16PanelElements(depth, columns), 0xffff);
        PackBf16Panels(b.data(), depth, columns, depth_stride, column_stride, packed.data(),
                       GetParam());
        std::vector<uint16_t> expected(packed.size(), 0);
        for (int64_t j = 0; j < columns; ++j) {
          for (int64_t k = 0; k < depth; ++k) {
            const int64_t panel = j / kPanelWidth, column = j % kPanelWidth;
            expected[panel * ((depth + 1) / 2) * 2 * kPanelWidth + (k / 2) * 2 * kPanelWidth +
                     2 * column + k % 2] = FloatToBFloat16(b[k * depth_stride + j * column_stride]);
          }
        }
        ASSERT_EQ(packed, expected);
        // The same operand already in bf16 packs to the same bits.
        std::vector<uint16_t> b_bf16(b.size());
        for (size_t e = 0; e < b.size(); ++e) b_bf16[e] = FloatToBFloat16(b[e]);
        std::vector<uint16_t> packed_bf16(packed.size(), 0xffff);
        PackBf16Panels(b_bf16.data(), depth, columns, depth_stride, column_stride,
                       packed_bf16.data(), GetParam());
        ASSERT_EQ(packed_bf16, expected);
      }
    }
  }
}

// Rounding to bf16: to nearest even, NaN stays NaN, the same on every kernel (the SIMD
// one covers 16 at a time and the rest one by one).
TEST_P(GemmBf16Test, RoundsToNearestEvenAsTheWireDoes) {
  const uint64_t seed = TestSeed(2603);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
  std::vector<float> x(37);
  for (float& v : x) v = uniform(rng);
  x[3] = 1.0f + 1.0f / 256;  // a tie: stays 1
  x[4] = 1.0f + 3.0f / 256;  // a tie: rounds up to even
  x[20] = std::numeric_limits<float>::quiet_NaN();
  std::vector<uint16_t> rounded(x.size());
  RoundToBf16(x.data(), static_cast<int64_t>(x.size()), rounded.data(), GetParam());
  for (size_t i = 0; i < x.size(); ++i) {
    SCOPED_TRACE("element " + std::to_string(i));
    if (i == 20) {
      EXPECT_TRUE(std::isnan(Widen(rounded[i])));
      continue;
    }
    EXPECT_EQ(rounded[i], FloatToBFloat16(x[i]));
  }
  EXPECT_EQ(Widen(rounded[3]), 1.0f);
  EXPECT_EQ(Widen(rounded[4]), 1.0f + 4.0f / 256);
}

INSTANTIATE_TEST_SUITE_P(Kernels, GemmBf16Test,
                         ::testing::Values(Bf16Kernel::kPortable, Bf16Kernel::kAvx512Bf16,
                                           Bf16Kernel::kAmx),
                         [](const ::testing::TestParamInfo<Bf16Kernel>& info) {
                           return std::string(Bf16KernelName(info.param));
                         });

// The projection kernels of bf16 layers (core/cpu/bf16_linear.h): oneDNN's matmul (AMX
// tiles where the CPU has them), this project's AMX tiles, the avx512_bf16 panels and the
// float32 fallback, each
// against the float64 sum of the same bf16 products by FlashAttention's rule, with and
// without a bias, on one thread and two, in float32 and rounded to bf16.
class Bf16LinearTest : public ::testing::TestWithParam<Bf16Projection> {
 protected:
  void SetUp() override {
    if (!CpuSupports(GetParam())) {
      GTEST_SKIP() << "this CPU has no " << Bf16ProjectionName(GetParam()) << " instructions";
    }
  }
};

TEST_P(Bf16LinearTest, EveryKernelSumsTheSameBf16ProductsByTheRule) {
  const uint64_t seed = TestSeed(3901);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  FidelityStats stats(std::string("Bf16Linear, ") + Bf16ProjectionName(GetParam()));
  for (const int threads : {1, 2}) {
    ThreadPool pool(threads);
    // Rows around oneDNN's and the panels' blocks; depths odd and past a tile's 32.
    for (const int64_t rows : {1, 9, 40, 300}) {
      for (const auto& [in, out] : std::vector<std::pair<int64_t, int64_t>>{{45, 8}, {96, 100}}) {
        for (const bool with_bias : {false, true}) {
          SCOPED_TRACE("threads " + std::to_string(threads) + " rows " + std::to_string(rows) +
                       " in " + std::to_string(in) + " out " + std::to_string(out) +
                       (with_bias ? " with bias" : ""));
          const std::vector<uint16_t> x = UniformBf16(rng, rows * in);
          const std::vector<uint16_t> w = UniformBf16(rng, out * in);
          std::vector<float> bias;
          if (with_bias) bias.assign(out, 0.5f);
          const Bf16Linear linear(w, out, in, GetParam());
          std::vector<float> y(rows * out, 7.0f);
          linear.Forward(pool, x.data(), rows, bias, y.data());
          std::vector<float> textbook;
          std::vector<double> oracle;
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = 0; j < out; ++j) {
              double sum = with_bias ? 0.5 : 0.0;
              float float_sum = 0;
              for (int64_t k = 0; k < in; ++k) {
                const float product =
                    BFloat16ToFloat(x[r * in + k]) * BFloat16ToFloat(w[j * in + k]);
                sum += product;
                float_sum += product;
              }
              textbook.push_back(float_sum + (with_bias ? 0.5f : 0.0f));
              oracle.push_back(sum);
            }
          }
          EXPECT_TRUE(stats.Check(y, textbook, oracle));
          if (!linear.WritesBf16()) continue;
          std::vector<uint16_t> y_bf16(rows * out, 0x7777);
          linear.Forward(pool, x.data(), rows, bias, y_bf16.data());
          for (int64_t e = 0; e < rows * out; ++e) {
            ASSERT_EQ(y_bf16[e], FloatToBFloat16(y[e])) << "element " << e << ", written in bf16";
          }
        }
      }
    }
  }
}

TEST(Bf16ProjectionTest, NamesParseAndTheMeasuredChoiceRunsHere) {
  for (const Bf16Projection projection : kBf16Projections) {
    EXPECT_EQ(*ParseBf16Projection(Bf16ProjectionName(projection)), projection);
  }
  const absl::StatusOr<Bf16Projection> unknown = ParseBf16Projection("tpu");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.status().message(),
            "bf16 kernel \"tpu\" is not one of onednn, amx, avx512_bf16, float32");
  EXPECT_TRUE(CpuSupports(FastestBf16Projection()));
  // The report names every kernel this host runs, with its speed.
  const std::string report = Bf16ProjectionReport();
  EXPECT_EQ(report.find("onednn ") != std::string::npos, CpuSupports(Bf16Projection::kOneDnn))
      << report;
  EXPECT_NE(report.find("float32 "), std::string::npos) << report;
  EXPECT_EQ(report.find("avx512_bf16 ") != std::string::npos,
            CpuSupports(Bf16Projection::kAvx512Bf16))
      << report;
  EXPECT_EQ(report.find("amx ") != std::string::npos, CpuSupports(Bf16Projection::kAmx)) << report;
}

INSTANTIATE_TEST_SUITE_P(Kernels, Bf16LinearTest, ::testing::ValuesIn(kBf16Projections),
                         [](const ::testing::TestParamInfo<Bf16Projection>& info) {
                           return std::string(Bf16ProjectionName(info.param));
                         });

}  // namespace
}  // namespace attention::core

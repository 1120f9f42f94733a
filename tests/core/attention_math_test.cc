// The per-element maths every backend shares (core/attention_math.h), checked on the host:
// the CUDA kernels compile the same functions for the device.
#include "core/attention_math.h"

#include <cmath>
#include <random>
#include <vector>

#include "core/attention_options.h"
#include "core/half_bits.h"
#include "core/cpu/cpu_backend.h"
#include "gtest/gtest.h"
#include "tests/core/random_options.h"

namespace attention::core {
namespace {

TEST(MaskViewTest, CausalIsBottomRightAlignedAndKeyLengthsCap) {
  MaskView mask;
  mask.batch = 2;
  mask.q_len = 2;
  mask.kv_len = 4;
  mask.causal = true;
  EXPECT_EQ(mask.KeyLimit(0, 0), 3);  // query 0 sees keys 0..2
  EXPECT_EQ(mask.KeyLimit(0, 1), 4);
  const int64_t lengths[] = {2, 4};
  mask.key_lengths = lengths;
  EXPECT_EQ(mask.KeyLimit(0, 1), 2);
  EXPECT_EQ(mask.KeyLimit(1, 0), 3);
  EXPECT_EQ(mask.ScoreBias(0, 0, 1, 2), -INFINITY);
  EXPECT_EQ(mask.ScoreBias(0, 0, 1, 1), 0.0f);
  // More queries than keys: the first rows see nothing.
  MaskView tall;
  tall.q_len = 5;
  tall.kv_len = 2;
  tall.causal = true;
  EXPECT_EQ(tall.KeyLimit(0, 0), 0);
  EXPECT_EQ(tall.KeyLimit(0, 3), 1);
  EXPECT_EQ(tall.KeyLimit(0, 4), 2);
}

TEST(MaskViewTest, BroadcastMaskIndexing) {
  // A [Nq, Nk] = [2, 3] additive mask broadcast over B = 2 and H = 2.
  const float bias[] = {0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f};
  MaskView mask;
  mask.batch = 2;
  mask.num_heads = 2;
  mask.q_len = 2;
  mask.kv_len = 3;
  mask.attn_mask_dims[2] = 2;
  mask.attn_mask_dims[3] = 3;
  mask.attn_mask_bias = bias;
  EXPECT_TRUE(mask.HasElementMasks());
  EXPECT_EQ(mask.ScoreBias(1, 1, 1, 2), 5.5f);
  EXPECT_EQ(mask.ScoreBias(0, 1, 0, 1), 1.5f);
  const uint8_t padding[] = {1, 0, 1, 1, 1, 1};
  mask.key_padding_keep = padding;
  EXPECT_EQ(mask.ScoreBias(0, 1, 0, 1), -INFINITY);
  EXPECT_EQ(mask.ScoreBias(1, 1, 0, 1), 1.5f);
}

TEST(MaskViewTest, MatchesTheOptionsItIsMadeFrom) {
  const uint64_t seed = testing::TestSeed(5);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 50; ++trial) {
    const AttentionDims dims{2, 3, 1, 4, 5, 2, 2};
    const AttentionOptions options = testing::RandomOptions(rng, dims);
    const MaskView view = options.View(dims);
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t i = 0; i < 4; ++i) {
        int64_t attended = 0;
        for (int64_t j = 0; j < 5; ++j) attended += view.ScoreBias(b, 0, i, j) != -INFINITY;
        // No key past the limit is ever attended.
        EXPECT_LE(attended, view.KeyLimit(b, i)) << testing::Describe(dims, options);
      }
    }
  }
}

// One sequence's options (a batch split into sequences, core/cpu/bf16_layer.cc) mask every
// score as the batch's options mask that sequence's, and keep the scalar options.
TEST(MaskViewTest, OneSequenceMasksAsItsRowOfTheBatch) {
  const uint64_t seed = testing::TestSeed(6);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 100; ++trial) {
    const AttentionDims dims{3, 2, 1, 4, 5, 2, 2};
    AttentionDims one_dims = dims;
    one_dims.batch = 1;
    const AttentionOptions options = testing::RandomOptions(rng, dims);
    const MaskView view = options.View(dims);
    for (int64_t b = 0; b < dims.batch; ++b) {
      const AttentionOptions one = options.OneSequence(dims, b);
      EXPECT_EQ(one.causal, options.causal);
      EXPECT_EQ(one.scale, options.scale);
      EXPECT_EQ(one.need_weights, options.need_weights);
      EXPECT_EQ(one.dropout_p, options.dropout_p);
      ASSERT_TRUE(one.Validate(one_dims).ok()) << one.Validate(one_dims);
      const MaskView one_view = one.View(one_dims);
      for (int64_t h = 0; h < dims.num_heads; ++h) {
        for (int64_t i = 0; i < dims.q_len; ++i) {
          EXPECT_EQ(one_view.KeyLimit(0, i), view.KeyLimit(b, i));
          for (int64_t j = 0; j < dims.kv_len; ++j) {
            EXPECT_EQ(one_view.ScoreBias(0, h, i, j), view.ScoreBias(b, h, i, j))
                << "sequence " << b << " head " << h << " query " << i << " key " << j << ": "
                << testing::Describe(dims, options);
          }
        }
      }
    }
  }
}

TEST(OnlineSoftmaxRowTest, BlockwiseEqualsOnePass) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> scores(100);
  for (float& s : scores) s = normal(rng);
  scores[7] = -INFINITY;  // a masked key
  float max = -INFINITY;
  for (float s : scores) max = std::max(max, s);
  double sum = 0.0;
  for (float s : scores) sum += std::exp(static_cast<double>(s) - max);
  // Blocks of 32 with a running accumulator of sum_j exp(s_j - m) * j.
  OnlineSoftmaxRow row;
  float weighted = 0.0f;
  for (size_t first = 0; first < scores.size(); first += 32) {
    float block_max = -INFINITY;
    for (size_t j = first; j < std::min(first + 32, scores.size()); ++j) {
      block_max = std::max(block_max, scores[j]);
    }
    weighted *= row.Rescale(block_max);
    for (size_t j = first; j < std::min(first + 32, scores.size()); ++j) {
      const float p = std::exp(scores[j] - row.max);
      row.sum += p;
      weighted += p * static_cast<float>(j);
    }
  }
  EXPECT_EQ(row.max, max);
  EXPECT_NEAR(row.sum, sum, 1e-4 * sum);
  double expected = 0.0;
  for (size_t j = 0; j < scores.size(); ++j) expected += std::exp(scores[j] - max) * j / sum;
  EXPECT_NEAR(weighted * row.InverseSum(), expected, 1e-3);
}

TEST(OnlineSoftmaxRowTest, FullyMaskedRowNormalisesToZero) {
  OnlineSoftmaxRow row;
  EXPECT_EQ(row.Rescale(-INFINITY), 1.0f);
  EXPECT_EQ(row.sum, 0.0f);
  EXPECT_EQ(row.InverseSum(), 0.0f);
  EXPECT_EQ(row.Rescale(2.0f), 0.0f);  // nothing accumulated yet: scaled away
  EXPECT_EQ(row.Rescale(1.0f), 1.0f);  // a smaller block maximum changes nothing
}

TEST(RotaryAngleTest, MatchesTheCpuRotation) {
  // One head of dk = 8 at positions 0..4: rotating through ApplyRotary and by hand with
  // RotaryAngle agree exactly.
  std::vector<float> data(5 * 8);
  for (size_t e = 0; e < data.size(); ++e) data[e] = 0.1f * static_cast<float>(e) - 1.0f;
  std::vector<float> rotated = data;
  ApplyRotary(rotated.data(), 5, 5, 1, 8, 10000.0, 8);
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t c = 0; c < 4; ++c) {
      float cos_a, sin_a;
      RotaryAngle(r, c, 8, 10000.0, RopeScaling{}, &cos_a, &sin_a);
      const float x1 = data[r * 8 + c], x2 = data[r * 8 + c + 4];
      EXPECT_EQ(rotated[r * 8 + c], x1 * cos_a - x2 * sin_a) << r << " " << c;
      EXPECT_EQ(rotated[r * 8 + c + 4], x2 * cos_a + x1 * sin_a) << r << " " << c;
    }
  }
  // A batch: 3 sequences of 300 positions, 3 heads of dk = 16 in padded rows, on 2 threads
  // (rows in tasks of 256, angles computed once for the batch): still exactly by hand.
  constexpr int64_t kRows = 900, kSeqLen = 300, kHeads = 3, kDk = 16, kStride = 50;
  std::vector<float> batch(kRows * kStride);
  for (size_t e = 0; e < batch.size(); ++e) batch[e] = std::sin(0.37f * static_cast<float>(e));
  std::vector<float> batch_rotated = batch;
  ThreadPool pool(2);
  ApplyRotary(batch_rotated.data(), kRows, kSeqLen, kHeads, kDk,
              RotaryAngles::FirstPositions(kSeqLen, kDk, 500.0, RopeScaling{}), kStride, &pool);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int64_t c = 0; c < kDk / 2; ++c) {
        float cos_a, sin_a;
        RotaryAngle(r % kSeqLen, c, kDk, 500.0, RopeScaling{}, &cos_a, &sin_a);
        const int64_t at = r * kStride + h * kDk + c;
        const float x1 = batch[at], x2 = batch[at + kDk / 2];
        ASSERT_EQ(batch_rotated[at], x1 * cos_a - x2 * sin_a) << r << " " << h << " " << c;
        ASSERT_EQ(batch_rotated[at + kDk / 2], x2 * cos_a + x1 * sin_a)
            << r << " " << h << " " << c;
      }
    }
    for (int64_t e = kHeads * kDk; e < kStride; ++e) {
      ASSERT_EQ(batch_rotated[r * kStride + e], batch[r * kStride + e]) << "padding touched";
    }
  }
}

TEST(RotaryScalingTest, Llama3KeepsHighFrequenciesDividesLowOnesAndRampsBetween) {
  // dk = 16, theta 10000: frequencies 10000^(-c/8), wavelengths 2 pi / frequency. With an
  // original context of 64, low_freq_factor 1 and high_freq_factor 4, wavelengths below 16
  // are kept, above 64 divided by 8, and in between interpolated (transformers' formula).
  RopeScaling llama3;
  llama3.type = RopeScaling::kLlama3;
  llama3.factor = 8.0;
  llama3.low_freq_factor = 1.0;
  llama3.high_freq_factor = 4.0;
  llama3.original_max_positions = 64;
  const double pi = 3.14159265358979323846;
  int kept = 0, divided = 0, ramped = 0;
  for (int64_t c = 0; c < 8; ++c) {
    const double frequency = std::pow(10000.0, -2.0 * c / 16);
    const double wavelength = 2 * pi / frequency;
    const double scaled = RotaryInverseFrequency(c, 16, 10000.0, llama3);
    if (wavelength < 16) {
      EXPECT_DOUBLE_EQ(scaled, frequency) << c;
      ++kept;
    } else if (wavelength > 64) {
      EXPECT_DOUBLE_EQ(scaled, frequency / 8) << c;
      ++divided;
    } else {
      const double smooth = (64 / wavelength - 1.0) / 3.0;
      EXPECT_DOUBLE_EQ(scaled, (1 - smooth) * frequency / 8 + smooth * frequency) << c;
      EXPECT_LT(scaled, frequency);
      EXPECT_GT(scaled, frequency / 8);
      ++ramped;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(ramped, 0);
}

TEST(RotaryScalingTest, LinearDividesAndDynamicGrowsTheBasePastTheContext) {
  RopeScaling linear;
  linear.type = RopeScaling::kLinear;
  linear.factor = 4.0;
  EXPECT_DOUBLE_EQ(RotaryInverseFrequency(3, 16, 10000.0, linear),
                   std::pow(10000.0, -6.0 / 16) / 4);
  RopeScaling dynamic;
  dynamic.type = RopeScaling::kDynamic;
  dynamic.factor = 2.0;
  dynamic.original_max_positions = 64;
  EXPECT_EQ(RotaryBase(10000.0, dynamic, 64, 16), 10000.0);  // within the context: unchanged
  // 2 * 100 / 64 - 1 = 2.125, to the power 16 / 14.
  EXPECT_DOUBLE_EQ(RotaryBase(10000.0, dynamic, 100, 16), 10000.0 * std::pow(2.125, 16.0 / 14));
  EXPECT_EQ(RotaryBase(10000.0, linear, 100, 16), 10000.0);
  EXPECT_DOUBLE_EQ(RotaryInverseFrequency(3, 16, 500.0, dynamic), std::pow(500.0, -6.0 / 16));
}

TEST(MaskViewTest, SlidingWindowKeepsTheLastKeysUpToTheFrontier) {
  MaskView mask;
  mask.q_len = 3, mask.kv_len = 6, mask.causal = true, mask.sliding_window = 2;
  EXPECT_TRUE(mask.HasElementMasks());
  // Query 0 sits at position 3 (bottom-right aligned): keys 2 and 3.
  for (int64_t j = 0; j < 6; ++j) {
    EXPECT_EQ(mask.ScoreBias(0, 0, 0, j), (j == 2 || j == 3) ? 0.0f : -INFINITY) << j;
    EXPECT_EQ(mask.ScoreBias(0, 0, 2, j), (j == 4 || j == 5) ? 0.0f : -INFINITY) << j;
  }
}

TEST(HalfBitsTest, NonFiniteFromTheExponentBits) {
  EXPECT_TRUE(HalfBitsNonFinite(0x7c00, false));   // +inf
  EXPECT_TRUE(HalfBitsNonFinite(0xfe00, false));   // NaN
  EXPECT_FALSE(HalfBitsNonFinite(0x7bff, false));  // 65504
  EXPECT_TRUE(HalfBitsNonFinite(0xff80, true));    // bfloat16 -inf
  EXPECT_FALSE(HalfBitsNonFinite(0x7f7f, true));   // bfloat16 max
  EXPECT_EQ(HalfBitsToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfBitsToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(BFloat16BitsToFloat(0xc040), -3.0f);
}

TEST(DropoutKeysTest, DependOnEveryCoordinateAndTheSeed) {
  // Flipping any one coordinate or the seed changes which weights survive.
  int differs[6] = {};
  for (int j = 0; j < 2000; ++j) {
    const bool base = DropoutKeeps(3, 0.5f, 1, 2, 3, j);
    differs[0] += base != DropoutKeeps(4, 0.5f, 1, 2, 3, j);
    differs[1] += base != DropoutKeeps(3, 0.5f, 0, 2, 3, j);
    differs[2] += base != DropoutKeeps(3, 0.5f, 1, 1, 3, j);
    differs[3] += base != DropoutKeeps(3, 0.5f, 1, 2, 2, j);
    differs[4] += base != DropoutKeeps(3, 0.5f, 1, 2, 3, j + 2000);
    differs[5] += base != DropoutKeeps(3, 0.5f, 1, 2, 3, j);
  }
  for (int k = 0; k < 5; ++k) EXPECT_NEAR(differs[k], 1000, 150) << "coordinate " << k;
  EXPECT_EQ(differs[5], 0);
}

}  // namespace
}  // namespace attention::core

// The CUDA kernels' tiling and launch plan: host-side logic, checked on any machine.
#include "core/cuda/launch_plan.h"

#include <set>
#include <tuple>
#include <utility>

#include "gtest/gtest.h"

namespace attention::core::cuda {
namespace {

constexpr int64_t kH100SharedBytes = 227 << 10;

TEST(FlashLaunchPlanTest, CoversEveryQueryBlockOfEveryHeadOnce) {
  const AttentionShape shape{3, 5, 5, 70, 9, 64, 64};
  const FlashLaunchPlan plan = PlanFlashAttention(shape, false);
  EXPECT_EQ(plan.query_blocks, 3);  // 70 rows in blocks of 32
  EXPECT_EQ(plan.blocks, 3 * 5 * 3);
  std::set<std::tuple<int64_t, int64_t, int64_t>> seen;
  for (int64_t block = 0; block < plan.blocks; ++block) {
    const FlashBlock decoded = DecodeFlashBlock(block, plan.query_blocks, shape.num_heads);
    EXPECT_LT(decoded.batch_index, 3);
    EXPECT_LT(decoded.head, 5);
    EXPECT_LT(decoded.first_row, 70);
    EXPECT_EQ(decoded.first_row % kFlashRowsPerBlock, 0);
    seen.insert({decoded.batch_index, decoded.head, decoded.first_row});
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), plan.blocks);
  EXPECT_EQ(plan.weight_blocks, 0);
}

TEST(FlashLaunchPlanTest, ValueChunksAndSharedMemoryFollowHeadSizes) {
  struct Case {
    int64_t dk, dv;
    int chunks;
  };
  for (const Case& c : {Case{1, 1, 2}, {64, 64, 2}, {64, 65, 4}, {96, 128, 4}, {256, 129, 8},
                        {17, 256, 8}}) {
    const FlashLaunchPlan plan = PlanFlashAttention({1, 1, 1, 1, 1, c.dk, c.dv}, true);
    EXPECT_EQ(plan.value_chunks, c.chunks) << c.dk << " " << c.dv;
    EXPECT_GE(plan.value_chunks * 32, c.dv);
    EXPECT_EQ(plan.shared_bytes, 4 * (32 * c.dk + 32 * (c.dk + 1) + 32 * c.dv));
    EXPECT_EQ(plan.weight_blocks, 1);
  }
  // Weight blocks: enough for every weight, capped for the grid-stride loop.
  EXPECT_EQ(PlanFlashAttention({2, 2, 2, 100, 100, 8, 8}, true).weight_blocks,
            (2 * 2 * 100 * 100 + 255) / 256);
  EXPECT_EQ(PlanFlashAttention({64, 16, 16, 1024, 1024, 64, 64}, true).weight_blocks, 65536);
}

TEST(FlashLaunchPlanTest, UnsupportedShapesNameTheField) {
  EXPECT_EQ(FlashUnsupportedReason({1, 12, 12, 128, 128, 64, 64}, kH100SharedBytes), "");
  EXPECT_EQ(FlashUnsupportedReason({1, 1, 1, 1, 1, 256, 256}, kH100SharedBytes), "");
  EXPECT_EQ(FlashUnsupportedReason({1, 1, 1, 1, 1, 257, 64}, kH100SharedBytes),
            "config.head_dim = 257 exceeds the CUDA kernel's 256");
  EXPECT_EQ(FlashUnsupportedReason({1, 1, 1, 1, 1, 64, 300}, kH100SharedBytes),
            "config.v_head_dim = 300 exceeds the CUDA kernel's 256");
  EXPECT_EQ(FlashUnsupportedReason({1, 1, 1, 1, 1, 256, 256}, 48 << 10),
            "head_dim 256 and v_head_dim 256 need 98432 bytes of shared memory per block; the "
            "device has 49152");
  // 65536 heads of 2^24 queries: more blocks than a grid holds.
  EXPECT_NE(FlashUnsupportedReason({1, 65536, 65536, int64_t{1} << 24, 1, 1, 1},
                                   kH100SharedBytes)
                .find("blocks exceed a CUDA grid"),
            std::string::npos);
}

TEST(MmaLaunchPlanTest, TakesSixteenMultiplesUpTo128WithoutWeights) {
  EXPECT_TRUE(MmaKernelTakes({1, 12, 12, 128, 128, 64, 64}, false, kH100SharedBytes));
  EXPECT_TRUE(MmaKernelTakes({1, 32, 8, 7, 300, 128, 128}, false, kH100SharedBytes));
  EXPECT_TRUE(MmaKernelTakes({2, 4, 2, 1, 1, 16, 48}, false, kH100SharedBytes));
  EXPECT_FALSE(MmaKernelTakes({1, 12, 12, 128, 128, 64, 64}, true, kH100SharedBytes));
  for (const auto& [dk, dv] :
       {std::pair<int64_t, int64_t>{72, 64}, {64, 8}, {144, 144}, {256, 256}, {33, 64}}) {
    EXPECT_FALSE(MmaKernelTakes({1, 1, 1, 1, 1, dk, dv}, false, kH100SharedBytes)) << dk << dv;
  }
  // 128-wide heads need 111 KiB: past the default 48 KiB, within an A100's or H100's.
  EXPECT_FALSE(MmaKernelTakes({1, 1, 1, 1, 1, 128, 128}, false, 48 << 10));
}

TEST(MmaLaunchPlanTest, SharedRegionsAreAlignedAndApart) {
  for (const auto& [dk, dv] :
       {std::pair<int64_t, int64_t>{16, 16}, {64, 64}, {128, 128}, {48, 112}}) {
    const MmaSharedLayout l = PlanMmaShared(dk, dv);
    // Leading dimensions as mma's loads need them (8 bf16, 4 floats), padded past the row.
    EXPECT_EQ(l.q_ld % 8, 0);
    EXPECT_EQ(l.v_ld % 8, 0);
    EXPECT_EQ(l.probabilities_ld % 8, 0);
    EXPECT_EQ(l.scores_ld % 4, 0);
    EXPECT_EQ(l.output_ld % 4, 0);
    EXPECT_GT(l.q_ld, dk);
    EXPECT_GT(l.v_ld, dv);
    // Regions in order, each 128-byte aligned and as large as its tile.
    const int64_t starts[] = {l.q, l.k, l.v, l.scores, l.probabilities, l.output, l.row_state};
    const int64_t sizes[] = {kMmaRowsPerBlock * l.q_ld * 2,
                             kMmaKeysPerTile * l.k_ld * 2,
                             kMmaKeysPerTile * l.v_ld * 2,
                             16 * l.scores_ld * 4,
                             16 * l.probabilities_ld * 2,
                             16 * l.output_ld * 4,
                             3 * 16 * 4};
    for (int r = 0; r < 7; ++r) {
      EXPECT_EQ(starts[r] % 128, 0) << r;
      if (r + 1 < 7) {
        EXPECT_GE(starts[r + 1], starts[r] + sizes[r]) << r;
      }
    }
    EXPECT_EQ(l.per_warp_bytes % 128, 0);
    EXPECT_GE(l.scores + l.per_warp_bytes, l.row_state + 3 * 16 * 4);
    EXPECT_EQ(l.total_bytes, l.scores + kMmaWarps * l.per_warp_bytes);
  }
  const MmaLaunchPlan plan = PlanMmaAttention({3, 5, 5, 130, 9, 64, 64});
  EXPECT_EQ(plan.query_blocks, 3);  // 130 rows in blocks of 64
  EXPECT_EQ(plan.blocks, 3 * 5 * 3);
  EXPECT_EQ(DecodeFlashBlock(1, plan.query_blocks, 5, kMmaRowsPerBlock).first_row, 64);
}

}  // namespace
}  // namespace attention::core::cuda

// The CUDA paged decode kernel's launch plan: host-side logic, checked on any machine.
#include "core/cuda/paged_decode_plan.h"

#include <set>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"

namespace attention::core::cuda {
namespace {

constexpr int64_t kH100SharedBytes = 227 << 10;

// Llama-3-8B's layer: 32 query heads, 8 KV heads of 128, float32 in 256 KiB blocks.
PagedDecodeDims Llama(int64_t element_bytes = 4) {
  PagedDecodeDims d;
  d.num_heads = 32;
  d.num_kv_heads = 8;
  d.key_dim = d.value_dim = 128;
  d.element_bytes = element_bytes;
  d.block_bytes = 256 << 10;
  d.tokens_per_block = d.block_bytes / (8 * 256 * element_bytes);
  d.storage_address = 1 << 20;
  return d;
}

TEST(CudaPagedDecodePlanTest, SplitsAreFixedInAbsoluteKeys) {
  const PagedDecodeDims d = Llama();
  const PagedDecodePlan plan = PlanPagedDecode(d, {{4096, 1}, {100, 1}, {129, 3}, {32768, 1}});
  ASSERT_EQ(plan.sequences.size(), 4u);
  EXPECT_EQ(plan.sequences[0].run_splits, 4096 / kCudaPagedSplitKeys);
  EXPECT_EQ(plan.sequences[1].run_splits, 1);
  EXPECT_EQ(plan.sequences[2].run_splits, 1);
  EXPECT_EQ(plan.sequences[3].run_splits, 32768 / kCudaPagedSplitKeys);
  EXPECT_EQ(kCudaPagedSplitKeys, 256);
  // Rows: n * group (group 4), in chunks of 4 rows.
  EXPECT_EQ(plan.sequences[0].rows, 4);
  EXPECT_EQ(plan.sequences[0].row_chunks, 1);
  EXPECT_EQ(plan.sequences[2].rows, 12);
  EXPECT_EQ(plan.sequences[2].row_chunks, 3);
  EXPECT_EQ(plan.sequences[0].split_blocks, 8 * 16);  // 128 blocks for one 4k sequence
  EXPECT_EQ(plan.sequences[2].split_blocks, 8 * 1 * 3);
  EXPECT_EQ(plan.sequences[3].split_blocks, 8 * 128);
  // Merge blocks: (query, head, 32 value columns).
  EXPECT_EQ(plan.sequences[0].merge_blocks, 32 * 4);
  EXPECT_EQ(plan.sequences[2].merge_blocks, 3 * 32 * 4);
  // One launch; prefix sums of blocks and states.
  ASSERT_EQ(plan.launches.size(), 1u);
  int64_t split = 0, merge = 0, states = 0;
  for (const PagedSequencePlan& p : plan.sequences) {
    EXPECT_EQ(p.split_block_begin, split);
    EXPECT_EQ(p.merge_block_begin, merge);
    EXPECT_EQ(p.state_offset, states);
    split += p.split_blocks;
    merge += p.merge_blocks;
    states += 8 * p.run_splits * p.rows * (128 + 2);
  }
  EXPECT_EQ(plan.launches[0].split_blocks, split);
  EXPECT_EQ(plan.launches[0].merge_blocks, merge);
  EXPECT_EQ(plan.scratch_bytes, 4 * states);
  // A sequence's plan does not depend on its batch (bar the offsets).
  const PagedDecodePlan alone = PlanPagedDecode(d, {{129, 3}});
  EXPECT_EQ(alone.sequences[0].split_blocks, plan.sequences[2].split_blocks);
  EXPECT_EQ(alone.sequences[0].run_splits, plan.sequences[2].run_splits);
}

TEST(CudaPagedDecodePlanTest, SplitBlocksCoverEveryHeadSplitAndChunkOnce) {
  const PagedDecodePlan plan = PlanPagedDecode(Llama(), {{1000, 17}});
  const PagedSequencePlan& p = plan.sequences[0];
  EXPECT_EQ(p.rows, 17 * 4);
  EXPECT_EQ(p.row_chunks, 17);
  EXPECT_EQ(p.run_splits, 4);
  std::set<std::tuple<int64_t, int64_t, int64_t>> seen;
  for (int64_t block = 0; block < p.split_blocks; ++block) {
    const PagedSplitBlock b = DecodePagedSplitBlock(block, p.run_splits, p.row_chunks);
    EXPECT_LT(b.kv_head, 8);
    EXPECT_LT(b.split, p.run_splits);
    EXPECT_LT(b.row_chunk, p.row_chunks);
    seen.insert({b.kv_head, b.split, b.row_chunk});
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), p.split_blocks);
  // Row chunks of one split are neighbours.
  EXPECT_EQ(DecodePagedSplitBlock(1, p.run_splits, p.row_chunks).split, 0);
  EXPECT_EQ(DecodePagedSplitBlock(1, p.run_splits, p.row_chunks).row_chunk, 1);
  // States of distinct (head, split, row) do not overlap and fill the scratch.
  EXPECT_EQ(PagedStateIndex(7, p.run_splits - 1, p.rows - 1, p.run_splits, p.rows, 128) + 130,
            plan.scratch_bytes / 4);
}

TEST(CudaPagedDecodePlanTest, SlidingWindowsSkipSplitsBeforeTheFirstQuerysWindow) {
  PagedDecodeDims d = Llama();
  d.sliding_window = 300;
  // The first query sits at 5000 - 3 = 4997 and sees 4698.. : splits from 4698 / 256 = 18.
  const PagedDecodePlan plan = PlanPagedDecode(d, {{5000, 3}, {300, 1}});
  EXPECT_EQ(plan.sequences[0].first_split, 18);
  EXPECT_EQ(plan.sequences[0].run_splits, 20 - 18);
  EXPECT_EQ(plan.sequences[1].first_split, 0);
  EXPECT_EQ(plan.sequences[1].run_splits, 2);
  EXPECT_EQ(PagedFirstVisibleKey(4997, 300), 4698);
  EXPECT_EQ(PagedFirstVisibleKey(10, 300), 0);
  EXPECT_EQ(PagedFirstVisibleKey(10, 0), 0);
  EXPECT_EQ(PagedFirstVisibleKey(10, 1), 10);
}

TEST(CudaPagedDecodePlanTest, VectorLoadsNeedSixteenByteRows) {
  const PagedDecodePlan f32 = PlanPagedDecode(Llama(4), {{10, 1}});
  EXPECT_EQ(f32.vector, 4);
  EXPECT_EQ(f32.lanes, 32);  // 128 columns in float4s: one key per warp step
  EXPECT_EQ(f32.chunks, 1);
  const PagedDecodePlan bf16 = PlanPagedDecode(Llama(2), {{10, 1}});
  EXPECT_EQ(bf16.vector, 8);
  EXPECT_EQ(bf16.lanes, 16);  // two keys per warp step
  EXPECT_EQ(bf16.chunks, 1);
  // Shared memory: each warp's 32 keys' two offsets, and its states of 4 rows.
  EXPECT_EQ(f32.shared_bytes, 8 * 32 * 2 * 8 + 8 * 4 * (128 + 2) * 4);
  EXPECT_EQ(f32.shared_bytes, PagedSplitSharedBytes(128));
  PagedDecodeDims d = Llama(2);
  d.value_dim = 24;  // 48 bytes: still aligned; 3 vectors of 8, the key's 16 the wider
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).vector, 8);
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).lanes, 16);
  d.key_dim = 24;  // 3 vectors: 4 lanes
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).lanes, 4);
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).chunks, 1);
  d = Llama(2);
  d.value_dim = 20;  // 40 bytes
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).vector, 1);
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).lanes, 32);
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).chunks, 4);  // 128 scalars
  d = Llama(4);
  d.block_bytes += 8;  // blocks 8 bytes apart from 16
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).vector, 1);
  d = Llama(4);
  d.storage_address += 4;
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).vector, 1);
}

TEST(CudaPagedDecodePlanTest, ChunksCoverTheWiderRowWithTheKernelsBuilt) {
  PagedDecodeDims d = Llama(4);
  d.key_dim = 256;  // 64 float4s: 2 per lane, in the kernel of 4
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).chunks, 4);
  d.value_dim = 512;
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).chunks, 4);
  d = Llama(2);
  d.value_dim = 256;  // 32 vectors of 8 bfloat16
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).lanes, 32);
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).chunks, 1);
  d.value_dim = 512;
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).chunks, 2);
  d.storage_address += 2;  // scalars: 512 per row, 16 per lane
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).vector, 1);
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).chunks, 16);
  d.key_dim = d.value_dim = 80;  // 3 per lane, in the kernel of 4
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).chunks, 4);
  d.key_dim = d.value_dim = 16;  // 16 lanes, one each
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).lanes, 16);
  EXPECT_EQ(PlanPagedDecode(d, {{10, 1}}).chunks, 4);
}

TEST(CudaPagedDecodePlanTest, MergeBlocksCoverEveryRowAndColumnChunkOnce) {
  PagedDecodeDims d = Llama();
  d.value_dim = 80;  // 3 chunks of 32 columns, the last partial
  const PagedDecodePlan plan = PlanPagedDecode(d, {{1000, 3}});
  const PagedSequencePlan& p = plan.sequences[0];
  EXPECT_EQ(PagedMergeColumnChunks(80), 3);
  EXPECT_EQ(p.merge_blocks, 3 * 32 * 3);
  std::set<std::pair<int64_t, int64_t>> seen;
  for (int64_t block = 0; block < p.merge_blocks; ++block) {
    const PagedMergeBlock b = DecodePagedMergeBlock(block, 80);
    EXPECT_LT(b.out_row, 3 * 32);
    EXPECT_LT(b.column_chunk, 3);
    seen.insert({b.out_row, b.column_chunk});
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), p.merge_blocks);
  EXPECT_EQ(kCudaPagedMergeThreads, kCudaPagedMergeParts * kCudaPagedMergeColumns);
}

TEST(CudaPagedDecodePlanTest, LargeBatchesTakeSeveralLaunches) {
  std::vector<PagedSequenceDims> sequences(kCudaPagedSequencesPerLaunch * 2 + 1, {300, 1});
  const PagedDecodePlan plan = PlanPagedDecode(Llama(), sequences);
  ASSERT_EQ(plan.launches.size(), 3u);
  EXPECT_EQ(plan.launches[1].first_sequence, kCudaPagedSequencesPerLaunch);
  EXPECT_EQ(plan.launches[1].count, kCudaPagedSequencesPerLaunch);
  EXPECT_EQ(plan.launches[2].count, 1);
  EXPECT_EQ(plan.launches[2].split_blocks, 8 * 2);  // 300 keys: 2 splits
  // Block offsets restart per launch; state offsets do not.
  EXPECT_EQ(plan.sequences[kCudaPagedSequencesPerLaunch].split_block_begin, 0);
  EXPECT_GT(plan.sequences[kCudaPagedSequencesPerLaunch].state_offset, 0);
}

TEST(CudaPagedDecodePlanTest, UnsupportedShapesNameTheField) {
  EXPECT_EQ(PagedDecodeUnsupportedReason(Llama(), {{32768, 1}}, kH100SharedBytes), "");
  PagedDecodeDims d = Llama();
  d.key_dim = 512;
  d.value_dim = 512;
  EXPECT_EQ(PagedDecodeUnsupportedReason(d, {{10, 1}}, kH100SharedBytes), "");
  d.key_dim = 8192;
  EXPECT_EQ(PagedDecodeUnsupportedReason(d, {{10, 1}}, kH100SharedBytes),
            "paged decode: key_dim 8192 and value_dim 512: the CUDA kernel takes rows of at "
            "most 512 elements");
  d.key_dim = 128;
  EXPECT_EQ(PagedDecodeUnsupportedReason(d, {{10, 1}}, 48 << 10),
            "paged decode: value_dim 512 needs 69888 bytes of shared memory per block; the "
            "device has 49152");
  EXPECT_EQ(
      PagedDecodeUnsupportedReason(Llama(), {{10, 1}, {int64_t{1} << 31, 1}}, kH100SharedBytes),
      "paged decode: sequence 1 has length 2147483648; the CUDA kernel takes at most "
      "2^31 - 1");
}

}  // namespace
}  // namespace attention::core::cuda

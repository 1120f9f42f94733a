// The CUDA paged decode kernel's launch plan: host-side logic, checked on any machine.
#include "core/cuda/paged_decode_plan.h"

#include <set>
#include <string>
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

// Forks of one 4,096-key prefix (three members) beside a sequence of its own.
const std::vector<PagedSequenceDims> kForks = {{4097, 1}, {4200, 1}, {4500, 2}, {300, 1}};
const std::vector<PagedSharedGroupDims> kForkGroup = {{{0, 1, 2}, 4096}};

TEST(CudaPagedDecodePlanTest, AGroupRunsItsSharedSplitsOnceForEveryMembersRows) {
  const PagedDecodePlan plan = PlanPagedDecode(Llama(2), kForks, kForkGroup);
  ASSERT_EQ(plan.sequences.size(), 5u);  // the group's entry after the sequences
  const PagedSequencePlan& entry = plan.sequences[4];
  EXPECT_EQ(entry.first_split, 0);
  EXPECT_EQ(entry.run_splits, 16);
  EXPECT_EQ(entry.rows, (1 + 1 + 2) * 4);  // every member's rows, GQA group 4
  EXPECT_EQ(entry.split_blocks, 8 * 16 * 4);
  EXPECT_EQ(entry.merge_blocks, 0);
  // Members run only their own splits, after the shared ones.
  const int64_t own[] = {1, 1, 2};
  int64_t first_row = 0;
  for (int b = 0; b < 3; ++b) {
    const PagedSequencePlan& member = plan.sequences[b];
    EXPECT_EQ(member.first_split, 16) << b;
    EXPECT_EQ(member.run_splits, own[b]) << b;
    EXPECT_EQ(member.shared_splits, 16) << b;
    EXPECT_EQ(member.shared_rows, entry.rows) << b;
    EXPECT_EQ(member.shared_first_row, first_row) << b;
    EXPECT_EQ(member.shared_state_offset, entry.state_offset) << b;
    first_row += member.rows;
  }
  EXPECT_EQ(plan.sequences[3].shared_splits, 0);
  EXPECT_EQ(plan.sequences[3].run_splits, 2);
  // As many split blocks as without the group here (rows go 4 to a block either way, and
  // each member brings 4): what changes is that a shared split's row chunks are neighbours
  // in the grid, so its bytes come from memory once.
  const PagedDecodePlan alone = PlanPagedDecode(Llama(2), kForks);
  EXPECT_EQ(plan.launches[0].split_blocks, alone.launches[0].split_blocks);
  EXPECT_EQ(plan.launches[0].merge_blocks, alone.launches[0].merge_blocks);
  // Members of 2 rows (GQA 2, one query) share blocks: 4 members, 2 chunks a split.
  PagedDecodeDims pairs = Llama(2);
  pairs.num_heads = 16;
  const std::vector<PagedSequenceDims> four(4, {4097, 1});
  const PagedDecodePlan shared_pairs = PlanPagedDecode(pairs, four, {{{0, 1, 2, 3}, 4096}});
  EXPECT_EQ(shared_pairs.launches[0].split_blocks, 8 * 16 * 2 + 4 * 8 * 1);
  EXPECT_EQ(PlanPagedDecode(pairs, four).launches[0].split_blocks, 4 * 8 * 17);
}

// Every state a split block writes is read by exactly one merge, at the merge split of the
// same absolute keys as without the group.
TEST(CudaPagedDecodePlanTest, EachMemberMergesEveryStateOfItsSplitsOnce) {
  const PagedDecodeDims d = Llama(2);
  const PagedDecodePlan plan = PlanPagedDecode(d, kForks, kForkGroup);
  const int64_t state_floats = PagedStateFloats(d.value_dim);
  std::multiset<int64_t> written, read;
  for (const PagedSequencePlan& p : plan.sequences) {
    for (int64_t block = 0; block < p.split_blocks; ++block) {
      const PagedSplitBlock work = DecodePagedSplitBlock(block, p.run_splits, p.row_chunks);
      for (int64_t r = 0; r < kCudaPagedRowsPerBlock; ++r) {
        const int64_t row = work.row_chunk * kCudaPagedRowsPerBlock + r;
        if (row >= p.rows) break;
        written.insert(p.state_offset + PagedStateIndex(work.kv_head, work.split, row, p.run_splits,
                                                        p.rows, d.value_dim));
      }
    }
  }
  for (size_t b = 0; b < kForks.size(); ++b) {
    const PagedSequencePlan& p = plan.sequences[b];
    // Merge split s reads absolute split s: the entry's splits start at 0, a member's at
    // its shared splits.
    EXPECT_EQ(p.first_split, p.shared_splits) << b;
    for (int64_t kv_head = 0; kv_head < d.num_kv_heads; ++kv_head) {
      for (int64_t row = 0; row < p.rows; ++row) {
        for (int64_t split = 0; split < p.shared_splits + p.run_splits; ++split) {
          const int64_t offset = PagedMergeStateOffset(
              kv_head, split, row, p.rows, d.value_dim, p.state_offset, p.run_splits,
              p.shared_splits, p.shared_rows, p.shared_first_row, p.shared_state_offset);
          EXPECT_LE((offset + state_floats) * 4, plan.scratch_bytes);
          read.insert(offset);
        }
      }
    }
  }
  EXPECT_EQ(read, written);
  EXPECT_EQ(std::set<int64_t>(read.begin(), read.end()).size(), read.size());
}

TEST(CudaPagedDecodePlanTest, GroupEntriesAfterAFullLaunchGoInTheNext) {
  std::vector<PagedSequenceDims> sequences(kCudaPagedSequencesPerLaunch + 8, {300, 1});
  sequences.front() = sequences.back() = {600, 1};
  const int64_t last = static_cast<int64_t>(sequences.size()) - 1;
  const PagedDecodePlan plan = PlanPagedDecode(Llama(), sequences, {{{0, last}, 512}});
  ASSERT_EQ(plan.launches.size(), 2u);
  EXPECT_EQ(plan.launches[1].count, 9);  // 8 sequences and the entry
  const PagedSequencePlan& entry = plan.sequences.back();
  EXPECT_EQ(plan.sequences[last].shared_state_offset, entry.state_offset);
  EXPECT_EQ(plan.sequences[0].shared_state_offset, entry.state_offset);
  // Sequence 0 keeps its third split (keys 512-599): its only split block per KV head.
  EXPECT_EQ(plan.sequences[0].split_blocks, 8);
}

TEST(CudaPagedDecodePlanTest, MalformedGroupsNameTheGroupAndValues) {
  const PagedDecodeDims d = Llama(2);
  EXPECT_EQ(PagedSharedGroupsInvalidReason(d, kForks, kForkGroup), "");
  const auto why = [&](const std::vector<PagedSharedGroupDims>& groups) {
    return PagedSharedGroupsInvalidReason(d, kForks, groups);
  };
  EXPECT_EQ(why({{{0}, 4096}}), "paged decode: shared group 0 has 1 members; at least 2");
  EXPECT_EQ(why({{{0, 1}, 300}}),
            "paged decode: shared group 0: shared_keys 300 is not a positive multiple of 256");
  EXPECT_EQ(why({{{0, 1}, 0}}),
            "paged decode: shared group 0: shared_keys 0 is not a positive multiple of 256");
  const std::string order =
      " is not a sequence in ascending order outside every other group (4 sequences)";
  EXPECT_EQ(why({{{0, 4}, 256}}), "paged decode: shared group 0: member 4" + order);
  EXPECT_EQ(why({{{1, 0}, 256}}), "paged decode: shared group 0: member 0" + order);
  EXPECT_EQ(why({{{0, 1}, 256}, {{1, 2}, 256}}), "paged decode: shared group 1: member 1" + order);
  EXPECT_EQ(why({{{0, 3}, 512}}),
            "paged decode: shared group 0: member 3 (length 300, 1 queries) does not see "
            "shared_keys 512 from its first query");
  PagedDecodeDims windowed = d;
  windowed.sliding_window = 1024;
  EXPECT_EQ(PagedSharedGroupsInvalidReason(windowed, kForks, kForkGroup),
            "paged decode: shared group 0: sliding_window 1024 (a window's sequences share no "
            "whole prefix)");
}

}  // namespace
}  // namespace attention::core::cuda

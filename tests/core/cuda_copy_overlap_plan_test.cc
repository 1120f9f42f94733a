// The chunks of a GPU forward pass whose copies overlap its compute
// (core/cuda/copy_overlap_plan.h): plain C++, tested on every host.
#include "core/cuda/copy_overlap_plan.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "tests/core/random_options.h"

namespace attention::core::cuda {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(CopyOverlapPlanTest, SmallPassesStayOneChunk) {
  EXPECT_EQ(PlanCopyOverlap({}), std::vector<size_t>{0});
  EXPECT_EQ(PlanCopyOverlap({64 * kMiB}), std::vector<size_t>{0}) << "a part is never cut";
  EXPECT_EQ(PlanCopyOverlap({3 * kMiB, 4 * kMiB}), std::vector<size_t>{0});
  EXPECT_EQ(PlanCopyOverlap({4 * kMiB, 4 * kMiB}), (std::vector<size_t>{0, 1}));
}

TEST(CopyOverlapPlanTest, EqualPartsMakeEqualChunksUpToTheMost) {
  // S1-like: 32 sequences of 1 MiB in and out.
  const std::vector<int64_t> parts(32, kMiB);
  EXPECT_EQ(PlanCopyOverlap(parts), (std::vector<size_t>{0, 4, 8, 12, 16, 20, 24, 28}));
  // Twice the bytes: still kMaxOverlapChunks chunks (of 8 MiB each).
  const std::vector<int64_t> larger(32, 2 * kMiB);
  EXPECT_EQ(PlanCopyOverlap(larger), (std::vector<size_t>{0, 4, 8, 12, 16, 20, 24, 28}));
  const std::vector<int64_t> twelve(12, kMiB);
  EXPECT_EQ(PlanCopyOverlap(twelve), (std::vector<size_t>{0, 4, 8}));
}

// Random part sizes: chunks start at 0, ascend, number at most kMaxOverlapChunks, and each
// moves at least the chunk bytes whenever the pass is cut at all.
TEST(CopyOverlapPlanTest, EveryChunkMovesEnoughOnRandomParts) {
  const uint64_t seed = attention::core::testing::TestSeed(4020);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 500; ++trial) {
    const int64_t count = std::uniform_int_distribution<int64_t>(1, 300)(rng);
    const int64_t largest = std::uniform_int_distribution<int64_t>(1, 16 * kMiB)(rng);
    std::vector<int64_t> parts(count);
    int64_t total = 0;
    for (int64_t& part : parts) {
      part = std::uniform_int_distribution<int64_t>(0, largest)(rng);
      total += part;
    }
    const std::vector<size_t> firsts = PlanCopyOverlap(parts);
    SCOPED_TRACE("trial " + std::to_string(trial));
    ASSERT_FALSE(firsts.empty());
    EXPECT_EQ(firsts[0], 0u);
    EXPECT_LE(firsts.size(), static_cast<size_t>(kMaxOverlapChunks));
    if (total < 2 * kOverlapChunkBytes) {
      EXPECT_EQ(firsts.size(), 1u);
    }
    for (size_t c = 0; c < firsts.size(); ++c) {
      const size_t end = c + 1 < firsts.size() ? firsts[c + 1] : parts.size();
      ASSERT_LT(firsts[c], end) << "chunk " << c << " is empty";
      int64_t moved = 0;
      for (size_t p = firsts[c]; p < end; ++p) moved += parts[p];
      if (firsts.size() > 1) {
        EXPECT_GE(moved, kOverlapChunkBytes) << "chunk " << c;
      }
    }
    // A pass that moves many chunks' bytes in many small parts is cut.
    if (total >= 4 * kOverlapChunkBytes && largest <= kOverlapChunkBytes / 4) {
      EXPECT_GE(firsts.size(), 2u) << total << " bytes in parts of at most " << largest;
    }
  }
}

// Chunks alternate between the two lanes; a lane's next chunk waits for its previous one to
// be received, and every chunk is received in order.
TEST(CopyOverlapPlanTest, ChunksAlternateLanesAndAreReceivedInOrder) {
  const auto run = [](size_t chunks, size_t failing_enqueue, std::string* events) {
    return RunOverlappedChunks(
        chunks,
        [&](size_t chunk, int lane) {
          *events += "E" + std::to_string(chunk) + "@" + std::to_string(lane) + " ";
          return chunk == failing_enqueue ? absl::InternalError("lost") : absl::OkStatus();
        },
        [&](size_t chunk) {
          *events += "R" + std::to_string(chunk) + " ";
          return absl::OkStatus();
        });
  };
  std::string events;
  EXPECT_TRUE(run(5, 99, &events).ok());
  EXPECT_EQ(events, "E0@0 E1@1 R0 E2@0 R1 E3@1 R2 E4@0 R3 R4 ");
  events.clear();
  EXPECT_TRUE(run(1, 99, &events).ok());
  EXPECT_EQ(events, "E0@0 R0 ");
  events.clear();
  EXPECT_EQ(run(5, 2, &events).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(events, "E0@0 E1@1 R0 E2@0 ") << "nothing runs after the first error";
}

// An SDPA call moves its Q, K and V in and its output out, cut between sequences only when
// each piece would compute what the whole does.
TEST(CopyOverlapPlanTest, SdpaCallsAreCutBetweenSequencesUnlessTheyMayNotBe) {
  SdpaInput input;
  input.dims = {4, 2, 1, 8, 16, 4, 2};  // B, H, Hkv, Nq, Nk, dk, dv
  const std::vector<float> q(4 * 2 * 8 * 4), k(4 * 16 * 4), v(4 * 16 * 2);
  input.query = q;
  input.key = k;
  input.value = v;
  const int64_t per_sequence = (2 * 8 * 4 + 16 * 4 + 16 * 2 + 2 * 8 * 2) * 4;
  EXPECT_EQ(SdpaOverlapPartBytes(input), std::vector<int64_t>(4, per_sequence));
  input.options.attn_mask_dims = {4, 1, 8, 16};  // a mask per sequence is cut with it
  input.options.attn_mask_keep.assign(4 * 8 * 16, 1);
  EXPECT_EQ(SdpaOverlapPartBytes(input).size(), 4u);

  const std::vector<int64_t> whole = {4 * per_sequence};
  SdpaInput shared_mask = input;
  shared_mask.options.attn_mask_dims = {1, 1, 8, 16};
  shared_mask.options.attn_mask_keep.assign(8 * 16, 1);
  EXPECT_EQ(SdpaOverlapPartBytes(shared_mask), whole) << "each chunk would copy the mask";
  SdpaInput weights = input;
  weights.options.need_weights = NeedWeights::kPerHead;
  EXPECT_EQ(SdpaOverlapPartBytes(weights), whole);
  SdpaInput dropout = input;
  dropout.options.dropout_p = 0.5f;
  EXPECT_EQ(SdpaOverlapPartBytes(dropout), whole) << "dropout's pattern follows the batch index";
  SdpaInput one = input;
  one.dims.batch = 1;
  one.options = {};
  EXPECT_EQ(SdpaOverlapPartBytes(one).size(), 1u);
}

}  // namespace
}  // namespace attention::core::cuda

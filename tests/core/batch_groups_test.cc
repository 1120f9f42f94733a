// The rule that hands whole parts of a batch to one thread each (core/cpu/batch_groups.h).
#include "core/cpu/batch_groups.h"

#include <vector>

#include "gtest/gtest.h"

namespace attention::core {
namespace {

std::vector<BatchPart> Sequences(int count, int64_t tokens) {
  return std::vector<BatchPart>(count, {tokens, tokens});
}

// Every part in exactly one group, groups of consecutive parts.
void ExpectEveryPartOnce(const std::vector<std::vector<size_t>>& groups, size_t parts) {
  std::vector<int> seen(parts, 0);
  for (const auto& group : groups) {
    ASSERT_FALSE(group.empty());
    for (size_t i = 0; i < group.size(); ++i) {
      ASSERT_LT(group[i], parts);
      ++seen[group[i]];
      if (i > 0) {
        EXPECT_EQ(group[i], group[i - 1] + 1);
      }
    }
  }
  for (size_t n = 0; n < parts; ++n) EXPECT_EQ(seen[n], 1) << "part " << n;
}

TEST(BatchGroupsTest, SequencesOfAtLeastTheGroupRowsRunOneAGroup) {
  const auto groups = GroupBatchParts(768, Sequences(32, 128), 2);  // S1
  ASSERT_EQ(groups.size(), 32u);
  ExpectEveryPartOnce(groups, 32);
  for (const auto& group : groups) EXPECT_EQ(group.size(), 1u);
}

TEST(BatchGroupsTest, ShortSequencesJoinUpToTheGroupRows) {
  const auto groups = GroupBatchParts(768, Sequences(256, 16), 2);  // S4
  ASSERT_EQ(groups.size(), 256u / (kGroupRows / 16));
  ExpectEveryPartOnce(groups, 256);
  for (const auto& group : groups) EXPECT_EQ(group.size(), static_cast<size_t>(kGroupRows / 16));
}

TEST(BatchGroupsTest, CostliestGroupFirst) {
  // Ragged: lengths 16, 48, 80, ... 496, each its own group but the 16 (joined by the 48).
  std::vector<BatchPart> parts;
  for (int64_t tokens = 16; tokens <= 512; tokens += 32) parts.push_back({tokens, tokens});
  const auto groups = GroupBatchParts(768, parts, 2);
  ASSERT_EQ(groups.size(), parts.size() - 1);
  ExpectEveryPartOnce(groups, parts.size());
  EXPECT_EQ(groups.front(), std::vector<size_t>{parts.size() - 1});
  EXPECT_EQ(groups.back(), (std::vector<size_t>{0, 1}));
}

TEST(BatchGroupsTest, NoGroupsWhereTheyCannotKeepTheThreadsBusy) {
  EXPECT_TRUE(GroupBatchParts(768, Sequences(1, 2048), 2).empty());  // one part
  EXPECT_TRUE(GroupBatchParts(768, Sequences(4, 30), 2).empty());    // one group of 120 rows
  EXPECT_TRUE(GroupBatchParts(768, {}, 2).empty());
  // Two equal groups: each is half the batch, more than a quarter.
  EXPECT_TRUE(GroupBatchParts(768, Sequences(2, 128), 2).empty());
  EXPECT_EQ(GroupBatchParts(768, Sequences(4, 128), 2).size(), 4u);
  // One long sequence among short ones.
  std::vector<BatchPart> parts = Sequences(8, 64);
  parts.push_back({1024, 1024});
  EXPECT_TRUE(GroupBatchParts(768, parts, 2).empty());
  // On one thread two equal groups already keep it busy.
  EXPECT_EQ(GroupBatchParts(768, Sequences(2, 128), 1).size(), 2u);
}

}  // namespace
}  // namespace attention::core

// The wire codec's rules, each checked once for every front-end: shapes (the native API's
// and KServe's flavours of the one rule).
#include "tensor_codec.h"

#include <vector>

#include "gtest/gtest.h"

namespace attention::wire {
namespace {

using absl::StatusCode;

TEST(ElementCountTest, NativeShapesNeedRankAndPositiveDimensions) {
  EXPECT_EQ(*ElementCount(std::vector<int64_t>{2, 3, 4}, "query"), 24);
  EXPECT_EQ(ElementCount(std::vector<int64_t>{}, "query").status().message(),
            "query.shape is empty: the tensor is missing or has rank 0");
  EXPECT_EQ(ElementCount(std::vector<int64_t>{1, 0, 4}, "query").status().message(),
            "query.shape[1] = 0 must be >= 1");
  EXPECT_EQ(ElementCount(std::vector<int64_t>{-3}, "query").status().code(),
            StatusCode::kInvalidArgument);
}

TEST(ElementCountTest, KserveShapesMayBeScalarsOrHoldZeros) {
  const ShapeRule rule = ShapeRule::kNonNegative;
  EXPECT_EQ(*ElementCount(std::vector<int64_t>{}, "inputs[\"m\"]", rule), 1);
  EXPECT_EQ(*ElementCount(std::vector<int64_t>{1, 0, 4}, "inputs[\"m\"]", rule), 0);
  EXPECT_EQ(ElementCount(std::vector<int64_t>{1, -3}, "inputs[\"m\"]", rule).status().message(),
            "inputs[\"m\"].shape[1] = -3 is negative");
}

// Both flavours cap the count, so that counts times element sizes cannot wrap: 2^61
// INT64 elements would otherwise need 2^64 bytes, which is 0 in size_t.
TEST(ElementCountTest, BothFlavoursRefuseMoreThanTheMaximumElements) {
  for (const ShapeRule rule : {ShapeRule::kPositive, ShapeRule::kNonNegative}) {
    EXPECT_EQ(*ElementCount(std::vector<int64_t>{kMaxTensorElements}, "t", rule),
              kMaxTensorElements);
    EXPECT_EQ(ElementCount(std::vector<int64_t>{1 << 16, 1 << 16}, "t", rule).status().message(),
              "t.shape [65536, 65536] has more than 2147483648 elements");
    EXPECT_EQ(ElementCount(std::vector<int64_t>{int64_t{1} << 61}, "t", rule).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(ElementCount(std::vector<int64_t>{int64_t{1} << 62, int64_t{1} << 62}, "t", rule)
                  .status()
                  .code(),
              StatusCode::kInvalidArgument);
  }
  // A zero dimension does not let a later one past the cap.
  EXPECT_EQ(ElementCount(std::vector<int64_t>{0, int64_t{1} << 40}, "t", ShapeRule::kNonNegative)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attention::wire

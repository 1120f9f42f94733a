// The wire codec's rules, each checked once for every front-end: shapes (the native API's
// and KServe's flavours of the one rule), byte counts, and the wire's dtypes as core's.
#include "tensor_codec.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

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

TEST(CheckByteCountTest, EachFrontEndNamesItsFieldAndNeed) {
  auto needs = [](int64_t expected) { return absl::StrCat("needs ", expected); };
  EXPECT_TRUE(CheckByteCount(24, 3, 8, "raw", needs).ok());
  const absl::Status status = CheckByteCount(8, 3, 4, "raw_input_contents of \"m\"", needs);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "raw_input_contents of \"m\" has 8 bytes; needs 12");

  v1::Tensor tensor;
  tensor.add_shape(1);
  tensor.add_shape(3);
  tensor.set_dtype(v1::FLOAT32);
  tensor.set_raw_data(std::string(8, '\0'));
  EXPECT_EQ(CheckByteCount(tensor, core::DType::kFloat32, 3, "query").message(),
            "query.raw_data has 8 bytes; shape [1, 3] of FLOAT32 needs 12");
}

// What DecodeFloatTensor checks, for callers that read the values in place or keep 16-bit
// ones (the native service's DecodeMhaInput): the same answers, the count and the dtype.
TEST(CheckFloatTensorTest, ChecksWhatDecodeFloatTensorChecks) {
  v1::Tensor tensor;
  EXPECT_EQ(CheckFloatTensor(tensor, "key").status().message(), "key is missing");
  tensor.add_shape(2);
  tensor.add_shape(3);
  tensor.set_dtype(v1::BFLOAT16);
  tensor.set_raw_data(std::string(12, '\0'));
  core::DType dtype = core::DType::kFloat32;
  EXPECT_EQ(*CheckFloatTensor(tensor, "key", &dtype), 6);
  EXPECT_EQ(dtype, core::DType::kBFloat16);
  tensor.mutable_raw_data()->pop_back();
  EXPECT_EQ(CheckFloatTensor(tensor, "key").status().message(),
            "key.raw_data has 11 bytes; shape [2, 3] of BFLOAT16 needs 12");
  EXPECT_EQ(CheckFloatTensor(tensor, "key").status(), DecodeFloatTensor(tensor, "key").status());
  tensor.clear_raw_data();
  for (int i = 0; i < 6; ++i) tensor.add_float_data(1.0f);
  EXPECT_EQ(CheckFloatTensor(tensor, "key").status().message(),
            "key.float_data needs dtype FLOAT32, not BFLOAT16");
  tensor.set_dtype(v1::FLOAT32);
  EXPECT_EQ(*CheckFloatTensor(tensor, "key", &dtype), 6);
  EXPECT_EQ(dtype, core::DType::kFloat32);
  tensor.set_dtype(v1::BOOL);
  tensor.clear_float_data();
  tensor.set_raw_data(std::string(6, '\1'));
  EXPECT_EQ(CheckFloatTensor(tensor, "key").status().message(),
            "key.dtype is BOOL; expected FLOAT32, FLOAT16 or BFLOAT16");
}

// Every DataType value is the core dtype of the same name (core::kDTypes), both ways.
TEST(WireDTypeTest, EveryDTypeMapsByName) {
  for (const core::DTypeInfo& info : core::kDTypes) {
    const v1::DataType wire = WireDType(info.dtype);
    EXPECT_EQ(v1::DataType_Name(wire), info.name);
    EXPECT_EQ(*ConvertDType(wire, "t"), info.dtype);
  }
  EXPECT_EQ(ConvertDType(v1::DATA_TYPE_UNSPECIFIED, "query.dtype").status().message(),
            "query.dtype is DATA_TYPE_UNSPECIFIED; expected FLOAT32, FLOAT16 or BFLOAT16");
  EXPECT_EQ(ConvertDType(static_cast<v1::DataType>(99), "query.dtype").status().message(),
            "query.dtype = 99 is not a known DataType");
  // Every value the enum has is a core dtype (or unspecified).
  const auto* values = v1::DataType_descriptor();
  for (int i = 0; i < values->value_count(); ++i) {
    const auto wire = static_cast<v1::DataType>(values->value(i)->number());
    if (wire != v1::DATA_TYPE_UNSPECIFIED) {
      EXPECT_TRUE(ConvertDType(wire, "t").ok()) << wire;
    }
  }
}

}  // namespace
}  // namespace attention::wire

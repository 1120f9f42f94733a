// The input-decoding stage alone: where the decoded values live (borrowed in place, copied,
// 16-bit bits kept) and the non-finite check on each route. The refusals a caller sees are
// malformed_request_test's.
#include "server/validation/input_decoding.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tensor_codec.h"

namespace attention::server {
namespace {

using absl::StatusCode;

// A [2, 3] tensor of `dtype` in raw_data holding 0.5, 1.5, ..., with `poison` at index 4.
v1::Tensor RawTensor(core::DType dtype, float poison = 4.5f) {
  std::vector<float> values = {0.5f, 1.5f, 2.5f, 3.5f, poison, 5.5f};
  v1::Tensor tensor;
  wire::EncodeTensor(values, {2, 3}, dtype, &tensor);
  return tensor;
}

TEST(InputDecodingTest, BorrowedFloat32IsReadInPlace) {
  const v1::Tensor tensor = RawTensor(core::DType::kFloat32);
  TensorDecoding how;
  how.borrow = true;
  const absl::StatusOr<DecodedTensor> decoded = DecodeTensor(tensor, "query", how);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(static_cast<const void*>(decoded->borrowed.data()),
            static_cast<const void*>(tensor.raw_data().data()));
  EXPECT_TRUE(decoded->values.empty());
  EXPECT_EQ(decoded->Floats(decoded->values)[5], 5.5f);
}

TEST(InputDecodingTest, WithoutBorrowTheValuesAreCopied) {
  const v1::Tensor tensor = RawTensor(core::DType::kFloat32);
  const absl::StatusOr<DecodedTensor> decoded = DecodeTensor(tensor, "query", TensorDecoding{});
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->borrowed.data(), nullptr);
  EXPECT_EQ(decoded->values, (std::vector<float>{0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f}));
}

TEST(InputDecodingTest, HalfInputsKeepTheirBitsOnlyWhenAsked) {
  for (const core::DType dtype : {core::DType::kFloat16, core::DType::kBFloat16}) {
    SCOPED_TRACE(core::DTypeName(dtype));
    const v1::Tensor tensor = RawTensor(dtype);
    EXPECT_EQ(HalfDType(tensor), dtype);
    TensorDecoding how;
    how.keep_half = true;
    const absl::StatusOr<DecodedTensor> kept = DecodeTensor(tensor, "key", how);
    ASSERT_TRUE(kept.ok()) << kept.status();
    EXPECT_TRUE(kept->values.empty());
    ASSERT_EQ(kept->half.size(), 6u);
    EXPECT_EQ(std::memcmp(kept->half.data(), tensor.raw_data().data(), 12), 0);
    how.borrow = true;
    const absl::StatusOr<DecodedTensor> borrowed = DecodeTensor(tensor, "key", how);
    ASSERT_TRUE(borrowed.ok()) << borrowed.status();
    EXPECT_EQ(static_cast<const void*>(borrowed->borrowed_half.data()),
              static_cast<const void*>(tensor.raw_data().data()));
    // Widened: every value is exact in 16 bits.
    const absl::StatusOr<DecodedTensor> widened = DecodeTensor(tensor, "key", TensorDecoding{});
    ASSERT_TRUE(widened.ok()) << widened.status();
    EXPECT_TRUE(widened->half.empty());
    EXPECT_EQ(widened->values, (std::vector<float>{0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f}));
  }
}

TEST(InputDecodingTest, FloatDataIsNeverHalf) {
  v1::Tensor tensor;
  tensor.add_shape(2);
  tensor.add_float_data(1.0f);
  tensor.add_float_data(2.0f);
  EXPECT_EQ(HalfDType(tensor), core::DType::kFloat32);
  TensorDecoding how;
  how.keep_half = true;
  how.borrow = true;
  const absl::StatusOr<DecodedTensor> decoded = DecodeTensor(tensor, "value", how);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->values, (std::vector<float>{1.0f, 2.0f}));
}

// Every route names the index of the first non-finite value, and none checks when told not to.
TEST(InputDecodingTest, EveryRouteRefusesNonFiniteValuesByIndex) {
  for (const core::DType dtype :
       {core::DType::kFloat32, core::DType::kFloat16, core::DType::kBFloat16}) {
    for (const bool keep_half : {false, true}) {
      for (const bool borrow : {false, true}) {
        SCOPED_TRACE(testing::Message() << core::DTypeName(dtype) << " keep_half=" << keep_half
                                        << " borrow=" << borrow);
        const v1::Tensor tensor = RawTensor(dtype, NAN);
        TensorDecoding how;
        how.keep_half = keep_half;
        how.borrow = borrow;
        const absl::Status refused = DecodeTensor(tensor, "query", how).status();
        EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
        EXPECT_EQ(refused.message(),
                  "query holds NaN at [1, 1]; non-finite inputs are refused "
                  "(--reject_non_finite)");
        how.reject_non_finite = false;
        EXPECT_TRUE(DecodeTensor(tensor, "query", how).ok());
      }
    }
  }
}

// The wire checks come first: a tensor the codec refuses is refused the same way here.
TEST(InputDecodingTest, TheCodecsRefusalsComeThrough) {
  v1::Tensor tensor = RawTensor(core::DType::kFloat32);
  tensor.mutable_raw_data()->resize(7);
  TensorDecoding how;
  how.borrow = true;
  EXPECT_EQ(DecodeTensor(tensor, "query", how).status().message(),
            "query.raw_data has 7 bytes; shape [2, 3] of FLOAT32 needs 24");
  EXPECT_EQ(DecodeTensor(v1::Tensor{}, "key", how).status().message(), "key is missing");
}

}  // namespace
}  // namespace attention::server

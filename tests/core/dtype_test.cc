#include "core/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "gtest/gtest.h"

namespace attention::core {
namespace {

TEST(DTypeTest, HalfKnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // rounds up to inf
  EXPECT_EQ(FloatToHalf(5.9604645e-8f), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(1e-9f), 0x0000);
  EXPECT_EQ(FloatToHalf(1.0f + 1.0f / 2048), 0x3c00);  // tie rounds to even
  EXPECT_EQ(FloatToHalf(1.0f + 3.0f / 2048), 0x3c02);
  EXPECT_FLOAT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
}

TEST(DTypeTest, EveryHalfRoundTrips) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float value = HalfToFloat(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    ASSERT_EQ(FloatToHalf(value), bits) << "half bits 0x" << std::hex << bits;
  }
}

TEST(DTypeTest, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(-3.0f), 0xc040);
  uint32_t tie_bits = 0x3f808000;  // exactly between 0x3f80 and 0x3f81
  float tie;
  std::memcpy(&tie, &tie_bits, 4);
  EXPECT_EQ(FloatToBFloat16(tie), 0x3f80);
  tie_bits = 0x3f818000;
  std::memcpy(&tie, &tie_bits, 4);
  EXPECT_EQ(FloatToBFloat16(tie), 0x3f82);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float value = BFloat16ToFloat(static_cast<uint16_t>(bits));
    if (std::isnan(value)) continue;
    ASSERT_EQ(FloatToBFloat16(value), bits);
  }
}

TEST(DTypeTest, EncodeDecodeRoundTrip) {
  const std::vector<float> values = {0.5f, -1.25f, 3.0f, 1024.0f};
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const std::string bytes = EncodeFloats(values, dtype);
    EXPECT_EQ(bytes.size(), values.size() * ElementSize(dtype));
    auto decoded = DecodeFloats(bytes, dtype, "t");
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(*decoded, values) << DTypeName(dtype);
  }
}

// The one dtype table: sizes and every format's names read from it.
TEST(DTypeTest, OneTableSizesAndNamesEveryDType) {
  EXPECT_EQ(ElementSize(DType::kBFloat16), 2);
  EXPECT_EQ(DTypeName(DType::kFloat16), "FLOAT16");
  EXPECT_EQ(FindDType("BF16", &DTypeInfo::kserve_name)->dtype, DType::kBFloat16);
  EXPECT_EQ(FindDType("F32", &DTypeInfo::safetensors_name)->dtype, DType::kFloat32);
  EXPECT_EQ(FindDType("FP32", &DTypeInfo::name), nullptr);
  for (const DTypeInfo& info : kDTypes) {
    EXPECT_EQ(&Info(info.dtype), &info);
    EXPECT_EQ(FindDType(info.name, &DTypeInfo::name), &info);
    EXPECT_EQ(FindDType(info.kserve_name, &DTypeInfo::kserve_name), &info);
    EXPECT_EQ(FindDType(info.safetensors_name, &DTypeInfo::safetensors_name), &info);
  }
}

TEST(DTypeTest, DecodeRejectsOddByteCount) {
  auto decoded = DecodeFloats(std::string(3, '\0'), DType::kFloat16, "query");
  ASSERT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(decoded.status().message().find("query.raw_data has 3 bytes"), std::string::npos)
      << decoded.status();
}

}  // namespace
}  // namespace attention::core

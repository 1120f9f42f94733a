// Seed 002 ("implementing a very naive attention mechanism"): softmax(X X^T) X on its 6x3
// inputs, with no scaling. The expected values are the tensors the seed prints.
#include <vector>

#include "core/mha_layer.h"
#include "gtest/gtest.h"
#include "tests/core/test_backends.h"

namespace attention::core {
namespace {

const std::vector<float> kInputs = {0.43f, 0.15f, 0.89f, 0.55f, 0.87f, 0.66f,
                                    0.57f, 0.85f, 0.64f, 0.22f, 0.58f, 0.33f,
                                    0.77f, 0.25f, 0.10f, 0.05f, 0.80f, 0.55f};

const std::vector<float> kPrintedWeights = {
    0.2098f, 0.2006f, 0.1981f, 0.1242f, 0.1220f, 0.1452f,  //
    0.1385f, 0.2379f, 0.2333f, 0.1240f, 0.1082f, 0.1581f,  //
    0.1390f, 0.2369f, 0.2326f, 0.1242f, 0.1108f, 0.1565f,  //
    0.1435f, 0.2074f, 0.2046f, 0.1462f, 0.1263f, 0.1720f,  //
    0.1526f, 0.1958f, 0.1975f, 0.1367f, 0.1879f, 0.1295f,  //
    0.1385f, 0.2184f, 0.2128f, 0.1420f, 0.0988f, 0.1896f};

const std::vector<float> kPrintedContext = {0.4421f, 0.5931f, 0.5790f, 0.4419f, 0.6515f, 0.5683f,
                                            0.4431f, 0.6496f, 0.5671f, 0.4304f, 0.6298f, 0.5510f,
                                            0.4671f, 0.5910f, 0.5266f, 0.4177f, 0.6503f, 0.5645f};

SdpaInput NaiveAttentionInput() {
  SdpaInput input;
  input.dims = {/*batch=*/1, /*num_heads=*/1, /*num_kv_heads=*/1, /*q_len=*/6, /*kv_len=*/6,
                /*head_dim=*/3, /*v_head_dim=*/3};
  input.query = input.key = input.value = kInputs;
  input.options.scale = 1.0f;  // the seed's naive version does not divide by sqrt(d)
  input.options.need_weights = NeedWeights::kPerHead;
  return input;
}

void ExpectPrinted(const AttentionResult& result) {
  ASSERT_EQ(result.weights.size(), kPrintedWeights.size());
  for (size_t i = 0; i < kPrintedWeights.size(); ++i) {
    EXPECT_NEAR(result.weights[i], kPrintedWeights[i], 5e-5) << "weight " << i;
  }
  ASSERT_EQ(result.output.size(), kPrintedContext.size());
  for (size_t i = 0; i < kPrintedContext.size(); ++i) {
    EXPECT_NEAR(result.output[i], kPrintedContext[i], 5e-5) << "context " << i;
  }
}

TEST(Seed002Test, ReferenceReproducesPrintedNaiveAttention) {
  ExpectPrinted(SdpaReference(NaiveAttentionInput()));
}

TEST(Seed002Test, CpuBackendReproducesPrintedNaiveAttention) {
  const absl::StatusOr<AttentionResult> result =
      testing::CpuForTests()->ScaledDotProductAttention(NaiveAttentionInput());
  ASSERT_TRUE(result.ok()) << result.status();
  ExpectPrinted(*result);
}

}  // namespace
}  // namespace attention::core

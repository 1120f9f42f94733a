// Request costs from shapes, with overflow-checked arithmetic, and the budgets they meet.
#include "server/request_validation.h"

#include "gtest/gtest.h"

namespace attention::server {
namespace {

TEST(CheckedArithmeticTest, SaturatesInsteadOfWrapping) {
  EXPECT_EQ(CheckedProduct({3, 5, 7}), 105);
  EXPECT_EQ(CheckedProduct({}), 1);
  EXPECT_EQ(CheckedProduct({int64_t{1} << 32, int64_t{1} << 31}), kSaturated);  // 2^63
  EXPECT_EQ(CheckedProduct({int64_t{1} << 16, int64_t{1} << 24, int64_t{1} << 24}), kSaturated);
  EXPECT_EQ(CheckedProduct({kSaturated, 1}), kSaturated);
  EXPECT_EQ(CheckedProduct({kSaturated, 0}), 0);
  EXPECT_EQ(CheckedProduct({-1, 4}), kSaturated);  // a negative size is never admitted
  EXPECT_EQ(CheckedSum({1, 2, 3}), 6);
  EXPECT_EQ(CheckedSum({kSaturated, 1}), kSaturated);
  EXPECT_EQ(CheckedSum({kSaturated - 1, 1}), kSaturated);
}

core::MhaConfig Resolved(core::MhaConfig config) { return *core::MhaConfig::Resolve(config); }

TEST(RequestCostTest, MultiHeadAttentionCountsEveryTerm) {
  const core::MhaConfig config = Resolved({.embed_dim = 8, .num_heads = 2});
  const core::AttentionDims dims{2, 2, 2, 3, 3, 4, 4};
  const RequestCost cost =
      MultiHeadAttentionCost(config, dims, core::NeedWeights::kNone, core::DType::kFloat32);
  EXPECT_EQ(cost.output_elements, 2 * 3 * 8);
  EXPECT_EQ(cost.weight_elements, 0);
  EXPECT_EQ(cost.response_bytes, 2 * 3 * 8 * 4);
  // Q, K, V and output projections of 6 tokens, 8 -> 8 each; 36 scores of dk = dv = 4.
  EXPECT_EQ(cost.flops, 4 * (2 * 6 * 8 * 8) + 36 * (2 * (4 + 4) + 8));
  // Per query token: input, Q, attention output, projected output twice; per key token:
  // key and value inputs, K, V.
  EXPECT_EQ(cost.memory_bytes, 4 * (6 * (8 + 8 + 8 + 2 * 8) + 6 * (8 + 8 + 8 + 8)) + 192);

  const RequestCost averaged = MultiHeadAttentionCost(config, dims, core::NeedWeights::kAveraged,
                                                      core::DType::kFloat16);
  EXPECT_EQ(averaged.weight_elements, 2 * 3 * 3);
  EXPECT_EQ(averaged.response_bytes, (48 + 18) * 2);
  // Per-head weights are held before they are averaged.
  EXPECT_EQ(averaged.memory_bytes - cost.memory_bytes, 4 * (36 + 18) + (48 + 18) * 2 - 192);
}

TEST(RequestCostTest, ScaledDotProductAttention) {
  const core::AttentionDims dims{2, 4, 2, 3, 5, 8, 6};
  const RequestCost cost =
      ScaledDotProductAttentionCost(dims, core::NeedWeights::kPerHead, core::DType::kBFloat16);
  EXPECT_EQ(cost.output_elements, 2 * 4 * 3 * 6);
  EXPECT_EQ(cost.weight_elements, 2 * 4 * 3 * 5);
  EXPECT_EQ(cost.response_bytes, (144 + 120) * 2);
  EXPECT_EQ(cost.flops, 120 * (2 * (8 + 6) + 8));
}

// The request that once crashed the server (issue 13): E = 1, H = 65536, dk = 1, a query of
// 2^24 tokens with per-head weights. B*H*Nq*Nk is 2^64: it must saturate, not wrap to 0.
TEST(RequestCostTest, HugeHeadCountSaturatesAndIsRefused) {
  const core::MhaConfig config =
      Resolved({.embed_dim = 1, .num_heads = 65536, .head_dim = 1});
  const int64_t tokens = int64_t{1} << 24;
  const core::AttentionDims dims{1, 65536, 65536, tokens, tokens, 1, 1};
  const RequestCost cost =
      MultiHeadAttentionCost(config, dims, core::NeedWeights::kPerHead, core::DType::kFloat16);
  EXPECT_EQ(cost.weight_elements, kSaturated);
  EXPECT_EQ(cost.response_bytes, kSaturated);
  EXPECT_EQ(cost.memory_bytes, kSaturated);
  const absl::Status status = CheckRequestBudget(cost, RequestBudget{});
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("the answer would be more than 2^63 bytes"), std::string::npos)
      << status;

  // Without weights the answer is small, but the work and the buffers are not.
  const RequestCost no_weights =
      MultiHeadAttentionCost(config, dims, core::NeedWeights::kNone, core::DType::kFloat16);
  EXPECT_EQ(no_weights.response_bytes, tokens * 2);
  const absl::Status work = CheckRequestBudget(no_weights, RequestBudget{});
  EXPECT_EQ(work.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(work.message().find("FLOPs, over the server's per-request limit of 10000000000000 "
                                "(--max_request_flops)"),
            std::string::npos)
      << work;
}

TEST(RequestBudgetTest, EachLimitIsNamed) {
  RequestCost cost{.output_elements = 10, .response_bytes = 40, .flops = 1000,
                   .memory_bytes = 5000};
  RequestBudget budget{.max_response_bytes = 40, .max_request_flops = 1000,
                       .max_request_memory_bytes = 5000};
  EXPECT_TRUE(CheckRequestBudget(cost, budget).ok());
  budget.max_request_memory_bytes = 4999;
  absl::Status status = CheckRequestBudget(cost, budget);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("needs 5000 bytes of working memory, over the server's "
                                  "per-request limit of 4999 (--max_request_memory_bytes)"),
            std::string::npos)
      << status;
  budget.max_request_flops = 999;
  status = CheckRequestBudget(cost, budget);
  EXPECT_NE(status.message().find("needs 1000 FLOPs"), std::string::npos) << status;
  budget.max_response_bytes = 39;
  status = CheckRequestBudget(cost, budget);
  EXPECT_NE(status.message().find("the answer would be 40 bytes"), std::string::npos) << status;

  EXPECT_TRUE(RequestBudget{}.Validate().ok());
  EXPECT_EQ(RequestBudget{.max_request_flops = 0}.Validate().message(),
            "max_request_flops = 0 must be >= 1");
}

TEST(RequestBudgetTest, InlineLayerWeightsCountAsRequestMemory) {
  const RequestBudget budget{.max_request_memory_bytes = 1000};
  EXPECT_TRUE(CheckInlineLayerBytes(1000, budget).ok());
  const absl::Status status = CheckInlineLayerBytes(1001, budget);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("inline_layer needs 1001 bytes of weights"), std::string::npos)
      << status;
}

}  // namespace
}  // namespace attention::server

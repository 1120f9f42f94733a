// The forward plan every backend runs: host-side logic, checked on any machine.
#include "core/forward_plan.h"

#include <vector>

#include "gtest/gtest.h"

namespace attention::core {
namespace {

// E = 8, H = 4, Hkv = 2, dk = 2, dv = 3: Q = 8, K = 4, V = 6 columns.
MhaConfig Config() {
  MhaConfig c;
  c.embed_dim = 8;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 2;
  c.v_head_dim = 3;
  c.kdim = 5;
  c.vdim = 7;
  c.output_dim = 8;
  return c;
}

MhaInput SelfInput(int64_t batch, int64_t len) {
  MhaInput in;
  in.batch = batch;
  in.q_len = in.kv_len = len;
  return in;
}

MhaInput CrossInput(int64_t batch, int64_t q_len, int64_t kv_len, const std::vector<float>& key) {
  MhaInput in = SelfInput(batch, q_len);
  in.kv_len = kv_len;
  in.key = key;
  in.value = key;
  return in;
}

TEST(ForwardPlanTest, InputsFollowEachOtherInThePackedTokens) {
  const std::vector<float> key(1);
  const MhaInput a = SelfInput(2, 3), b = CrossInput(1, 4, 5, key), c = SelfInput(3, 1);
  const std::vector<const MhaInput*> inputs = {&a, &b, &c};
  const ForwardPlan plan = PlanForward(Config(), inputs, false);
  ASSERT_EQ(plan.inputs.size(), 3u);
  EXPECT_EQ(plan.inputs[0].q_row, 0);
  EXPECT_EQ(plan.inputs[1].q_row, 6);
  EXPECT_EQ(plan.inputs[2].q_row, 10);
  EXPECT_EQ(plan.inputs[0].kv_row, 0);
  EXPECT_EQ(plan.inputs[1].kv_row, 6);
  EXPECT_EQ(plan.inputs[2].kv_row, 11);
  EXPECT_EQ(plan.q_rows, 13);
  EXPECT_EQ(plan.kv_rows, 14);
  EXPECT_EQ(plan.inputs[1].q_rows(), 4);
  EXPECT_EQ(plan.inputs[1].kv_rows(), 5);
  const AttentionDims& d = plan.inputs[1].dims;
  EXPECT_EQ(d.batch, 1);
  EXPECT_EQ(d.num_heads, 4);
  EXPECT_EQ(d.num_kv_heads, 2);
  EXPECT_EQ(d.q_len, 4);
  EXPECT_EQ(d.kv_len, 5);
  EXPECT_EQ(d.head_dim, 2);
  EXPECT_EQ(d.v_head_dim, 3);
}

TEST(ForwardPlanTest, QkvIsOneGemmOnlyWhenEveryInputIsSelfAttentionAndTheWeightIsFused) {
  const std::vector<float> key(1);
  const MhaInput self = SelfInput(1, 2), cross = CrossInput(1, 2, 3, key);
  const std::vector<const MhaInput*> all_self = {&self, &self}, mixed = {&self, &cross};

  const ForwardPlan fused = PlanForward(Config(), all_self, true);
  EXPECT_TRUE(fused.all_self_attention);
  EXPECT_TRUE(fused.fused_qkv);
  EXPECT_EQ(fused.q_stride, 8 + 4 + 6);
  EXPECT_EQ(fused.k_stride, 8 + 4 + 6);
  EXPECT_EQ(fused.v_stride, 8 + 4 + 6);

  for (const ForwardPlan& apart :
       {PlanForward(Config(), all_self, false), PlanForward(Config(), mixed, true)}) {
    EXPECT_FALSE(apart.fused_qkv);
    EXPECT_EQ(apart.q_stride, 8);
    EXPECT_EQ(apart.k_stride, 4);
    EXPECT_EQ(apart.v_stride, 6);
  }
  EXPECT_FALSE(PlanForward(Config(), mixed, true).all_self_attention);

  // A 16-bit input with a key is cross-attention too.
  const std::vector<uint16_t> bits(1);
  MhaInput half = SelfInput(1, 2);
  half.half_dtype = DType::kFloat16;
  half.key_half = half.value_half = bits;
  const std::vector<const MhaInput*> with_half = {&self, &half};
  EXPECT_FALSE(PlanForward(Config(), with_half, true).fused_qkv);
}

TEST(ForwardPlanTest, RotaryBaseFollowsTheLongerSequenceOfEachInput) {
  const std::vector<float> key(1);
  const MhaInput short_input = SelfInput(1, 4), long_keys = CrossInput(1, 2, 100, key);
  const std::vector<const MhaInput*> inputs = {&short_input, &long_keys};
  EXPECT_EQ(PlanForward(Config(), inputs, false).inputs[1].rotary_base, 0.0);

  MhaConfig c = Config();
  c.rope_theta = 10000.0;
  c.rope_scaling.type = RopeScaling::kDynamic;
  c.rope_scaling.factor = 2.0;
  c.rope_scaling.original_max_positions = 16;
  const ForwardPlan plan = PlanForward(c, inputs, false);
  EXPECT_EQ(plan.inputs[0].rotary_base, 10000.0);  // within the original positions
  EXPECT_EQ(plan.inputs[1].rotary_base, c.RotaryBaseFor(100));
  EXPECT_GT(plan.inputs[1].rotary_base, 10000.0);
}

TEST(ForwardPlanTest, OptionsAreTheLayersAndProblemsPointIntoTheProjections) {
  MhaConfig c = Config();
  c.always_causal = true;
  c.sliding_window = 3;
  const std::vector<float> key(1);
  const MhaInput first = SelfInput(2, 3), second = CrossInput(1, 4, 5, key);
  const std::vector<const MhaInput*> inputs = {&first, &second};
  const ForwardPlan plan = PlanForward(c, inputs, false);
  EXPECT_TRUE(plan.inputs[1].options.causal);
  EXPECT_EQ(plan.inputs[1].options.sliding_window, 3);

  std::vector<float> q(plan.q_rows * 8), k(plan.kv_rows * 4), v(plan.kv_rows * 6),
      attended(plan.q_rows * 12);
  const AttentionProblem p = plan.Attention(1, q.data(), k.data(), v.data(), attended.data());
  EXPECT_EQ(p.query, q.data() + 6 * 8);
  EXPECT_EQ(p.key, k.data() + 6 * 4);
  EXPECT_EQ(p.value, v.data() + 6 * 6);
  EXPECT_EQ(p.output, attended.data() + 6 * 12);
  EXPECT_EQ(p.query_layout.row_stride, 8);
  EXPECT_EQ(p.query_layout.head_stride, 2);
  EXPECT_EQ(p.key_layout.row_stride, 4);
  EXPECT_EQ(p.value_layout.head_stride, 3);
  EXPECT_EQ(p.value_layout.batch_stride, 5 * 6);
  EXPECT_EQ(p.output_layout.row_stride, 12);
  EXPECT_EQ(p.weights, nullptr);
  EXPECT_EQ(p.options, &plan.inputs[1].options);
  EXPECT_EQ(p.dims.kv_len, 5);
}

TEST(ForwardPlanTest, PackingPutsKeysAndValuesBesideTheQueryRowsOfSelfAttention) {
  MhaConfig c = Config();
  c.kdim = c.vdim = c.embed_dim = 2;
  const std::vector<float> query_a = {1, 2, 3, 4}, query_b = {5, 6}, key_b = {7, 8, 9, 10},
                           value_b = {11, 12, 13, 14};
  MhaInput a = SelfInput(1, 2), b = CrossInput(1, 1, 2, key_b);
  a.query = query_a;
  b.query = query_b;
  b.value = value_b;
  const std::vector<const MhaInput*> inputs = {&a, &b};
  const ForwardPlan plan = PlanForward(c, inputs, false);
  std::vector<float> x(plan.q_rows * 2), xk(plan.kv_rows * 2), xv(plan.kv_rows * 2);
  for (size_t n = 0; n < inputs.size(); ++n) {
    PackInputTokens(c, plan.inputs[n], *inputs[n], x.data(), xk.data(), xv.data());
  }
  EXPECT_EQ(x, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(xk, (std::vector<float>{1, 2, 3, 4, 7, 8, 9, 10}));
  EXPECT_EQ(xv, (std::vector<float>{1, 2, 3, 4, 11, 12, 13, 14}));

  // Null skips a matrix.
  std::vector<float> only_x(plan.q_rows * 2);
  PackInputTokens(c, plan.inputs[1], b, only_x.data(), nullptr, nullptr);
  EXPECT_EQ(only_x, (std::vector<float>{0, 0, 0, 0, 5, 6}));
}

}  // namespace
}  // namespace attention::core

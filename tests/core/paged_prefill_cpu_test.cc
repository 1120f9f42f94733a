// The CPU paged prefill path (the blocked kernel over KV gathered from the blocks) against
// dense references on the gathered KV (tests/core/paged_decode_fixture.h): FlashAttention's
// fidelity rule over a seeded grid of whole prefills (n = L) and later chunks (n < L), GQA
// groups, block sizes, sliding windows and KV dtypes, and bitwise the blocked kernel on the
// dense KV. The dispatcher's two paths must both meet the rule on the same sequences, and
// results must be bitwise the same for any thread count and batch composition.
#include "core/cpu/paged_prefill_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/attention_kernels.h"
#include "core/attention_options.h"
#include "core/cpu/attention_cpu.h"
#include "core/cpu/paged_attention_cpu.h"
#include "core/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/fidelity.h"
#include "tests/core/paged_decode_fixture.h"

namespace attention::core {
namespace {

using testing::FidelityStats;
using Shape = testing::PagedShape;
using Sequence = testing::PagedSequence;
using PagedPool = testing::HostPagedPool;

enum class Path { kPrefill, kDecode, kDispatch };

// One kernel over `indices` of the pool's sequences, as one batch; without log-sum-exp
// when `with_log_sum_exp` is false.
absl::Status RunPath(Path path, PagedPool& pool, const std::vector<size_t>& indices,
                     ThreadPool& threads, bool with_log_sum_exp = true) {
  std::vector<PagedDecodeSequence> entries;
  const PagedDecodeBatch batch = pool.Batch(indices, entries, with_log_sum_exp);
  switch (path) {
    case Path::kPrefill:
      return PagedPrefillCpu(batch, threads);
    case Path::kDecode:
      return PagedDecodeCpu(batch, threads);
    case Path::kDispatch:
      break;
  }
  return PagedAttentionCpu(batch, threads);
}

TEST(PagedPrefillCpuTest, MatchesDenseReferencesOverASeededGrid) {
  constexpr uint64_t kSeed = 27;
  std::mt19937_64 rng(kSeed);
  ThreadPool threads(2);
  FidelityStats outputs("paged prefill output"), lses("paged prefill log-sum-exp");
  struct Heads {
    int64_t heads, kv_heads;
  };
  // GQA groups 1, 4 and 6.
  const Heads head_shapes[] = {{4, 4}, {8, 2}, {6, 1}};
  const std::pair<int64_t, int64_t> head_dims[] = {{40, 24}, {64, 64}, {16, 16}};
  // Blocks of 1, 5, 16 and 64 tokens: partial first and last blocks for most chunks.
  const int64_t block_sizes[] = {1, 5, 16, 64};
  // Whole prefills (n = L) and later chunks (n < L); past 1024 keys the blocked kernel's
  // online softmax takes the keys in blocks.
  const std::pair<int64_t, int64_t> lengths_and_queries[] = {
      {16, 16}, {97, 97}, {600, 600}, {1500, 1500}, {97, 16}, {700, 300}, {1100, 256}, {2100, 64}};
  int cases = 0;
  for (const auto& [length, queries] : lengths_and_queries) {
    for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      const Heads heads = head_shapes[rng() % 3];
      const auto [key_dim, value_dim] = head_dims[rng() % 3];
      const int64_t tokens_per_block = block_sizes[cases % 4];
      const uint64_t seed = rng();
      const Shape shape{heads.heads, heads.kv_heads, key_dim, value_dim, tokens_per_block, dtype};
      SCOPED_TRACE(::testing::Message()
                   << "seed " << seed << " (grid seed " << kSeed << "): L " << length << " n "
                   << queries << " H " << heads.heads << " H_kv " << heads.kv_heads << " dk "
                   << key_dim << " dv " << value_dim << " tokens/block " << tokens_per_block << " "
                   << DTypeName(dtype));
      PagedPool pool(shape, {{length, queries}}, seed);
      ASSERT_TRUE(RunPath(Path::kPrefill, pool, {0}, threads).ok());
      ASSERT_TRUE(testing::PagedMatchesReferences(pool, 0, outputs, lses));
      ++cases;
    }
  }
  EXPECT_EQ(cases, 8 * 2);
}

// Head sizes that are not multiples of a vector (1, 7, 33, 129 and unequal dk/dv), chunks of
// 32 and of a whole prompt, the blocked kernel's log-sum-exp included.
TEST(PagedPrefillCpuTest, OddHeadSizesMatchDenseReferences) {
  constexpr uint64_t kSeed = 30;
  std::mt19937_64 rng(kSeed);
  ThreadPool threads(2);
  FidelityStats outputs("odd head sizes prefill output"),
      lses("odd head sizes prefill log-sum-exp");
  const std::pair<int64_t, int64_t> head_dims[] = {{1, 1}, {7, 33}, {33, 7}, {129, 65}};
  int cases = 0;
  for (const auto& [key_dim, value_dim] : head_dims) {
    for (const auto& [length, queries] :
         std::vector<std::pair<int64_t, int64_t>>{{40, 40}, {300, 32}, {1100, 70}}) {
      for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        const int64_t tokens_per_block = std::vector<int64_t>{1, 5, 16}[rng() % 3];
        const uint64_t seed = rng();
        const Shape shape{12, 3, key_dim, value_dim, tokens_per_block, dtype};
        SCOPED_TRACE(::testing::Message()
                     << "seed " << seed << " (grid seed " << kSeed << "): L " << length << " n "
                     << queries << " dk " << key_dim << " dv " << value_dim << " tokens/block "
                     << tokens_per_block << " " << DTypeName(dtype));
        PagedPool pool(shape, {{length, queries}}, seed);
        ASSERT_TRUE(RunPath(Path::kPrefill, pool, {0}, threads).ok());
        ASSERT_TRUE(testing::PagedMatchesReferences(pool, 0, outputs, lses));
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 4 * 3 * 2);
}

TEST(PagedPrefillCpuTest, SlidingWindowMatchesDenseReferences) {
  // Windows of one key, shorter than a block, than the chunk and than the sequence, and
  // longer than it; keys before the first query's window are not gathered.
  constexpr uint64_t kSeed = 28;
  std::mt19937_64 rng(kSeed);
  ThreadPool threads(2);
  FidelityStats outputs("windowed prefill output"), lses("windowed prefill log-sum-exp");
  int cases = 0;
  for (const auto& [length, queries] :
       std::vector<std::pair<int64_t, int64_t>>{{600, 600}, {600, 16}, {2100, 300}}) {
    for (const int64_t window : {1, 7, 256, 1500, 4096}) {
      const DType dtype = rng() % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
      const int64_t tokens_per_block = std::vector<int64_t>{5, 16}[rng() % 2];
      const uint64_t seed = rng();
      const Shape shape{8, 2, 40, 24, tokens_per_block, dtype};
      SCOPED_TRACE(::testing::Message()
                   << "seed " << seed << " (grid seed " << kSeed << "): L " << length << " n "
                   << queries << " window " << window << " tokens/block " << tokens_per_block << " "
                   << DTypeName(dtype));
      PagedPool pool(shape, {{length, queries}}, seed);
      pool.sliding_window = window;
      ASSERT_TRUE(RunPath(Path::kPrefill, pool, {0}, threads).ok());
      ASSERT_TRUE(testing::PagedMatchesReferences(pool, 0, outputs, lses));
      ++cases;
    }
  }
  EXPECT_EQ(cases, 3 * 5);
}

TEST(PagedPrefillCpuTest, DispatcherPathsBothMeetTheRuleAroundTheThreshold) {
  // The same sequences on the decode kernel and on the prefill path: each within the rule,
  // and the dispatcher's answer bitwise the path it picks for the sequence's n.
  constexpr uint64_t kSeed = 29;
  std::mt19937_64 rng(kSeed);
  ThreadPool threads(2);
  FidelityStats outputs("dispatch output"), lses("dispatch log-sum-exp");
  for (const int64_t queries :
       std::vector<int64_t>{kPagedPrefillMinQueries - 1, kPagedPrefillMinQueries, 64, 300}) {
    const uint64_t seed = rng();
    const DType dtype = rng() % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
    const Shape shape{8, 2, 64, 64, 16, dtype};
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " (grid seed " << kSeed
                                      << "): L 1300 n " << queries << " " << DTypeName(dtype));
    PagedPool pool(shape, {{1300, queries}}, seed);
    ASSERT_TRUE(RunPath(Path::kDecode, pool, {0}, threads).ok());
    ASSERT_TRUE(testing::PagedMatchesReferences(pool, 0, outputs, lses)) << " (decode kernel)";
    const Sequence decoded = pool.sequences()[0];
    ASSERT_TRUE(RunPath(Path::kPrefill, pool, {0}, threads).ok());
    ASSERT_TRUE(testing::PagedMatchesReferences(pool, 0, outputs, lses)) << " (prefill path)";
    const Sequence prefilled = pool.sequences()[0];
    ASSERT_TRUE(RunPath(Path::kDispatch, pool, {0}, threads).ok());
    const Sequence& picked = queries >= kPagedPrefillMinQueries ? prefilled : decoded;
    EXPECT_EQ(pool.sequences()[0].output, picked.output);
    EXPECT_EQ(pool.sequences()[0].log_sum_exp, picked.log_sum_exp);
  }
}

TEST(PagedPrefillCpuTest, ResultsAreBitwiseTheSameForAnyThreadCountAndBatch) {
  const Shape shape{8, 2, 64, 48, 16, DType::kBFloat16};
  // Prefill chunks beside decode steps; one past the online softmax's 1024-key blocks.
  PagedPool pool(shape, {{2100, 300}, {97, 1}, {600, 600}, {40, 3}}, 7);
  ThreadPool one(1), two(2);
  ASSERT_TRUE(RunPath(Path::kDispatch, pool, {0, 1, 2, 3}, one).ok());
  const std::vector<Sequence> serial = pool.sequences();
  ASSERT_TRUE(RunPath(Path::kDispatch, pool, {0, 1, 2, 3}, two).ok());
  for (size_t i = 0; i < serial.size(); ++i) {
    EXPECT_EQ(serial[i].output, pool.sequences()[i].output) << "sequence " << i;
    EXPECT_EQ(serial[i].log_sum_exp, pool.sequences()[i].log_sum_exp) << "sequence " << i;
  }
  for (size_t i = 0; i < serial.size(); ++i) {
    std::fill(pool.sequences()[i].output.begin(), pool.sequences()[i].output.end(), 0.0f);
    ASSERT_TRUE(RunPath(Path::kDispatch, pool, {i}, two).ok());  // alone
    EXPECT_EQ(serial[i].output, pool.sequences()[i].output) << "sequence " << i << " alone";
    EXPECT_EQ(serial[i].log_sum_exp, pool.sequences()[i].log_sum_exp) << "sequence " << i;
  }
  // Without log-sum-exp asked for, the same outputs.
  std::fill(pool.sequences()[0].output.begin(), pool.sequences()[0].output.end(), 0.0f);
  ASSERT_TRUE(RunPath(Path::kDispatch, pool, {0}, two, /*with_log_sum_exp=*/false).ok());
  EXPECT_EQ(serial[0].output, pool.sequences()[0].output);
}

TEST(PagedPrefillCpuTest, EqualsTheBlockedKernelOnTheDenseKvBitwise) {
  // The gathered pages (float32 copied, bfloat16 widened) are the very keys and values of a
  // dense problem, so the blocked kernel gives the same bits either way.
  ThreadPool threads(2);
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (const int64_t tokens_per_block : {1, 5, 16, 64}) {
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(dtype) << " tokens/block " << tokens_per_block);
      const Shape shape{8, 2, 40, 24, tokens_per_block, dtype};
      PagedPool pool(shape, {{1100, 300}}, 31 + tokens_per_block);
      ASSERT_TRUE(RunPath(Path::kPrefill, pool, {0}, threads).ok());
      const Sequence& s = pool.sequences()[0];
      AttentionOptions options;
      options.causal = true;
      options.scale = pool.scale();
      std::vector<float> output(s.output.size()), log_sum_exp(s.log_sum_exp.size());
      AttentionProblem dense;
      dense.dims = {1,        shape.heads,   shape.kv_heads, s.queries,
                    s.length, shape.key_dim, shape.value_dim};
      dense.query = s.query.data();
      dense.query_layout = HeadLayout::BatchRowHead(shape.heads, s.queries, shape.key_dim);
      dense.key = s.keys.data();  // [L][H_kv][dk]
      dense.key_layout = HeadLayout::BatchRowHead(shape.kv_heads, s.length, shape.key_dim);
      dense.value = s.values.data();
      dense.value_layout = HeadLayout::BatchRowHead(shape.kv_heads, s.length, shape.value_dim);
      dense.output = output.data();
      dense.output_layout = HeadLayout::BatchRowHead(shape.heads, s.queries, shape.value_dim);
      dense.log_sum_exp = log_sum_exp.data();
      dense.log_sum_exp_layout = HeadLayout::BatchRowHead(shape.heads, s.queries, 1);
      dense.options = &options;
      AttentionBlockedCpu({dense}, threads);
      EXPECT_EQ(s.output, output);
      EXPECT_EQ(s.log_sum_exp, log_sum_exp);
    }
  }
}

TEST(PagedPrefillCpuTest, AReadOutsideTheBlockTableShows) {
  // The negative control of the NaN poisoning: a table naming one unwritten block.
  const Shape shape{4, 2, 32, 32, 8, DType::kFloat32};
  PagedPool pool(shape, {{40, 40}}, 11);
  std::vector<kv_cache::BlockId>& table = pool.sequences()[0].table;
  const std::vector<kv_cache::BlockId> written = table;
  for (kv_cache::BlockId b = 0;
       std::find(written.begin(), written.end(), table[2]) != written.end(); ++b) {
    table[2] = b;  // the first block no sequence wrote
  }
  ThreadPool threads(1);
  ASSERT_TRUE(RunPath(Path::kPrefill, pool, {0}, threads).ok());
  EXPECT_TRUE(std::isnan(pool.sequences()[0].output.back()));
  FidelityStats outputs("poisoned"), lses("poisoned lse");
  EXPECT_FALSE(testing::PagedMatchesReferences(pool, 0, outputs, lses));
}

TEST(PagedPrefillCpuTest, RefusesMalformedBatchesBeforeComputingAny) {
  const Shape shape{4, 2, 32, 32, 8, DType::kFloat32};
  PagedPool pool(shape, {{20, 20}, {30, 1}}, 3);
  ThreadPool threads(1);
  Sequence& s = pool.sequences()[1];
  s.length = 2, s.queries = 3;
  for (const Path path : {Path::kPrefill, Path::kDispatch}) {
    const absl::Status status = RunPath(path, pool, {0, 1}, threads);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), ::testing::HasSubstr("num_queries 3 and length 2"));
    // The valid prefill sequence was not computed either.
    EXPECT_THAT(pool.sequences()[0].output, ::testing::Each(-7.0f));
  }
  s.length = 30, s.queries = 1;
  pool.sliding_window = -1;
  EXPECT_THAT(RunPath(Path::kPrefill, pool, {0, 1}, threads).message(),
              ::testing::HasSubstr("sliding_window -1 must be >= 0"));
}

}  // namespace
}  // namespace attention::core

// The CPU paged decode kernel against dense references on the gathered KV: FlashAttention's
// fidelity rule (tests/core/fidelity.h) over a seeded grid of lengths, query counts, GQA
// groups, head sizes, block sizes and KV dtypes; block tables are random permutations of a
// pool three times too large whose other blocks hold NaN, so a read outside the table
// shows. Results must be bitwise the same for any thread count and batch composition.
#include "core/cpu/paged_attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/fidelity.h"

namespace attention::core {
namespace {

using kv_cache::BlockId;
using kv_cache::KvLayout;
using testing::FidelityStats;

struct Shape {
  int64_t heads, kv_heads, key_dim, value_dim, tokens_per_block;
  DType dtype;
};

struct Sequence {
  int64_t length, queries;
  std::vector<float> keys, values;  // dense [L][H_kv][d], as stored (bf16-rounded for bf16)
  std::vector<float> query;         // [n][H][dk]
  std::vector<BlockId> table;
  std::vector<float> output, log_sum_exp;
};

// A pool of NaN-filled blocks holding several sequences at randomly permuted blocks.
class PagedPool {
 public:
  PagedPool(const Shape& shape, const std::vector<std::pair<int64_t, int64_t>>& lengths_and_queries,
            uint64_t seed)
      : shape_(shape), layout_{shape.kv_heads, shape.key_dim, shape.value_dim, shape.dtype} {
    std::mt19937_64 rng(seed);
    // A few spare bytes per block: storage blocks may be larger than their tokens.
    block_bytes_ = shape.tokens_per_block * layout_.TokenBytes() + 8;  // slack past the tokens
    int64_t needed = 0;
    for (const auto& [length, queries] : lengths_and_queries) {
      needed += (length + shape.tokens_per_block - 1) / shape.tokens_per_block;
    }
    num_blocks_ = 3 * needed;
    bytes_.assign(num_blocks_ * block_bytes_, 0xff);  // NaN in float32 and bfloat16
    std::vector<BlockId> permutation(num_blocks_);
    std::iota(permutation.begin(), permutation.end(), 0);
    std::shuffle(permutation.begin(), permutation.end(), rng);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    size_t next_block = 0;
    for (const auto& [length, queries] : lengths_and_queries) {
      Sequence s;
      s.length = length;
      s.queries = queries;
      s.keys.resize(length * shape.kv_heads * shape.key_dim);
      s.values.resize(length * shape.kv_heads * shape.value_dim);
      for (float& x : s.keys) x = Stored(uniform(rng) * 2.0f);
      for (float& x : s.values) x = Stored(uniform(rng));
      s.query.resize(queries * shape.heads * shape.key_dim);
      for (float& x : s.query) x = uniform(rng) * 2.0f;
      const int64_t blocks = (length + shape.tokens_per_block - 1) / shape.tokens_per_block;
      s.table.assign(permutation.begin() + next_block, permutation.begin() + next_block + blocks);
      next_block += blocks;
      Write(s);
      s.output.assign(queries * shape.heads * shape.value_dim, -7.0f);
      s.log_sum_exp.assign(queries * shape.heads, -7.0f);
      sequences_.push_back(std::move(s));
    }
  }

  std::vector<Sequence>& sequences() { return sequences_; }
  const Shape& shape() const { return shape_; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(shape_.key_dim)); }
  int64_t sliding_window = 0;  // of every Run

  // The kernel over `indices` of the sequences, as one batch.
  absl::Status Run(const std::vector<size_t>& indices, ThreadPool& pool,
                   SimdLevel level = BestSimdLevel()) {
    std::vector<PagedDecodeSequence> batch_sequences;
    for (const size_t i : indices) {
      Sequence& s = sequences_[i];
      batch_sequences.push_back(
          {s.table, s.length, s.queries, s.query.data(), s.output.data(), s.log_sum_exp.data()});
    }
    PagedDecodeBatch batch;
    batch.storage = {bytes_.data(), block_bytes_, num_blocks_};
    batch.layout = layout_;
    batch.tokens_per_block = shape_.tokens_per_block;
    batch.num_heads = shape_.heads;
    batch.scale = scale();
    batch.sliding_window = sliding_window;
    batch.sequences = batch_sequences;
    return PagedDecodeCpu(batch, pool, level);
  }

 private:
  float Stored(float x) const {
    return shape_.dtype == DType::kBFloat16 ? BFloat16ToFloat(FloatToBFloat16(x)) : x;
  }
  void Put(int64_t block, int64_t element, float x) {
    uint8_t* at = bytes_.data() + block * block_bytes_ + element * layout_.ElementBytes();
    if (shape_.dtype == DType::kBFloat16) {
      const uint16_t bits = FloatToBFloat16(x);
      std::memcpy(at, &bits, sizeof(bits));
    } else {
      std::memcpy(at, &x, sizeof(x));
    }
  }
  void Write(const Sequence& s) {
    const int64_t tpb = shape_.tokens_per_block;
    for (int64_t t = 0; t < s.length; ++t) {
      const int64_t block = s.table[t / tpb], slot = t % tpb;
      for (int64_t h = 0; h < shape_.kv_heads; ++h) {
        for (int64_t c = 0; c < shape_.key_dim; ++c) {
          Put(block, kv_cache::KeyOffset(layout_, tpb, slot, h) + c,
              s.keys[(t * shape_.kv_heads + h) * shape_.key_dim + c]);
        }
        for (int64_t c = 0; c < shape_.value_dim; ++c) {
          Put(block, kv_cache::ValueOffset(layout_, tpb, slot, h) + c,
              s.values[(t * shape_.kv_heads + h) * shape_.value_dim + c]);
        }
      }
    }
  }

  Shape shape_;
  KvLayout layout_;
  int64_t block_bytes_ = 0, num_blocks_ = 0;
  std::vector<uint8_t> bytes_;
  std::vector<Sequence> sequences_;
};

// Dense decode attention in precision T on the gathered KV: the textbook loops. With a
// window W, query i (at position p) sees keys p - W + 1 .. p.
template <typename T>
void ReferenceDecode(const Shape& shape, const Sequence& s, float scale, int64_t window,
                     std::vector<T>* output, std::vector<T>* log_sum_exp) {
  const int64_t group = shape.heads / shape.kv_heads;
  output->assign(s.queries * shape.heads * shape.value_dim, 0);
  log_sum_exp->assign(s.queries * shape.heads, 0);
  std::vector<T> scores;
  for (int64_t i = 0; i < s.queries; ++i) {
    const int64_t end = s.length - s.queries + i + 1;
    const int64_t begin = window > 0 ? std::max<int64_t>(0, end - window) : 0;
    const int64_t visible = end - begin;
    for (int64_t h = 0; h < shape.heads; ++h) {
      const int64_t kv = h / group;
      const float* q = &s.query[(i * shape.heads + h) * shape.key_dim];
      scores.assign(visible, 0);
      T max = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        const float* k = &s.keys[((begin + j) * shape.kv_heads + kv) * shape.key_dim];
        T dot = 0;
        for (int64_t c = 0; c < shape.key_dim; ++c) {
          dot += static_cast<T>(q[c]) * static_cast<T>(k[c]);
        }
        scores[j] = dot * static_cast<T>(scale);
        max = std::max(max, scores[j]);
      }
      T sum = 0;
      for (T& x : scores) sum += (x = std::exp(x - max));
      for (int64_t c = 0; c < shape.value_dim; ++c) {
        T acc = 0;
        for (int64_t j = 0; j < visible; ++j) {
          const float value = s.values[((begin + j) * shape.kv_heads + kv) * shape.value_dim + c];
          acc += scores[j] * static_cast<T>(value);
        }
        (*output)[(i * shape.heads + h) * shape.value_dim + c] = acc / sum;
      }
      (*log_sum_exp)[i * shape.heads + h] = max + std::log(sum);
    }
  }
}

::testing::AssertionResult MatchesReferences(PagedPool& pool, size_t index, FidelityStats& outputs,
                                             FidelityStats& lses) {
  const Sequence& s = pool.sequences()[index];
  std::vector<double> oracle, oracle_lse;
  std::vector<float> textbook, textbook_lse;
  ReferenceDecode<double>(pool.shape(), s, pool.scale(), pool.sliding_window, &oracle, &oracle_lse);
  ReferenceDecode<float>(pool.shape(), s, pool.scale(), pool.sliding_window, &textbook,
                         &textbook_lse);
  ::testing::AssertionResult result = outputs.Check(s.output, textbook, oracle);
  if (!result) return result << " (output)";
  result = lses.Check(s.log_sum_exp, textbook_lse, oracle_lse);
  if (!result) return result << " (log-sum-exp)";
  return result;
}

// Every SIMD level this CPU runs; the others are skipped.
class PagedDecodeLevelTest : public ::testing::TestWithParam<SimdLevel> {
 protected:
  void SetUp() override {
    if (!CpuSupports(GetParam())) GTEST_SKIP() << "this CPU lacks " << SimdLevelName(GetParam());
  }
};
INSTANTIATE_TEST_SUITE_P(Levels, PagedDecodeLevelTest,
                         ::testing::Values(SimdLevel::kPortable, SimdLevel::kAvx2,
                                           SimdLevel::kAvx512),
                         [](const auto& info) { return std::string(SimdLevelName(info.param)); });

TEST_P(PagedDecodeLevelTest, MatchesDenseReferencesOverASeededGrid) {
  constexpr uint64_t kSeed = 25;
  std::mt19937_64 rng(kSeed);
  ThreadPool threads(2);
  const std::string level = SimdLevelName(GetParam());
  FidelityStats outputs("paged decode output " + level), lses("paged decode log-sum-exp " + level);
  struct Heads {
    int64_t heads, kv_heads;
  };
  // GQA groups 1, 4 and 8, and MQA.
  const Heads head_shapes[] = {{2, 2}, {8, 2}, {16, 2}, {4, 1}};
  const std::pair<int64_t, int64_t> head_dims[] = {{40, 24}, {64, 80}, {16, 16}};
  int cases = 0;
  for (const int64_t length : {1, 54, 97, 512, 1500, 5000}) {
    for (const int64_t queries : {1, 3, 17}) {
      if (queries > length) continue;
      for (const Heads& heads : head_shapes) {
        for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
          const auto [key_dim, value_dim] = head_dims[rng() % 3];
          // Blocks of 1, 5 or 16 tokens: partial last blocks for most lengths.
          const int64_t tokens_per_block = std::vector<int64_t>{1, 5, 16}[rng() % 3];
          const uint64_t seed = rng();
          const Shape shape{heads.heads, heads.kv_heads,   key_dim,
                            value_dim,   tokens_per_block, dtype};
          SCOPED_TRACE(::testing::Message()
                       << "seed " << seed << " (grid seed " << kSeed << "): L " << length << " n "
                       << queries << " H " << heads.heads << " H_kv " << heads.kv_heads << " dk "
                       << key_dim << " dv " << value_dim << " tokens/block " << tokens_per_block
                       << " " << DTypeName(dtype));
          PagedPool pool(shape, {{length, queries}}, seed);
          ASSERT_TRUE(pool.Run({0}, threads, GetParam()).ok());
          ASSERT_TRUE(MatchesReferences(pool, 0, outputs, lses));
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 6 * 3 * 4 * 2 - 2 * 4 * 2);  // n > L skipped for L = 1
}

TEST_P(PagedDecodeLevelTest, SlidingWindowMatchesDenseReferences) {
  // Windows shorter than a block, than a split and than the sequence, and longer than it;
  // the splits before the first query's window are not run.
  constexpr uint64_t kSeed = 26;
  std::mt19937_64 rng(kSeed);
  ThreadPool threads(2);
  const std::string level = SimdLevelName(GetParam());
  FidelityStats outputs("windowed output " + level), lses("windowed log-sum-exp " + level);
  int cases = 0;
  for (const int64_t length : {54, 1500, 5000}) {
    for (const int64_t queries : {1, 17}) {
      for (const int64_t window : {1, 7, 1024, 1500, 4096}) {
        const DType dtype = rng() % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
        const uint64_t seed = rng();
        const Shape shape{8, 2, 40, 24, 5, dtype};
        SCOPED_TRACE(::testing::Message()
                     << "seed " << seed << " (grid seed " << kSeed << "): L " << length << " n "
                     << queries << " window " << window << " " << DTypeName(dtype));
        PagedPool pool(shape, {{length, queries}}, seed);
        pool.sliding_window = window;
        ASSERT_TRUE(pool.Run({0}, threads, GetParam()).ok());
        ASSERT_TRUE(MatchesReferences(pool, 0, outputs, lses));
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 3 * 2 * 5);
}

TEST(PagedDecodeCpuTest, ResultsAreBitwiseTheSameForAnyThreadCountAndBatch) {
  const Shape shape{8, 2, 64, 48, 16, DType::kBFloat16};
  // Several splits of kPagedSplitKeys keys, and a short sequence.
  PagedPool pool(shape, {{5000, 3}, {97, 1}, {2049, 17}}, 7);
  ThreadPool one(1), two(2);
  ASSERT_TRUE(pool.Run({0, 1, 2}, one).ok());
  std::vector<Sequence> serial = pool.sequences();
  ASSERT_TRUE(pool.Run({0, 1, 2}, two).ok());
  for (size_t i = 0; i < serial.size(); ++i) {
    EXPECT_EQ(serial[i].output, pool.sequences()[i].output) << "sequence " << i;
    EXPECT_EQ(serial[i].log_sum_exp, pool.sequences()[i].log_sum_exp) << "sequence " << i;
  }
  for (size_t i = 0; i < serial.size(); ++i) {
    std::fill(pool.sequences()[i].output.begin(), pool.sequences()[i].output.end(), 0.0f);
    ASSERT_TRUE(pool.Run({i}, two).ok());  // alone
    EXPECT_EQ(serial[i].output, pool.sequences()[i].output) << "sequence " << i << " alone";
    EXPECT_EQ(serial[i].log_sum_exp, pool.sequences()[i].log_sum_exp) << "sequence " << i;
  }
}

TEST(PagedDecodeCpuTest, AReadOutsideTheBlockTableShows) {
  // The negative control of the NaN poisoning: a table naming one unwritten block.
  const Shape shape{4, 2, 32, 32, 8, DType::kFloat32};
  PagedPool pool(shape, {{40, 1}}, 11);
  std::vector<BlockId>& table = pool.sequences()[0].table;
  const std::vector<BlockId> written = table;
  for (BlockId b = 0; std::find(written.begin(), written.end(), table[2]) != written.end(); ++b) {
    table[2] = b;  // the first block no sequence wrote
  }
  ThreadPool threads(1);
  ASSERT_TRUE(pool.Run({0}, threads).ok());
  EXPECT_TRUE(std::isnan(pool.sequences()[0].output[0]));
  FidelityStats outputs("poisoned"), lses("poisoned lse");
  EXPECT_FALSE(MatchesReferences(pool, 0, outputs, lses));
}

TEST(PagedDecodeCpuTest, RefusesMalformedBatches) {
  const Shape shape{4, 2, 32, 32, 8, DType::kFloat32};
  PagedPool pool(shape, {{20, 2}}, 3);
  ThreadPool threads(1);
  Sequence& s = pool.sequences()[0];
  s.length = 0, s.queries = 0;  // an empty sequence with no query
  absl::Status status = pool.Run({0}, threads);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("num_queries 0 and length 0"));
  s.length = 2, s.queries = 3;
  EXPECT_EQ(pool.Run({0}, threads).code(), absl::StatusCode::kInvalidArgument);
  s.length = 20, s.queries = 2;
  s.table.pop_back();
  status = pool.Run({0}, threads);
  EXPECT_THAT(status.message(),
              ::testing::HasSubstr("needs 3 blocks of 8 tokens; its block table has 2"));
  s.table.push_back(1 << 20);
  status = pool.Run({0}, threads);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("names block 1048576"));
  s.table.back() = s.table.front();
  pool.sliding_window = -1;
  status = pool.Run({0}, threads);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("sliding_window -1 must be >= 0"));
}

}  // namespace
}  // namespace attention::core

// The CPU paged decode kernel against dense references on the gathered KV: FlashAttention's
// fidelity rule (tests/core/fidelity.h) over a seeded grid of lengths, query counts, GQA
// groups, head sizes, block sizes and KV dtypes; block tables are random permutations of a
// pool three times too large whose other blocks hold NaN, so a read outside the table
// shows. Results must be bitwise the same for any thread count and batch composition, forks
// of one prefix read once for the group included, unless asked to attend shared splits as
// matrix products (SharedPrefixes::kAsProducts), which answer within the rule.
#include "core/cpu/paged_attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cpu/amx_tiles.h"
#include "core/cpu/gemm_bf16.h"
#include "core/devices.h"
#include "core/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/fidelity.h"
#include "tests/core/paged_decode_fixture.h"

namespace attention::core {
namespace {

using kv_cache::BlockId;
using testing::FidelityStats;

using Shape = testing::PagedShape;
using Sequence = testing::PagedSequence;
using PagedPool = testing::HostPagedPool;

// The CPU kernel over `indices` of the pool's sequences, as one batch.
absl::Status RunCpu(PagedPool& pool, const std::vector<size_t>& indices, ThreadPool& threads,
                    SimdLevel level = BestSimdLevel(),
                    SharedPrefixes shared = SharedPrefixes::kReadOnce) {
  std::vector<PagedDecodeSequence> entries;
  return PagedDecodeCpu(pool.Batch(indices, entries), threads, level, shared);
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
          ASSERT_TRUE(RunCpu(pool, {0}, threads, GetParam()).ok());
          ASSERT_TRUE(testing::PagedMatchesReferences(pool, 0, outputs, lses));
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 6 * 3 * 4 * 2 - 2 * 4 * 2);  // n > L skipped for L = 1
}

// Head sizes that are not multiples of a vector (1, 7, 33, 129 and unequal dk/dv), so every
// SIMD level's row tails run; few and many query rows (1, a GQA block of 4 and leftovers, 17)
// and lengths around a 64-key chunk and a 1024-key split.
TEST_P(PagedDecodeLevelTest, OddHeadSizesMatchDenseReferences) {
  constexpr uint64_t kSeed = 31;
  std::mt19937_64 rng(kSeed);
  ThreadPool threads(2);
  const std::string level = SimdLevelName(GetParam());
  FidelityStats outputs("odd head sizes output " + level),
      lses("odd head sizes log-sum-exp " + level);
  const std::pair<int64_t, int64_t> head_dims[] = {{1, 1}, {7, 33}, {33, 7}, {129, 65}};
  int cases = 0;
  for (const auto& [key_dim, value_dim] : head_dims) {
    for (const int64_t length : {1, 63, 65, 1025}) {
      for (const int64_t queries : {1, 5, 17}) {
        if (queries > length) continue;
        for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
          const int64_t tokens_per_block = std::vector<int64_t>{1, 5, 16}[rng() % 3];
          const uint64_t seed = rng();
          const Shape shape{12, 3, key_dim, value_dim, tokens_per_block, dtype};
          SCOPED_TRACE(::testing::Message()
                       << "seed " << seed << " (grid seed " << kSeed << "): L " << length << " n "
                       << queries << " dk " << key_dim << " dv " << value_dim << " tokens/block "
                       << tokens_per_block << " " << DTypeName(dtype));
          PagedPool pool(shape, {{length, queries}}, seed);
          ASSERT_TRUE(RunCpu(pool, {0}, threads, GetParam()).ok());
          ASSERT_TRUE(testing::PagedMatchesReferences(pool, 0, outputs, lses));
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * (4 * 3 - 2) * 2);  // n > L skipped for L = 1
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
        ASSERT_TRUE(RunCpu(pool, {0}, threads, GetParam()).ok());
        ASSERT_TRUE(testing::PagedMatchesReferences(pool, 0, outputs, lses));
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
  ASSERT_TRUE(RunCpu(pool, {0, 1, 2}, one).ok());
  std::vector<Sequence> serial = pool.sequences();
  ASSERT_TRUE(RunCpu(pool, {0, 1, 2}, two).ok());
  for (size_t i = 0; i < serial.size(); ++i) {
    EXPECT_EQ(serial[i].output, pool.sequences()[i].output) << "sequence " << i;
    EXPECT_EQ(serial[i].log_sum_exp, pool.sequences()[i].log_sum_exp) << "sequence " << i;
  }
  for (size_t i = 0; i < serial.size(); ++i) {
    std::fill(pool.sequences()[i].output.begin(), pool.sequences()[i].output.end(), 0.0f);
    ASSERT_TRUE(RunCpu(pool, {i}, two).ok());  // alone
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
  ASSERT_TRUE(RunCpu(pool, {0}, threads).ok());
  EXPECT_TRUE(std::isnan(pool.sequences()[0].output[0]));
  FidelityStats outputs("poisoned"), lses("poisoned lse");
  EXPECT_FALSE(testing::PagedMatchesReferences(pool, 0, outputs, lses));
}

TEST(PagedDecodeCpuTest, RefusesMalformedBatches) {
  const Shape shape{4, 2, 32, 32, 8, DType::kFloat32};
  PagedPool pool(shape, {{20, 2}}, 3);
  ThreadPool threads(1);
  Sequence& s = pool.sequences()[0];
  s.length = 0, s.queries = 0;  // an empty sequence with no query
  absl::Status status = RunCpu(pool, {0}, threads);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("num_queries 0 and length 0"));
  s.length = 2, s.queries = 3;
  EXPECT_EQ(RunCpu(pool, {0}, threads).code(), absl::StatusCode::kInvalidArgument);
  s.length = 20, s.queries = 2;
  s.table.pop_back();
  status = RunCpu(pool, {0}, threads);
  EXPECT_THAT(status.message(),
              ::testing::HasSubstr("needs 3 blocks of 8 tokens; its block table has 2"));
  s.table.push_back(1 << 20);
  status = RunCpu(pool, {0}, threads);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("names block 1048576"));
  s.table.back() = s.table.front();
  pool.sliding_window = -1;
  status = RunCpu(pool, {0}, threads);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("sliding_window -1 must be >= 0"));
}

// A source of 2,600 tokens and forks of it: two sharing its first 2,048 keys (two whole
// splits), one sharing 1,120 (one split and a part), one sharing 640 (no whole split), and
// a sequence of its own. Block ids are shared as a session fork shares them.
struct Forks {
  explicit Forks(DType dtype) : pool(Shape{8, 2, 64, 48, 16, dtype}, {{2600, 1}, {1500, 2}}, 41) {
    pool.AddFork(0, /*shared_blocks=*/128, /*length=*/2100, /*queries=*/1, 42);
    pool.AddFork(0, 128, 2300, 3, 43);
    pool.AddFork(0, 70, 3000, 2, 44);
    pool.AddFork(0, 40, 1200, 1, 45);
  }
  PagedPool pool;
  const std::vector<size_t> all = {0, 1, 2, 3, 4, 5};
};

TEST(SharedPrefixTest, GroupsTheForksOverTheWholeSplitsAllOfThemHold) {
  Forks forks(DType::kFloat32);
  std::vector<PagedDecodeSequence> entries;
  const std::vector<SharedPrefixGroup> groups =
      FindSharedPrefixes(forks.pool.Batch(forks.all, entries), kPagedSplitKeys);
  ASSERT_EQ(groups.size(), 1u);
  // Sequence 1 is not a fork; 5 shares no whole split; 4 shares one, so the group does.
  EXPECT_EQ(groups[0].sequences, (std::vector<int64_t>{0, 2, 3, 4}));
  EXPECT_EQ(groups[0].shared_keys, 1024);
  // Without sequence 4 the forks share two splits.
  const std::vector<SharedPrefixGroup> two =
      FindSharedPrefixes(forks.pool.Batch({0, 2, 3}, entries), kPagedSplitKeys);
  ASSERT_EQ(two.size(), 1u);
  EXPECT_EQ(two[0].shared_keys, 2048);
  // A split a fork's first query does not see whole is not shared: 3 queries at the end of
  // 1,026 keys leave its first query 1,024.
  forks.pool.sequences()[3].length = 1026;
  const std::vector<SharedPrefixGroup> one =
      FindSharedPrefixes(forks.pool.Batch({0, 3}, entries), kPagedSplitKeys);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].shared_keys, 1024);
  forks.pool.sequences()[3].length = 1025;
  EXPECT_TRUE(FindSharedPrefixes(forks.pool.Batch({0, 3}, entries), kPagedSplitKeys).empty());
  // Nothing is shared under a sliding window, nor by one sequence.
  forks.pool.sliding_window = 4096;
  EXPECT_TRUE(FindSharedPrefixes(forks.pool.Batch(forks.all, entries), kPagedSplitKeys).empty());
  forks.pool.sliding_window = 0;
  EXPECT_TRUE(FindSharedPrefixes(forks.pool.Batch({2}, entries), kPagedSplitKeys).empty());
}

// Forks batched together read their shared splits once, and every answer is bitwise the
// one each fork gets alone or with sharing off (and within the rule of the references).
TEST_P(PagedDecodeLevelTest, ForksSharingAPrefixAreBitwiseTheirAnswersAlone) {
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(dtype));
    Forks forks(dtype);
    PagedPool& pool = forks.pool;
    ThreadPool threads(2);
    ASSERT_TRUE(RunCpu(pool, forks.all, threads, GetParam()).ok());
    const std::vector<Sequence> shared = pool.sequences();
    ASSERT_TRUE(RunCpu(pool, forks.all, threads, GetParam(), SharedPrefixes::kReadPerFork).ok());
    const std::string level = SimdLevelName(GetParam());
    FidelityStats outputs("forks " + level), lses("forks lse " + level);
    for (size_t i = 0; i < forks.all.size(); ++i) {
      EXPECT_EQ(shared[i].output, pool.sequences()[i].output) << "sequence " << i;
      EXPECT_EQ(shared[i].log_sum_exp, pool.sequences()[i].log_sum_exp) << "sequence " << i;
      EXPECT_TRUE(testing::PagedMatchesReferences(pool, i, outputs, lses)) << "sequence " << i;
      std::fill(pool.sequences()[i].output.begin(), pool.sequences()[i].output.end(), 0.0f);
      ASSERT_TRUE(RunCpu(pool, {i}, threads, GetParam()).ok());
      EXPECT_EQ(shared[i].output, pool.sequences()[i].output) << "sequence " << i << " alone";
    }
    // Two forks sharing two whole splits, without the others.
    ASSERT_TRUE(RunCpu(pool, {0, 2, 3}, threads, GetParam()).ok());
    for (const size_t i : {0, 2, 3}) {
      EXPECT_EQ(shared[i].output, pool.sequences()[i].output) << "sequence " << i << " of 3";
    }
  }
}

// From kSharedPrefixGemmRows query rows, forks asked to (SharedPrefixes::kAsProducts) attend
// their shared splits as matrix products: every answer within the rule against the
// references, and against the same batch with sharing off (the plain path) as the rule's
// reference. Read once row by row (the default), they answer bitwise the plain path.
// Forks of one 2,048-key prefix, many enough for the shared products.
struct ForkCase {
  int64_t heads, kv_heads, key_dim, value_dim, forks, most_queries, min_rows;
};
constexpr ForkCase kForkCases[] = {
    // GQA 4:1 and 1-3 queries per fork: 35 sequences, 272 query rows, more than one pass
    // of the products takes (256).
    {8, 2, 64, 48, 34, 3, 257},
    // Odd head sizes (a partial panel of values) and GQA 3:1, one query per fork: 22
    // sequences, 66 rows, just past kSharedPrefixGemmRows.
    {6, 2, 36, 20, 21, 1, kSharedPrefixGemmRows},
};

// The pool of a ForkCase: sequences of 2,049-2,600 keys sharing 2,048. The second sequence,
// not attended, makes the pool large enough for the forks' own blocks.
PagedPool ForkPool(const ForkCase& c, DType dtype, uint64_t seed) {
  return PagedPool(Shape{c.heads, c.kv_heads, c.key_dim, c.value_dim, 16, dtype},
                   {{2600, 1}, {8000, 1}}, seed);
}

// Adds the case's forks of sequence 0; returns the sequences to attend, 0 included.
std::vector<size_t> AddForks(PagedPool& pool, const ForkCase& c, uint64_t seed) {
  const int64_t group = c.heads / c.kv_heads;
  std::vector<size_t> all = {0};
  int64_t rows = group;
  for (int f = 0; f < c.forks; ++f) {
    const int64_t queries = 1 + f % c.most_queries;
    all.push_back(pool.AddFork(0, 128, 2049 + (19 * f) % 300, queries, seed + 1 + f));
    rows += group * queries;
  }
  EXPECT_GE(rows, c.min_rows);
  return all;
}

TEST_P(PagedDecodeLevelTest, ManyForksShareTheirPrefixAsMatrixProductsWithinTheRule) {
  constexpr uint64_t kSeed = 46;
  for (const ForkCase& c : kForkCases) {
    for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), ", dk ", c.key_dim, ", dv ", c.value_dim,
                                ", seed ", kSeed));
      PagedPool pool = ForkPool(c, dtype, kSeed);
      const std::vector<size_t> all = AddForks(pool, c, kSeed);
      ThreadPool threads(2);
      PagedAttendStats stats;
      std::vector<PagedDecodeSequence> entries;
      PagedDecodeBatch batch = pool.Batch(all, entries);
      batch.stats = &stats;
      // By default, as many forks still answer bitwise what each gets alone (issue 55).
      ASSERT_TRUE(PagedDecodeCpu(batch, threads, GetParam()).ok());
      EXPECT_EQ(stats.shared_blocks, 128);  // 2,048 keys in blocks of 16
      const std::vector<Sequence> read_once = pool.sequences();
      ASSERT_TRUE(PagedDecodeCpu(batch, threads, GetParam(), SharedPrefixes::kAsProducts).ok());
      const std::vector<Sequence> shared = pool.sequences();
      ASSERT_TRUE(RunCpu(pool, all, threads, GetParam(), SharedPrefixes::kReadPerFork).ok());
      for (const size_t i : all) {
        EXPECT_EQ(read_once[i].output, pool.sequences()[i].output) << "sequence " << i;
      }
      const std::string level = SimdLevelName(GetParam());
      FidelityStats outputs("gemm forks " + level), lses("gemm forks lse " + level);
      FidelityStats against_plain("gemm forks against the plain path " + level);
      for (const size_t i : all) {
        std::vector<double> oracle, oracle_lse;
        std::vector<float> textbook, textbook_lse;
        testing::PagedReferenceDecode<double>(pool.shape(), shared[i], pool.scale(), 0, &oracle,
                                              &oracle_lse);
        testing::PagedReferenceDecode<float>(pool.shape(), shared[i], pool.scale(), 0, &textbook,
                                             &textbook_lse);
        EXPECT_TRUE(against_plain.Check(shared[i].output, pool.sequences()[i].output, oracle))
            << "sequence " << i;
        EXPECT_TRUE(outputs.Check(shared[i].output, textbook, oracle)) << "sequence " << i;
        EXPECT_TRUE(lses.Check(shared[i].log_sum_exp, textbook_lse, oracle_lse))
            << "sequence " << i;
      }
    }
  }
}

// Shared prefixes over bf16 KV in bf16 products, on each kernel: the portable one on every
// host (the products AVX512-BF16 and AMX compute, in plain C++), the others where the CPU
// runs them; the rest are skipped.
class PagedDecodeBf16ProductsTest : public ::testing::TestWithParam<Bf16Kernel> {
 protected:
  void SetUp() override {
    if (!CpuSupports(GetParam())) {
      GTEST_SKIP() << "this CPU cannot run " << Bf16KernelName(GetParam())
                   << (GetParam() == Bf16Kernel::kAmx ? ": " + AmxUnavailableReason() : "");
    }
  }
};
INSTANTIATE_TEST_SUITE_P(Kernels, PagedDecodeBf16ProductsTest,
                         ::testing::Values(Bf16Kernel::kPortable, Bf16Kernel::kAvx512Bf16,
                                           Bf16Kernel::kAmx),
                         [](const auto& info) { return std::string(Bf16KernelName(info.param)); });

TEST_P(PagedDecodeBf16ProductsTest, ManyForksShareTheirPrefixWithinTheBf16Rule) {
  constexpr uint64_t kSeed = 47;
  for (const ForkCase& c : kForkCases) {
    SCOPED_TRACE(absl::StrCat("dk ", c.key_dim, ", dv ", c.value_dim, ", seed ", kSeed));
    PagedPool pool = ForkPool(c, DType::kBFloat16, kSeed);
    const std::vector<size_t> all = AddForks(pool, c, kSeed);
    ThreadPool threads(2);
    std::vector<PagedDecodeSequence> entries;
    ASSERT_TRUE(PagedDecodeCpu(pool.Batch(all, entries), threads, BestSimdLevel(),
                               SharedPrefixes::kAsProducts, GetParam())
                    .ok());
    const std::vector<Sequence> bf16 = pool.sequences();
    ASSERT_TRUE(RunCpu(pool, all, threads).ok());  // the same products in float32
    const std::string kernel = Bf16KernelName(GetParam());
    FidelityStats outputs("bf16 forks " + kernel), lses("bf16 forks lse " + kernel);
    bool rounded = false;  // whether the bf16 products ran: float32's differ somewhere
    for (const size_t i : all) {
      std::vector<double> oracle, oracle_lse;
      std::vector<float> reference, reference_lse;
      testing::PagedReferenceDecode<double>(pool.shape(), bf16[i], pool.scale(), 0, &oracle,
                                            &oracle_lse);
      testing::PagedReferenceDecode<float>(pool.shape(), bf16[i], pool.scale(), 0, &reference,
                                           &reference_lse, /*bf16_products=*/true);
      EXPECT_TRUE(outputs.CheckBf16(bf16[i].output, reference, oracle)) << "sequence " << i;
      EXPECT_TRUE(lses.CheckBf16(bf16[i].log_sum_exp, reference_lse, oracle_lse))
          << "sequence " << i;
      rounded = rounded || bf16[i].output != pool.sequences()[i].output;
    }
    EXPECT_TRUE(rounded) << "every output is float32 products' own";
  }
}

// The CPU's KV storage takes the products of its backend's BFLOAT16 layers
// (CpuBackend::SessionBf16Products): float32 where those are float32, else that kernel, which
// a CPU without it refuses by name.
TEST(DevicesTest, CpuKvStorageMultipliesSharedBf16PrefixesOnTheBackendsKernel) {
  constexpr uint64_t kSeed = 49;
  const ForkCase& c = kForkCases[1];
  for (const Bf16Kernel kernel :
       {Bf16Kernel::kPortable, Bf16Kernel::kAvx512Bf16, Bf16Kernel::kAmx}) {
    SCOPED_TRACE(absl::StrCat(Bf16ProductsName(kernel), ", seed ", kSeed));
    PagedPool pool = ForkPool(c, DType::kBFloat16, kSeed);
    const std::vector<size_t> all = AddForks(pool, c, kSeed);
    CpuKernelChoice kernels;
    kernels.bf16_products = kernel;
    kernels.shared_prefixes = SharedPrefixes::kAsProducts;
    Devices devices(2, kernels);
    absl::StatusOr<std::unique_ptr<kv_cache::KvStorage>> storage =
        devices.CreateKvStorage("cpu", pool.num_blocks(), pool.block_bytes());
    ASSERT_TRUE(storage.ok()) << storage.status();
    ASSERT_TRUE(pool.WriteBlocksTo(**storage).ok());
    std::vector<PagedDecodeSequence> entries;
    const absl::Status status = (*storage)->Attend(pool.Batch(all, entries));
    if (kernel != Bf16Kernel::kPortable && !CpuSupports(kernel)) {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_THAT(status.message(), ::testing::HasSubstr(Bf16KernelName(kernel)));
      continue;
    }
    ASSERT_TRUE(status.ok()) << status;
    const std::vector<Sequence> stored = pool.sequences();
    ThreadPool threads(2);
    const std::optional<Bf16Kernel> products =
        kernel == Bf16Kernel::kPortable ? std::nullopt : std::optional<Bf16Kernel>(kernel);
    ASSERT_TRUE(PagedDecodeCpu(pool.Batch(all, entries), threads, BestSimdLevel(),
                               SharedPrefixes::kAsProducts, products)
                    .ok());
    for (const size_t i : all) {
      EXPECT_EQ(stored[i].output, pool.sequences()[i].output) << "sequence " << i;
    }
  }
}

TEST(PagedDecodeCpuTest, RefusesBf16ProductsThisCpuCannotRun) {
  std::vector<Bf16Kernel> missing;
  for (const Bf16Kernel kernel : {Bf16Kernel::kAvx512Bf16, Bf16Kernel::kAmx}) {
    if (!CpuSupports(kernel)) missing.push_back(kernel);
  }
  if (missing.empty()) GTEST_SKIP() << "this CPU runs every bf16 kernel";
  for (const Bf16Kernel kernel : missing) {
    PagedPool pool(Shape{4, 2, 16, 16, 16, DType::kBFloat16}, {{40, 1}}, 48);
    ThreadPool threads(1);
    std::vector<PagedDecodeSequence> entries;
    const absl::Status status = PagedDecodeCpu(pool.Batch({0}, entries), threads, BestSimdLevel(),
                                               SharedPrefixes::kAsProducts, kernel);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), ::testing::HasSubstr(Bf16KernelName(kernel)));
  }
}

}  // namespace
}  // namespace attention::core

// The paged KV pool's bookkeeping: reservations, forks with copy-on-write, truncation,
// release, and a randomized differential test against a storage simulation.
#include "core/kv_cache/block_pool.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attention::core::kv_cache {
namespace {

using ::testing::HasSubstr;

// 8 bytes a token (one head, dk = dv = 1, float32): a 32-byte block holds 4 tokens.
constexpr KvLayout kTinyLayout{1, 1, 1, DType::kFloat32};
constexpr int64_t kTinyBlockBytes = 32;

KvBlockPool TinyPool(int64_t blocks) {
  return *KvBlockPool::Create(blocks * kTinyBlockBytes, kTinyBlockBytes);
}

TEST(KvLayoutTest, TokensPerBlockFollowsTheLayout) {
  const KvLayout llama{8, 128, 128, DType::kFloat32};
  EXPECT_EQ(llama.TokenBytes(), 8192);
  EXPECT_EQ(*TokensPerBlock(llama, kDefaultBlockBytes), 32);
  EXPECT_EQ(*TokensPerBlock({8, 128, 128, DType::kBFloat16}, kDefaultBlockBytes), 64);
  EXPECT_EQ(*TokensPerBlock({3, 100, 60, DType::kFloat32}, 4096), 2);  // 1920 bytes a token
  const absl::StatusOr<int64_t> too_big = TokensPerBlock({64, 512, 512, DType::kFloat32}, 65536);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_big.status().message(),
              HasSubstr("262144 bytes does not fit a KV block of 65536"));
  EXPECT_EQ(TokensPerBlock({1, 1, 1, DType::kFloat16}, 64).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TokensPerBlock({0, 1, 1, DType::kFloat32}, 64).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvBlockPool::Create(100, 200).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvLayoutTest, LayoutsWhoseTokenBytesOverflowAreRefusedNotWrapped) {
  // Each wrapped to 0 bytes a token once, and TokensPerBlock divided by it (SIGFPE).
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const KvLayout overflowing[] = {{1, int64_t{1} << 62, int64_t{1} << 62, DType::kFloat32},
                                  {int64_t{1} << 60, 2, 2, DType::kFloat32},
                                  {1, 1, kMax, DType::kFloat32},
                                  {kMax, kMax, kMax, DType::kBFloat16}};
  for (const KvLayout& layout : overflowing) {
    const absl::StatusOr<int64_t> tokens = TokensPerBlock(layout, kDefaultBlockBytes);
    EXPECT_EQ(tokens.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(tokens.status().message(), HasSubstr("more than 2^63 bytes does not fit"));
  }
}

TEST(KvBlockPoolTest, HugeReservationsAreRefusedBeforeAnythingIsAllocated) {
  KvBlockPool pool = TinyPool(10);
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  // Block tables of 2^62 layers were resized before the check once (and threw).
  for (const auto& [layers, tokens] : std::vector<std::pair<int64_t, int64_t>>{
           {int64_t{1} << 62, 1}, {1'000'000'000, 4}, {1, kMax}, {kMax, kMax}, {11, 1}}) {
    const absl::StatusOr<SequenceId> refused = pool.Reserve(kTinyLayout, layers, tokens);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
        << layers << " layers x " << tokens << " tokens: " << refused.status();
  }
  EXPECT_EQ(pool.Counters().sequences, 0);
  EXPECT_EQ(pool.Counters().blocks_available, 10);
  const SequenceId source = *pool.Reserve(kTinyLayout, 2, 4);
  EXPECT_EQ(pool.Fork(source, 0, kMax).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.Counters().sequences, 1);
}

TEST(KvBlockPoolTest, ReservationIsPromisedUpFrontAndAppendsStayWithinIt) {
  KvBlockPool pool = TinyPool(10);
  const SequenceId a = *pool.Reserve(kTinyLayout, 2, 9);  // 3 blocks a layer
  KvPoolCounters counters = pool.Counters();
  EXPECT_EQ(counters.blocks_total, 10);
  EXPECT_EQ(counters.blocks_free, 10);
  EXPECT_EQ(counters.blocks_reserved, 6);
  EXPECT_EQ(counters.blocks_available, 4);

  const absl::StatusOr<SequenceId> refused = pool.Reserve(kTinyLayout, 2, 9);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("6 blocks"));
  EXPECT_THAT(refused.status().message(), HasSubstr("4 of 10 blocks"));
  EXPECT_THAT(refused.status().message(), HasSubstr("16 layer-tokens"));
  EXPECT_TRUE(pool.Reserve(kTinyLayout, 1, 16).ok());  // exactly the 4 left

  EXPECT_TRUE(pool.EnsureCapacity(a, 5)->empty());
  const KvSequence* sequence = *pool.Find(a);
  EXPECT_EQ(sequence->length, 5);
  EXPECT_EQ(sequence->block_tables[0].size(), 2u);
  EXPECT_EQ(sequence->block_tables[1].size(), 2u);
  counters = pool.Counters();
  EXPECT_EQ(counters.blocks_free, 6);
  EXPECT_EQ(counters.blocks_reserved, 2 + 4);
  EXPECT_EQ(counters.blocks_available, 0);
  EXPECT_TRUE(pool.EnsureCapacity(a, 3)->empty());  // shorter: nothing to do
  EXPECT_EQ((*pool.Find(a))->length, 5);
  EXPECT_TRUE(pool.EnsureCapacity(a, 9).ok());

  const absl::StatusOr<std::vector<BlockCopy>> past = pool.EnsureCapacity(a, 10);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(past.status().message(), HasSubstr("10 tokens: its reservation is 9"));
  EXPECT_EQ(pool.EnsureCapacity(12345, 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool.Reserve(kTinyLayout, 0, 4).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvBlockPoolTest, ForkSharesBlocksAndCopiesTheSharedPartialTailOnWrite) {
  KvBlockPool pool = TinyPool(8);
  const SequenceId source = *pool.Reserve(kTinyLayout, 1, 8);
  ASSERT_TRUE(pool.EnsureCapacity(source, 6).ok());
  const std::vector<BlockId> source_table = (*pool.Find(source))->block_tables[0];
  EXPECT_EQ(pool.Counters().blocks_available, 6);

  // Sharing 6 tokens (one full block and a partial one): the fork owes one copy.
  const SequenceId fork = *pool.Fork(source, 6, 8);
  EXPECT_EQ((*pool.Find(fork))->block_tables[0], source_table);
  KvPoolCounters counters = pool.Counters();
  EXPECT_EQ(counters.blocks_shared, 2);
  EXPECT_EQ(counters.blocks_free, 6);
  EXPECT_EQ(counters.blocks_available, 5);

  // The fork writes token 6 into the shared tail: copied first, then it is the fork's own.
  const std::vector<BlockCopy> copies = *pool.EnsureCapacity(fork, 7);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].from, source_table[1]);
  const std::vector<BlockId>& fork_table = (*pool.Find(fork))->block_tables[0];
  EXPECT_EQ(fork_table[0], source_table[0]);
  EXPECT_EQ(copies[0].to, fork_table[1]);
  EXPECT_NE(fork_table[1], source_table[1]);
  counters = pool.Counters();
  EXPECT_EQ(counters.blocks_shared, 1);
  EXPECT_EQ(counters.blocks_available, 5);  // the promised copy was spent
  // The source's tail is its own again: no copy.
  EXPECT_TRUE(pool.EnsureCapacity(source, 8)->empty());
  EXPECT_EQ((*pool.Find(source))->block_tables[0], source_table);

  // A fork on a block boundary shares only full blocks and never copies.
  const SequenceId aligned = *pool.Fork(source, 4, 6);
  EXPECT_TRUE(pool.EnsureCapacity(aligned, 6)->empty());
  EXPECT_EQ((*pool.Find(aligned))->block_tables[0][0], source_table[0]);

  EXPECT_EQ(pool.Fork(source, 9, 9).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(pool.Fork(source, 4, 3).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvBlockPoolTest, SourceWritingIntoTheSharedTailCopiesToo) {
  KvBlockPool pool = TinyPool(4);
  const SequenceId source = *pool.Reserve(kTinyLayout, 1, 4);
  ASSERT_TRUE(pool.EnsureCapacity(source, 2).ok());
  const SequenceId fork = *pool.Fork(source, 2, 4);
  const BlockId shared = (*pool.Find(fork))->block_tables[0][0];
  const std::vector<BlockCopy> copies = *pool.EnsureCapacity(source, 3);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].from, shared);
  EXPECT_EQ((*pool.Find(source))->block_tables[0][0], copies[0].to);
  EXPECT_TRUE(pool.EnsureCapacity(fork, 4)->empty());  // the last holder writes in place
  EXPECT_EQ((*pool.Find(fork))->block_tables[0][0], shared);
}

TEST(KvBlockPoolTest, TruncateReleasesWholeBlocksPastTheNewLength) {
  KvBlockPool pool = TinyPool(6);
  const SequenceId a = *pool.Reserve(kTinyLayout, 2, 12);
  ASSERT_TRUE(pool.EnsureCapacity(a, 10).ok());
  const KvSequence before = **pool.Find(a);
  std::vector<BlockId> freed;
  ASSERT_TRUE(pool.Truncate(a, 7, &freed).ok());
  EXPECT_THAT(
      freed, ::testing::UnorderedElementsAre(before.block_tables[0][2], before.block_tables[1][2]));
  EXPECT_EQ((*pool.Find(a))->length, 7);
  EXPECT_EQ(pool.Counters().blocks_free, 2);
  EXPECT_EQ(pool.Counters().blocks_reserved, 2);  // promised back for regrowth
  freed.clear();
  ASSERT_TRUE(pool.Truncate(a, 5, &freed).ok());  // the same blocks: nothing freed
  EXPECT_TRUE(freed.empty());
  EXPECT_EQ(pool.Truncate(a, 6, &freed).code(), absl::StatusCode::kOutOfRange);
  ASSERT_TRUE(pool.EnsureCapacity(a, 12).ok());  // regrowth within the reservation
}

TEST(KvBlockPoolTest, TruncatingIntoSharedBlocksIsRefusedWhenItsRegrowthCannotBePromised) {
  KvBlockPool pool = TinyPool(3);
  const SequenceId source = *pool.Reserve(kTinyLayout, 1, 8);
  ASSERT_TRUE(pool.EnsureCapacity(source, 8).ok());
  const SequenceId fork = *pool.Fork(source, 8, 8);   // shares both full blocks
  ASSERT_TRUE(pool.Reserve(kTinyLayout, 1, 4).ok());  // takes the last block
  std::vector<BlockId> freed;
  // Back to 2 tokens, the source would need a copy of block 0 and a new block 1.
  const absl::Status refused = pool.Truncate(source, 2, &freed);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("rolling back into shared blocks"));
  EXPECT_EQ((*pool.Find(source))->length, 8);
  EXPECT_TRUE(freed.empty());
  ASSERT_TRUE(pool.Release(fork, &freed).ok());
  EXPECT_TRUE(freed.empty());  // the source still holds them
  EXPECT_TRUE(pool.Truncate(source, 2, &freed).ok());
  EXPECT_EQ(freed.size(), 1u);
}

TEST(KvBlockPoolTest, ReleaseReturnsThePoolToItsBaseline) {
  KvBlockPool pool = TinyPool(20);
  const KvPoolCounters baseline = pool.Counters();
  const SequenceId a = *pool.Reserve(kTinyLayout, 2, 10);
  ASSERT_TRUE(pool.EnsureCapacity(a, 7).ok());
  const SequenceId b = *pool.Fork(a, 7, 9);
  const SequenceId c = *pool.Fork(b, 5, 12);
  ASSERT_TRUE(pool.EnsureCapacity(c, 11).ok());
  ASSERT_TRUE(pool.EnsureCapacity(b, 8).ok());
  std::vector<BlockId> freed;
  for (const SequenceId id : {b, a, c}) ASSERT_TRUE(pool.Release(id, &freed).ok());
  const KvPoolCounters after = pool.Counters();
  EXPECT_EQ(after.blocks_free, baseline.blocks_free);
  EXPECT_EQ(after.blocks_reserved, 0);
  EXPECT_EQ(after.blocks_available, baseline.blocks_available);
  EXPECT_EQ(after.blocks_shared, 0);
  EXPECT_EQ(after.sequences, 0);
  EXPECT_EQ(std::set<BlockId>(freed.begin(), freed.end()).size(), freed.size());  // once each
  EXPECT_EQ(pool.Release(a, &freed).code(), absl::StatusCode::kNotFound);
}

// Differential test: random reserve / ensure / fork / truncate / release over two layouts
// sharing one pool, against a simulated storage where every token written gets a unique
// tag, copies are done as the pool says and freed blocks are poisoned. After every step:
// each live sequence reads its own tags through its block tables, the counters match a
// recount from the tables, and admission matches the promise recomputed from scratch.
class KvPoolSimulation {
 public:
  static constexpr int64_t kBlockBytes = 24;  // 3 tokens of kLayouts[0], 4 of kLayouts[1]
  static constexpr int64_t kBlocks = 24;
  static constexpr int64_t kSlots = 4;
  static constexpr int64_t kPoison = -1;
  static constexpr KvLayout kLayouts[2] = {{1, 1, 1, DType::kFloat32}, {1, 2, 1, DType::kBFloat16}};

  explicit KvPoolSimulation(uint64_t seed)
      : rng_(seed),
        pool_(*KvBlockPool::Create(kBlocks * kBlockBytes, kBlockBytes)),
        storage_(kBlocks * kSlots, kPoison) {}

  void Step() {
    const int op = Uniform(0, 9);
    if (op <= 1 || live_.empty()) return Reserve();
    const SequenceId id = RandomLive();
    if (op <= 4) return Ensure(id);
    if (op <= 6) return Fork(id);
    if (op <= 8) return Truncate(id);
    return Release(id);
  }

  void Check() {
    std::map<BlockId, int> holders, partial_holders;
    for (const auto& [id, tags] : live_) {
      const KvSequence& sequence = **pool_.Find(id);
      ASSERT_EQ(sequence.length, static_cast<int64_t>(tags[0].size())) << "sequence " << id;
      for (int64_t layer = 0; layer < sequence.num_layers; ++layer) {
        const std::vector<BlockId>& table = sequence.block_tables[layer];
        ASSERT_EQ(static_cast<int64_t>(table.size()),
                  (sequence.length + sequence.tokens_per_block - 1) / sequence.tokens_per_block);
        for (int64_t t = 0; t < sequence.length; ++t) {
          ASSERT_EQ(Slot(table, t, sequence.tokens_per_block), tags[layer][t])
              << "sequence " << id << " layer " << layer << " token " << t;
        }
        for (const BlockId block : table) ++holders[block];
        if (sequence.length % sequence.tokens_per_block != 0) ++partial_holders[table.back()];
      }
    }
    int64_t shared = 0, copies_owed = 0;
    for (const auto& [block, count] : holders) {
      shared += count > 1;
      copies_owed += std::min(partial_holders[block], count - 1);
    }
    const KvPoolCounters counters = pool_.Counters();
    ASSERT_EQ(counters.blocks_free, kBlocks - static_cast<int64_t>(holders.size()));
    ASSERT_EQ(counters.blocks_shared, shared);
    ASSERT_EQ(counters.blocks_reserved, GrowthOwed() + copies_owed);
    ASSERT_GE(counters.blocks_available, 0);
    ASSERT_EQ(counters.sequences, static_cast<int64_t>(live_.size()));
  }

  void ReleaseAll() {
    while (!live_.empty()) Release(live_.begin()->first);
  }
  const KvBlockPool& pool() const { return pool_; }

 private:
  using Tags = std::vector<std::vector<int64_t>>;  // [layer][token]

  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  SequenceId RandomLive() {
    auto it = live_.begin();
    std::advance(it, Uniform(0, static_cast<int>(live_.size()) - 1));
    return it->first;
  }
  int64_t& Slot(const std::vector<BlockId>& table, int64_t token, int64_t tokens_per_block) {
    return storage_[table[token / tokens_per_block] * kSlots + token % tokens_per_block];
  }
  int64_t GrowthOwed() {
    int64_t owed = 0;
    for (const auto& [id, tags] : live_) {
      const KvSequence& s = **pool_.Find(id);
      const int64_t tpb = s.tokens_per_block;
      owed += s.num_layers * ((s.reserved_tokens + tpb - 1) / tpb - (s.length + tpb - 1) / tpb);
    }
    return owed;
  }

  void Reserve() {
    const KvLayout& layout = kLayouts[Uniform(0, 1)];
    const int64_t layers = Uniform(1, 2), reserved = Uniform(1, 20);
    const int64_t tpb = *TokensPerBlock(layout, kBlockBytes);
    const int64_t needed = layers * ((reserved + tpb - 1) / tpb);
    const bool fits = needed <= pool_.Counters().blocks_available;
    const absl::StatusOr<SequenceId> id = pool_.Reserve(layout, layers, reserved);
    ASSERT_EQ(id.ok(), fits) << id.status();
    if (!fits) {
      ASSERT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted);
      return;
    }
    live_[*id] = Tags(layers);
  }

  void Ensure(SequenceId id) {
    const KvSequence& before = **pool_.Find(id);
    const int64_t old_length = before.length;
    const int64_t length = old_length + Uniform(0, 6);
    const bool within = length <= before.reserved_tokens;
    const absl::StatusOr<std::vector<BlockCopy>> copies = pool_.EnsureCapacity(id, length);
    // The promise: growth within the reservation never fails.
    ASSERT_EQ(copies.ok(), within) << copies.status();
    if (!within) {
      ASSERT_EQ(copies.status().code(), absl::StatusCode::kOutOfRange);
      return;
    }
    for (const BlockCopy& copy : *copies) {
      std::copy_n(&storage_[copy.from * kSlots], kSlots, &storage_[copy.to * kSlots]);
    }
    const KvSequence& after = **pool_.Find(id);
    Tags& tags = live_[id];
    for (int64_t layer = 0; layer < after.num_layers; ++layer) {
      for (int64_t t = old_length; t < length; ++t) {
        tags[layer].push_back(next_tag_);
        Slot(after.block_tables[layer], t, after.tokens_per_block) = next_tag_++;
      }
    }
  }

  void Fork(SequenceId source) {
    const int64_t length = (*pool_.Find(source))->length;
    const int64_t tokens = Uniform(0, static_cast<int>(length));
    const int64_t reserved = std::max<int64_t>(tokens, 1) + Uniform(0, 8);
    const absl::StatusOr<SequenceId> fork = pool_.Fork(source, tokens, reserved);
    if (!fork.ok()) {
      ASSERT_EQ(fork.status().code(), absl::StatusCode::kResourceExhausted) << fork.status();
      return;
    }
    Tags tags = live_[source];
    for (auto& layer : tags) layer.resize(tokens);
    live_[*fork] = std::move(tags);
  }

  void Truncate(SequenceId id) {
    const int64_t tokens = Uniform(0, static_cast<int>(live_[id][0].size()));
    std::vector<BlockId> freed;
    const absl::Status status = pool_.Truncate(id, tokens, &freed);
    if (!status.ok()) {
      ASSERT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
      ASSERT_TRUE(freed.empty());
      return;
    }
    Poison(freed);
    for (auto& layer : live_[id]) layer.resize(tokens);
  }

  void Release(SequenceId id) {
    std::vector<BlockId> freed;
    ASSERT_TRUE(pool_.Release(id, &freed).ok());
    Poison(freed);
    live_.erase(id);
  }

  void Poison(const std::vector<BlockId>& freed) {
    for (const BlockId block : freed) std::fill_n(&storage_[block * kSlots], kSlots, kPoison);
  }

  std::mt19937_64 rng_;
  KvBlockPool pool_;
  std::vector<int64_t> storage_;  // [block][slot] tags
  std::map<SequenceId, Tags> live_;
  int64_t next_tag_ = 1;
};

TEST(KvBlockPoolTest, RandomOperationsMatchASimulatedStorage) {
  constexpr uint64_t first_seed = 20261125;
  for (uint64_t seed = first_seed; seed < first_seed + 60; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    KvPoolSimulation simulation(seed);
    const KvPoolCounters baseline = simulation.pool().Counters();
    for (int step = 0; step < 500; ++step) {
      simulation.Step();
      simulation.Check();
      if (::testing::Test::HasFatalFailure()) {
        std::printf("KvPoolSimulation failed with seed %llu at step %d\n",
                    static_cast<unsigned long long>(seed), step);
        return;
      }
    }
    simulation.ReleaseAll();
    const KvPoolCounters after = simulation.pool().Counters();
    EXPECT_EQ(after.blocks_free, baseline.blocks_free);
    EXPECT_EQ(after.blocks_available, baseline.blocks_available);
    EXPECT_EQ(after.blocks_reserved, 0);
  }
}

}  // namespace
}  // namespace attention::core::kv_cache

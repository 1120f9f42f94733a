// Issue 25, section 3 (correctness) for the KV-cache session table:
// - a differential fuzzer: seeded random operations over sessions of several shapes against
//   a model that keeps every session's K/V densely per layer (as the server stores them:
//   bf16-rounded for bf16 sessions), the pool's blocks and promises (block_pool.h's
//   invariant), the clock, TTLs and tombstones; every status code, every counter and every
//   step's output (FlashAttention's rule against a float64 oracle, tests/core/fidelity.h)
//   and log-sum-exp must agree. ATTENTION_TEST_SEED picks the seed and
//   ATTENTION_SESSION_FUZZ_OPS the number of operations (a long run).
// - races: threads stepping, forking, truncating, dropping and expiring shared sessions.
// - memory: forks share their prefix; the pool holds the tokens written, rounded to blocks.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/casts.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/devices.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "server/sessions/session_table.h"
#include "tests/core/fidelity.h"
#include "tests/core/random_options.h"

namespace attention::server {
namespace {

using core::DType;
using core::testing::FidelityStats;
using core::testing::TestSeed;
using Code = absl::StatusCode;

const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);

// Whether two floats are the same bits (what the table stores and compares; NaN included).
bool SameBits(float a, float b) {
  return absl::bit_cast<uint32_t>(a) == absl::bit_cast<uint32_t>(b);
}

// ASAN and TSAN builds (scripts/test-asan, scripts/test-tsan) run fewer fuzzer operations and
// the long memory cases scaled down.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

int64_t ValueDim(const SessionShape& shape) {
  return shape.v_head_dim > 0 ? shape.v_head_dim : shape.head_dim;
}
float ScaleOf(const SessionShape& shape) {
  return shape.scale > 0 ? shape.scale : 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
}
float AsStored(float x, DType dtype) {
  return dtype == DType::kBFloat16 ? core::BFloat16ToFloat(core::FloatToBFloat16(x)) : x;
}
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t TokensPerBlockOf(const SessionShape& shape, int64_t block_bytes) {
  const core::kv_cache::KvLayout layout{shape.num_kv_heads, shape.head_dim, ValueDim(shape),
                                        shape.kv_dtype};
  return *core::kv_cache::TokensPerBlock(layout, block_bytes);
}
std::string Describe(const SessionShape& s) {
  return absl::StrCat("layers=", s.num_layers, " H=", s.num_heads, " Hkv=", s.num_kv_heads,
                      " dk=", s.head_dim, " dv=", ValueDim(s), " ", core::DTypeName(s.kv_dtype));
}

// Dense decode attention in precision T, the textbook loops: queries [n][H][dk] at positions
// position .. position + n - 1 attend keys 0 .. position + i of the dense, as-stored
// K [L][Hkv][dk] and V [L][Hkv][dv].
template <typename T>
void DenseDecode(const SessionShape& shape, const float* query, int64_t position, int64_t n,
                 const float* keys, const float* values, std::vector<T>* output,
                 std::vector<T>* log_sum_exp) {
  const int64_t heads = shape.num_heads, kv_heads = shape.num_kv_heads, dk = shape.head_dim;
  const int64_t dv = ValueDim(shape), group = heads / kv_heads;
  const T scale = static_cast<T>(ScaleOf(shape));
  output->assign(n * heads * dv, 0);
  log_sum_exp->assign(n * heads, 0);
  std::vector<T> scores;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t visible = position + i + 1;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kv = h / group;
      const float* q = query + (i * heads + h) * dk;
      scores.assign(visible, 0);
      T max = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        const float* k = keys + (j * kv_heads + kv) * dk;
        T dot = 0;
        for (int64_t c = 0; c < dk; ++c) dot += static_cast<T>(q[c]) * static_cast<T>(k[c]);
        scores[j] = dot * scale;
        max = std::max(max, scores[j]);
      }
      T sum = 0;
      for (T& x : scores) sum += (x = std::exp(x - max));
      for (int64_t c = 0; c < dv; ++c) {
        T acc = 0;
        for (int64_t j = 0; j < visible; ++j) {
          acc += scores[j] * static_cast<T>(values[(j * kv_heads + kv) * dv + c]);
        }
        (*output)[(i * heads + h) * dv + c] = acc / sum;
      }
      (*log_sum_exp)[i * heads + h] = max + std::log(sum);
    }
  }
}

// FlashAttention's rule on one step's answers (output, and log-sum-exp unless empty).
::testing::AssertionResult MatchesDense(const SessionShape& shape, const float* query,
                                        int64_t position, int64_t n, const float* keys,
                                        const float* values, absl::Span<const float> output,
                                        absl::Span<const float> log_sum_exp,
                                        FidelityStats& output_stats, FidelityStats& lse_stats) {
  std::vector<double> oracle, oracle_lse;
  std::vector<float> textbook, textbook_lse;
  DenseDecode<double>(shape, query, position, n, keys, values, &oracle, &oracle_lse);
  DenseDecode<float>(shape, query, position, n, keys, values, &textbook, &textbook_lse);
  ::testing::AssertionResult result = output_stats.Check(output, textbook, oracle);
  if (!result) return result << " (output)";
  if (log_sum_exp.empty()) return result;
  result = lse_stats.Check(log_sum_exp, textbook_lse, oracle_lse);
  if (!result) return result << " (log-sum-exp)";
  return result;
}

::testing::AssertionResult HasCode(const absl::Status& status, Code code,
                                   const std::vector<std::string>& parts = {}) {
  if (status.code() != code) {
    return ::testing::AssertionFailure() << status << "; want " << absl::StatusCodeToString(code)
                                         << " (" << absl::StrJoin(parts, " or ") << ")";
  }
  if (parts.empty()) return ::testing::AssertionSuccess();
  for (const std::string& part : parts) {
    if (absl::StrContains(status.message(), part)) return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << status << "; want a message with \"" << absl::StrJoin(parts, "\" or \"") << "\"";
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* env = std::getenv(name);
  return env != nullptr ? std::stoll(env) : fallback;
}

// ---------------------------------------------------------------------------------------
// The differential fuzzer.

struct FuzzConfig {
  int64_t block_bytes;
  int64_t blocks;
};

// Where a fuzzed table keeps its blocks: null makes a host table on the fuzzer's pool.
using StorageFactory = std::function<std::unique_ptr<core::kv_cache::KvStorage>(
    int64_t num_blocks, int64_t block_bytes)>;

class SessionFuzzer {
 public:
  SessionFuzzer(uint64_t seed, const FuzzConfig& config, core::ThreadPool& pool,
                const StorageFactory& storage = nullptr)
      : rng_(seed), config_(config) {
    options_.kv_cache_bytes = config.blocks * config.block_bytes;
    options_.block_bytes = config.block_bytes;
    options_.max_sessions = 8;
    options_.max_session_tokens = 256;
    options_.default_ttl = absl::Seconds(30);
    options_.max_ttl = absl::Seconds(120);
    options_.tombstone_ttl = absl::Seconds(100);
    options_.max_tombstones = 6;
    options_.poison_freed_blocks = true;
    auto table = storage == nullptr
                     ? SessionTable::Create(options_, pool)
                     : SessionTable::Create(options_, storage(config.blocks, config.block_bytes));
    EXPECT_TRUE(table.ok()) << table.status();
    table_ = *std::move(table);
    total_blocks_ = table_->Counters().pool.blocks_total;
    EXPECT_EQ(total_blocks_, config.blocks);
  }

  // Runs `ops` operations, stopping at the first failure (printing the last operations).
  void Run(int64_t ops) {
    for (op_ = 0; op_ < ops; ++op_) {
      now_ += absl::Milliseconds(Uniform(0, 1500));
      OneOperation();
      // Sessions ended by this operation, in creation order (a step ends them in id order).
      std::sort(ended_this_op_.begin(), ended_this_op_.end());
      for (const auto& [serial, id] : ended_this_op_) ended_.push_back(id);
      ended_this_op_.clear();
      if (!::testing::Test::HasFailure()) CheckCounters();
      if (::testing::Test::HasFailure()) {
        ADD_FAILURE() << "at operation " << op_ << "; the last operations, oldest first:\n  "
                      << absl::StrJoin(log_, "\n  ");
        return;
      }
    }
    // Everything dropped: the pool is back at its baseline.
    for (const std::string& id : AliveIds()) {
      const absl::Status status = table_->Drop(id, now_);
      std::vector<std::string> parts;
      if (Find(id, &parts) == nullptr) {
        EXPECT_TRUE(HasCode(status, Code::kNotFound, parts));
        continue;
      }
      EXPECT_TRUE(status.ok()) << status;
      End(id, Ending::kDropped, NewBatch());
    }
    CheckCounters();
    const core::kv_cache::KvPoolCounters pool = table_->Counters().pool;
    EXPECT_EQ(pool.blocks_free, pool.blocks_total);
    EXPECT_EQ(pool.blocks_available, pool.blocks_total);
    EXPECT_EQ(pool.blocks_reserved, 0);
    EXPECT_EQ(pool.blocks_shared, 0);
    EXPECT_EQ(pool.sequences, 0);
  }

  // "op code" -> count.
  const std::map<std::string, int64_t>& outcomes() const { return outcomes_; }
  int64_t steps_checked() const { return steps_checked_; }
  int64_t tokens_attended() const { return tokens_attended_; }
  FidelityStats& output_stats() { return output_stats_; }
  FidelityStats& lse_stats() { return lse_stats_; }

 private:
  enum class Ending { kDropped, kExpired };

  // The pool's view of a session: its blocks, by model id, as block_pool.h documents them.
  struct Sequence {
    int64_t layers = 0, tokens_per_block = 0, reserved = 0, length = 0;  // length: longest layer
    std::vector<std::vector<int64_t>> tables;
  };
  struct Last {  // the last step answered OK, for an exact retry
    bool valid = false;
    int64_t layer = 0, position = 0, n = 0;
    std::vector<float> q, k, v, output, lse;
    bool with_lse = false;
  };
  struct Session {
    std::string id;
    int64_t serial = 0;  // creation order
    SessionShape shape;
    absl::Duration ttl;
    absl::Time last_used;
    Sequence sequence;
    std::vector<std::vector<float>> k, v;          // [layer] [L][Hkv][d] as stored
    std::vector<std::vector<float>> raw_k, raw_v;  // as sent
    Last last;
    int64_t KeyRow() const { return shape.num_kv_heads * shape.head_dim; }
    int64_t ValueRow() const { return shape.num_kv_heads * ValueDim(shape); }
    int64_t Length(int64_t layer) const { return static_cast<int64_t>(k[layer].size()) / KeyRow(); }
    int64_t MinLength() const {
      int64_t length = std::numeric_limits<int64_t>::max();
      for (int64_t l = 0; l < shape.num_layers; ++l) length = std::min(length, Length(l));
      return length;
    }
  };
  struct Tombstone {
    std::string id;
    Ending ending;
    absl::Time when;
    int64_t batch;
  };
  struct Accounting {
    int64_t allocated = 0, growth = 0, copies = 0, shared = 0;
    int64_t Committed() const { return allocated + growth + copies; }
  };

  static const std::vector<SessionShape>& Shapes() {
    static const std::vector<SessionShape> shapes = {
        {2, 4, 2, 16, 0, DType::kFloat32, 0},       // GQA, two layers
        {1, 6, 1, 24, 40, DType::kFloat32, 0.3f},   // MQA, dk != dv, a given scale
        {3, 4, 2, 32, 16, DType::kBFloat16, 0},     // bf16 GQA, dk != dv, three layers
        {2, 2, 2, 8, 0, DType::kBFloat16, 0},       // bf16 multi-head
        {1, 8, 2, 16, 24, DType::kFloat32, 0.05f},  // GQA 4:1, dv > dk
    };
    return shapes;
  }

  int64_t Uniform(int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  bool Coin(double p) { return std::bernoulli_distribution(p)(rng_); }
  float Normal() { return std::normal_distribution<float>(0.0f, 1.0f)(rng_); }

  void Log(const std::string& line) {
    log_.push_back(absl::StrCat(op_, " t=", absl::FormatDuration(now_ - kT0), ": ", line));
    if (log_.size() > 24) log_.pop_front();
  }
  void Count(absl::string_view op, const absl::Status& status) {
    ++outcomes_[absl::StrCat(op, " ", absl::StatusCodeToString(status.code()))];
  }

  // Live sessions in creation order. Ids are random, so nothing the random choices depend on
  // may follow their order: a seed must replay the same operations.
  std::vector<std::string> AliveIds() const { return alive_; }
  void Add(Session session) {
    session.serial = next_serial_++;
    alive_.push_back(session.id);
    const std::string id = session.id;
    sessions_[id] = std::move(session);
  }
  // An id to use: mostly a live session's, else an ended or unknown one.
  std::string PickId(double alive = 0.93) {
    if (!alive_.empty() && Coin(alive)) return alive_[Uniform(0, alive_.size() - 1)];
    if (!ended_.empty() && Coin(0.8)) return ended_[Uniform(0, ended_.size() - 1)];
    return absl::StrCat("no-such-session-", Uniform(0, 3));
  }
  absl::Duration PickTtl() {
    switch (Uniform(0, 3)) {
      case 0:
        return absl::ZeroDuration();  // the default
      case 1:
        return absl::Seconds(10);
      case 2:
        return absl::Seconds(60);
      default:
        return Coin(0.1) ? absl::Seconds(200) : absl::Seconds(25);  // 200 s: past max_ttl
    }
  }
  bool TtlValid(absl::Duration ttl) const { return ttl <= options_.max_ttl; }
  absl::Duration TtlOf(absl::Duration ttl) const {
    return ttl == absl::ZeroDuration() ? options_.default_ttl : ttl;
  }
  int64_t PickReservation() {
    const int64_t r = Uniform(0, 99);
    if (r < 2) return 0;                                // invalid
    if (r < 4) return options_.max_session_tokens + 1;  // invalid
    if (r < 20) return Uniform(1, 24);                  // small
    if (r < 90) return Uniform(25, 160);
    return Uniform(161, options_.max_session_tokens);
  }
  bool ReservationValid(int64_t reserved) const {
    return reserved >= 1 && reserved <= options_.max_session_tokens;
  }

  // ---- the model of the pool

  Accounting Account(const std::vector<const Sequence*>& sequences) const {
    std::map<int64_t, std::pair<int64_t, int64_t>> blocks;  // holders, partial holders
    Accounting accounting;
    for (const Sequence* s : sequences) {
      accounting.growth += s->layers * (CeilDiv(s->reserved, s->tokens_per_block) -
                                        CeilDiv(s->length, s->tokens_per_block));
      for (const auto& table : s->tables) {
        for (const int64_t block : table) ++blocks[block].first;
        if (s->length % s->tokens_per_block != 0) {
          ++blocks[table[s->length / s->tokens_per_block]].second;
        }
      }
    }
    for (const auto& [block, holders] : blocks) {
      ++accounting.allocated;
      accounting.shared += holders.first > 1;
      if (holders.second > 0) accounting.copies += std::min(holders.second, holders.first - 1);
    }
    return accounting;
  }
  // The accounting with `replace` (a session's id, or "" for none) swapped for `with`.
  Accounting AccountWith(const std::string& replace, const Sequence* with) const {
    std::vector<const Sequence*> sequences;
    for (const auto& [id, session] : sessions_) {
      if (id != replace) sequences.push_back(&session.sequence);
    }
    if (with != nullptr) sequences.push_back(with);
    return Account(sequences);
  }
  int64_t Holders(int64_t block) const {
    int64_t holders = 0;
    for (const auto& [id, session] : sessions_) {
      for (const auto& table : session.sequence.tables) {
        holders += std::count(table.begin(), table.end(), block);
      }
    }
    return holders;
  }
  // EnsureCapacity: copy a shared partial tail in every layer, then new blocks.
  void Grow(Session& session, int64_t end) {
    Sequence& s = session.sequence;
    if (end <= s.length) return;
    for (auto& table : s.tables) {
      if (s.length % s.tokens_per_block != 0) {
        int64_t& tail = table[s.length / s.tokens_per_block];
        if (Holders(tail) > 1) tail = next_block_++;
      }
      while (static_cast<int64_t>(table.size()) < CeilDiv(end, s.tokens_per_block)) {
        table.push_back(next_block_++);
      }
    }
    s.length = end;
  }

  void CheckCounters() {
    const SessionCounters counters = table_->Counters();
    const Accounting a = AccountWith("", nullptr);
    const int64_t alive = static_cast<int64_t>(sessions_.size());
    EXPECT_EQ(counters.sessions, alive);
    EXPECT_EQ(counters.pool.sequences, alive);
    EXPECT_EQ(counters.tombstones, static_cast<int64_t>(tombstones_.size()));
    EXPECT_EQ(counters.pool.blocks_total, total_blocks_);
    EXPECT_EQ(counters.pool.blocks_free, total_blocks_ - a.allocated);
    EXPECT_EQ(counters.pool.blocks_shared, a.shared);
    EXPECT_EQ(counters.pool.blocks_reserved, a.growth + a.copies);
    EXPECT_EQ(counters.pool.blocks_available, total_blocks_ - a.Committed());
    EXPECT_LE(a.Committed(), total_blocks_);
  }

  // ---- the model of the table's lookups, TTLs and tombstones

  int64_t NewBatch() { return next_batch_++; }

  void Forget() {
    while (!tombstones_.empty() && now_ - tombstones_.front().when > options_.tombstone_ttl) {
      --batch_count_[tombstones_.front().batch];
      tombstones_.pop_front();
    }
  }
  // EndLocked. Sessions ended together (one ExpireIdle) share a batch: the table tombstones
  // them in hash order, so when max_tombstones evicts part of a batch the model no longer
  // knows which, and accepts either answer for its ids.
  void End(const std::string& id, Ending ending, int64_t batch) {
    ended_this_op_.emplace_back(sessions_.at(id).serial, id);
    alive_.erase(std::find(alive_.begin(), alive_.end(), id));
    sessions_.erase(id);
    if (options_.max_tombstones == 0) return;
    while (static_cast<int64_t>(tombstones_.size()) >= options_.max_tombstones) {
      const int64_t evicted = tombstones_.front().batch;
      tombstones_.pop_front();
      if (--batch_count_[evicted] > 0) uncertain_.insert(evicted);
    }
    tombstones_.push_back({id, ending, now_, batch});
    ++batch_count_[batch];
    batch_of_[id] = {batch, ending};
  }
  // FindLocked: forgets old tombstones, expires the session if idle past its TTL, renews it.
  // Null when not found, with the messages NOT_FOUND may carry in `parts`.
  Session* Find(const std::string& id, std::vector<std::string>* parts) {
    Forget();
    auto it = sessions_.find(id);
    if (it != sessions_.end() && now_ - it->second.last_used > it->second.ttl) {
      End(id, Ending::kExpired, NewBatch());
      it = sessions_.end();
    }
    if (it != sessions_.end()) {
      it->second.last_used = now_;
      return &it->second;
    }
    if (parts != nullptr) *parts = NotFoundMessages(id);
    return nullptr;
  }
  static std::string EndingMessage(Ending ending) {
    return ending == Ending::kExpired ? "expired: it was idle longer than its ttl" : "was dropped";
  }
  std::vector<std::string> NotFoundMessages(const std::string& id) const {
    const auto ended = batch_of_.find(id);
    if (ended == batch_of_.end()) return {"is unknown on this server"};
    const auto [batch, ending] = ended->second;
    const auto count = batch_count_.find(batch);
    if (count == batch_count_.end() || count->second == 0) return {"is unknown on this server"};
    const bool queued = std::any_of(tombstones_.begin(), tombstones_.end(),
                                    [&](const Tombstone& t) { return t.id == id; });
    if (uncertain_.count(batch) > 0) return {EndingMessage(ending), "is unknown on this server"};
    if (queued) return {EndingMessage(ending)};
    return {"is unknown on this server"};
  }
  int64_t ExpireModel() {
    Forget();
    std::vector<std::string> idle;
    for (const std::string& id : alive_) {
      const Session& session = sessions_.at(id);
      if (now_ - session.last_used > session.ttl) idle.push_back(id);
    }
    const int64_t batch = NewBatch();
    for (const std::string& id : idle) End(id, Ending::kExpired, batch);
    return static_cast<int64_t>(idle.size());
  }

  void CheckInfo(const SessionInfo& info, const Session& session) {
    EXPECT_EQ(info.id, session.id);
    EXPECT_EQ(info.length, session.MinLength());
    EXPECT_EQ(info.reserved_tokens, session.sequence.reserved);
    EXPECT_EQ(info.kv_bytes,
              session.shape.num_layers *
                  CeilDiv(session.sequence.length, session.sequence.tokens_per_block) *
                  options_.block_bytes);
    EXPECT_EQ(info.ttl, session.ttl);
    EXPECT_EQ(info.last_used, session.last_used);
    EXPECT_EQ(info.shape.num_heads, session.shape.num_heads);
    EXPECT_EQ(info.shape.num_layers, session.shape.num_layers);
  }

  // ---- operations

  void OneOperation() {
    const int64_t r = Uniform(0, 99);
    if (sessions_.size() < 2 && Coin(0.5)) return CreateOp();
    if (r < 10) return CreateOp();
    if (r < 60) return StepOp();
    if (r < 70) return ForkOp();
    if (r < 77) return TruncateOp();
    if (r < 83) return DropOp();
    if (r < 90) return GetOp();
    if (r < 97) return ExpireOp();
    return ListOp();
  }

  void CreateOp() {
    const SessionShape& shape = Shapes()[Uniform(0, Shapes().size() - 1)];
    int64_t reserved = PickReservation();
    if (Coin(0.15)) {  // all the pool can still promise, so that rollbacks run out
      const int64_t available = table_->Counters().pool.blocks_available;
      reserved = std::clamp<int64_t>(
          available / shape.num_layers * TokensPerBlockOf(shape, options_.block_bytes), 1,
          options_.max_session_tokens);
    }
    const absl::Duration ttl = PickTtl();
    Log(absl::StrCat("create ", Describe(shape), " reserved=", reserved,
                     " ttl=", absl::FormatDuration(ttl)));
    const absl::StatusOr<SessionInfo> info = table_->CreateSession(shape, reserved, ttl, now_);
    Count("create", info.status());
    if (!ReservationValid(reserved) || !TtlValid(ttl)) {
      EXPECT_TRUE(HasCode(info.status(), Code::kInvalidArgument));
      return;
    }
    if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
      EXPECT_TRUE(HasCode(info.status(), Code::kResourceExhausted, {"max_sessions"}));
      return;
    }
    Sequence sequence;
    sequence.layers = shape.num_layers;
    sequence.tokens_per_block = TokensPerBlockOf(shape, options_.block_bytes);
    sequence.reserved = reserved;
    sequence.tables.resize(shape.num_layers);
    if (AccountWith("", &sequence).Committed() > total_blocks_) {
      EXPECT_TRUE(HasCode(info.status(), Code::kResourceExhausted, {"KV pool cannot promise"}));
      return;
    }
    ASSERT_TRUE(info.ok()) << info.status();
    Session session;
    session.id = info->id;
    session.shape = shape;
    session.ttl = TtlOf(ttl);
    session.last_used = now_;
    session.sequence = std::move(sequence);
    session.k.resize(shape.num_layers);
    session.v.resize(shape.num_layers);
    session.raw_k.resize(shape.num_layers);
    session.raw_v.resize(shape.num_layers);
    ASSERT_FALSE((sessions_.count(info->id) > 0));
    Add(std::move(session));
    const Session& stored = sessions_.at(info->id);
    CheckInfo(*info, stored);
    Log(absl::StrCat("  -> ", info->id));
  }

  void ForkOp() {
    const std::string source_id = PickId();
    const auto source_it = sessions_.find(source_id);
    const int64_t written = source_it != sessions_.end() ? source_it->second.MinLength() : 3;
    const int64_t tokens = Coin(0.92) ? Uniform(0, written) : written + Uniform(1, 3);
    int64_t reserved = tokens + Uniform(0, 100);
    if (Coin(0.15) && source_it != sessions_.end()) {  // about all the pool can still promise
      const int64_t available = table_->Counters().pool.blocks_available;
      reserved = tokens + available / source_it->second.shape.num_layers *
                              source_it->second.sequence.tokens_per_block;
    }
    if (Coin(0.05)) reserved = tokens - 1;
    if (Coin(0.02)) reserved = options_.max_session_tokens + 1;
    if (Coin(0.05)) reserved = 0;  // the source's reservation
    const absl::Duration ttl = PickTtl();
    Log(absl::StrCat("fork ", source_id, " tokens=", tokens, " reserved=", reserved,
                     " ttl=", absl::FormatDuration(ttl)));
    const absl::StatusOr<SessionInfo> info = table_->Fork(source_id, tokens, reserved, ttl, now_);
    Count("fork", info.status());
    if ((reserved != 0 && !ReservationValid(reserved)) || !TtlValid(ttl)) {
      EXPECT_TRUE(HasCode(info.status(), Code::kInvalidArgument));
      return;
    }
    std::vector<std::string> parts;
    Session* source = Find(source_id, &parts);
    if (source == nullptr) {
      EXPECT_TRUE(HasCode(info.status(), Code::kNotFound, parts));
      return;
    }
    if (reserved == 0) reserved = source->sequence.reserved;  // 0: the source's
    if (tokens > source->MinLength()) {
      EXPECT_TRUE(HasCode(info.status(), Code::kOutOfRange));
      return;
    }
    if (reserved < tokens) {
      EXPECT_TRUE(HasCode(info.status(), Code::kInvalidArgument));
      return;
    }
    if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
      EXPECT_TRUE(HasCode(info.status(), Code::kResourceExhausted, {"max_sessions"}));
      return;
    }
    Sequence sequence = source->sequence;
    sequence.reserved = reserved;
    sequence.length = tokens;
    for (auto& table : sequence.tables) table.resize(CeilDiv(tokens, sequence.tokens_per_block));
    if (AccountWith("", &sequence).Committed() > total_blocks_) {
      EXPECT_TRUE(HasCode(info.status(), Code::kResourceExhausted, {"KV pool cannot promise"}));
      return;
    }
    ASSERT_TRUE(info.ok()) << info.status();
    Session fork;
    fork.id = info->id;
    fork.shape = source->shape;
    fork.ttl = ttl == absl::ZeroDuration() ? source->ttl : ttl;  // 0: the source's
    fork.last_used = now_;
    fork.sequence = std::move(sequence);
    const int64_t key_row = source->KeyRow(), value_row = source->ValueRow();
    for (int64_t l = 0; l < fork.shape.num_layers; ++l) {
      fork.k.emplace_back(source->k[l].begin(), source->k[l].begin() + tokens * key_row);
      fork.v.emplace_back(source->v[l].begin(), source->v[l].begin() + tokens * value_row);
      fork.raw_k.emplace_back(source->raw_k[l].begin(),
                              source->raw_k[l].begin() + tokens * key_row);
      fork.raw_v.emplace_back(source->raw_v[l].begin(),
                              source->raw_v[l].begin() + tokens * value_row);
    }
    ASSERT_FALSE((sessions_.count(info->id) > 0));
    Add(std::move(fork));
    const Session& stored = sessions_.at(info->id);
    CheckInfo(*info, stored);
    Log(absl::StrCat("  -> ", info->id));
  }

  void TruncateOp() {
    const std::string id = PickId();
    const auto it = sessions_.find(id);
    const int64_t longest = it != sessions_.end() ? it->second.sequence.length : 3;
    int64_t tokens = Uniform(0, longest);
    if (Coin(0.3)) tokens = std::max<int64_t>(0, longest - Uniform(1, 8));  // speculation
    if (Coin(0.05)) tokens = longest + Uniform(1, 3);
    if (Coin(0.03)) tokens = -1;
    Log(absl::StrCat("truncate ", id, " to ", tokens));
    const absl::StatusOr<SessionInfo> info = table_->Truncate(id, tokens, now_);
    Count("truncate", info.status());
    std::vector<std::string> parts;
    Session* session = Find(id, &parts);
    if (session == nullptr) {
      EXPECT_TRUE(HasCode(info.status(), Code::kNotFound, parts));
      return;
    }
    if (tokens < 0 || tokens > session->sequence.length) {
      EXPECT_TRUE(HasCode(info.status(), Code::kOutOfRange));
      return;
    }
    Sequence sequence = session->sequence;
    for (auto& table : sequence.tables) table.resize(CeilDiv(tokens, sequence.tokens_per_block));
    sequence.length = tokens;
    if (AccountWith(id, &sequence).Committed() > total_blocks_) {
      EXPECT_TRUE(HasCode(info.status(), Code::kResourceExhausted, {"KV pool cannot promise"}));
      return;
    }
    ASSERT_TRUE(info.ok()) << info.status();
    session->sequence = std::move(sequence);
    for (int64_t l = 0; l < session->shape.num_layers; ++l) {
      const int64_t length = std::min(session->Length(l), tokens);
      session->k[l].resize(length * session->KeyRow());
      session->v[l].resize(length * session->ValueRow());
      session->raw_k[l].resize(length * session->KeyRow());
      session->raw_v[l].resize(length * session->ValueRow());
    }
    if (session->last.valid && session->last.position + session->last.n > tokens) {
      session->last.valid = false;
    }
    CheckInfo(*info, *session);
  }

  void DropOp() {
    const std::string id = PickId(0.85);
    Log(absl::StrCat("drop ", id));
    const absl::Status status = table_->Drop(id, now_);
    Count("drop", status);
    std::vector<std::string> parts;
    if (Find(id, &parts) == nullptr) {
      EXPECT_TRUE(HasCode(status, Code::kNotFound, parts));
      return;
    }
    EXPECT_TRUE(status.ok()) << status;
    End(id, Ending::kDropped, NewBatch());
  }

  void GetOp() {
    const std::string id = PickId(0.85);
    Log(absl::StrCat("get ", id));
    const absl::StatusOr<SessionInfo> info = table_->Get(id, now_);
    Count("get", info.status());
    std::vector<std::string> parts;
    const Session* session = Find(id, &parts);
    if (session == nullptr) {
      EXPECT_TRUE(HasCode(info.status(), Code::kNotFound, parts));
      return;
    }
    ASSERT_TRUE(info.ok()) << info.status();
    CheckInfo(*info, *session);
  }

  void ExpireOp() {
    now_ += absl::Seconds(Uniform(3, 40));
    Log("expire idle");
    const int64_t expired = table_->ExpireIdle(now_);
    ++outcomes_["expire-idle"];
    outcomes_["expired sessions"] += expired;
    EXPECT_EQ(expired, ExpireModel());
  }

  void ListOp() {
    Log("list");
    const std::vector<SessionInfo> infos = table_->List(now_);
    ++outcomes_["list"];
    ExpireModel();
    ASSERT_EQ(infos.size(), sessions_.size());
    for (const SessionInfo& info : infos) {
      const auto it = sessions_.find(info.id);
      ASSERT_NE(it, sessions_.end()) << info.id;
      CheckInfo(info, it->second);
    }
  }

  // One entry of a step and the buffers it points into.
  struct EntryData {
    StepEntry entry;
    std::vector<float> q, k, v, output, lse;
    bool retry = false;  // an exact retry of the session's last step
    Last last;           // what that step answered
  };

  // Fills `data` for `n` tokens at `position` of `layer` of `session`: K/V of written
  // positions as the session holds them (as sent or as stored), new ones random; a conflict
  // changes one written value.
  void MakeRows(const Session& session, int64_t layer, int64_t position, int64_t n, bool conflict,
                EntryData* data) {
    const SessionShape& shape = session.shape;
    const int64_t key_row = session.KeyRow(), value_row = session.ValueRow();
    const int64_t length = layer >= 0 && layer < shape.num_layers ? session.Length(layer) : 0;
    data->q.resize(std::max<int64_t>(n, 0) * shape.num_heads * shape.head_dim);
    for (float& x : data->q) x = Normal();
    data->k.resize(std::max<int64_t>(n, 0) * key_row);
    data->v.resize(std::max<int64_t>(n, 0) * value_row);
    const bool as_sent = Coin(0.5);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = position + i;
      if (t >= 0 && t < length) {
        const auto& k = as_sent ? session.raw_k[layer] : session.k[layer];
        const auto& v = as_sent ? session.raw_v[layer] : session.v[layer];
        std::copy_n(k.begin() + t * key_row, key_row, data->k.begin() + i * key_row);
        std::copy_n(v.begin() + t * value_row, value_row, data->v.begin() + i * value_row);
      } else {
        for (int64_t c = 0; c < key_row; ++c) data->k[i * key_row + c] = Normal();
        for (int64_t c = 0; c < value_row; ++c) data->v[i * value_row + c] = Normal();
      }
    }
    const int64_t written_end = std::min(position + n, length);
    if (conflict && written_end > position && position >= 0) {
      const int64_t i = Uniform(0, written_end - position - 1);
      const bool key = Coin(0.5);
      float& x = key ? data->k[i * key_row + Uniform(0, key_row - 1)]
                     : data->v[i * value_row + Uniform(0, value_row - 1)];
      const float before = AsStored(x, shape.kv_dtype);
      do x += 1.0f;
      while (AsStored(x, shape.kv_dtype) == before);
    }
  }

  void AddEntry(std::vector<EntryData>& batch) {
    EntryData data;
    StepEntry& e = data.entry;
    const std::string id = PickId(0.95);
    e.session_id = id;
    const auto it = sessions_.find(id);
    if (it == sessions_.end()) {  // ended or unknown: any well-formed entry
      const SessionShape& shape = Shapes()[Uniform(0, Shapes().size() - 1)];
      Session fake;
      fake.shape = shape;
      fake.k.resize(shape.num_layers);
      fake.v.resize(shape.num_layers);
      fake.raw_k.resize(shape.num_layers);
      fake.raw_v.resize(shape.num_layers);
      e.layer = 0;
      e.position = 0;
      e.num_tokens = Uniform(1, 4);
      MakeRows(fake, 0, 0, e.num_tokens, false, &data);
    } else {
      const Session& s = it->second;
      e.layer = Uniform(0, s.shape.num_layers - 1);
      const int64_t length = s.Length(e.layer), reserved = s.sequence.reserved;
      const int64_t room = reserved - length;
      bool conflict = false;
      const int64_t kind = Uniform(0, 99);
      if (kind < 8 && s.last.valid) {  // an exact retry
        data.retry = true;
        data.last = s.last;
        e.layer = s.last.layer;
        e.position = s.last.position;
        e.num_tokens = s.last.n;
        data.q = s.last.q;
        data.k = s.last.k;
        data.v = s.last.v;
      } else {
        if (kind < 45) {  // append
          e.position = length;
          e.num_tokens = Uniform(1, std::clamp<int64_t>(room, 1, 64));
        } else if (kind < 60) {  // overlapping the end
          e.position = Uniform(std::max<int64_t>(0, length - 6), length);
          e.num_tokens = Uniform(1, 64);
        } else if (kind < 75 && length > 0) {  // rewriting written positions
          e.position = Uniform(0, length - 1);
          e.num_tokens = Uniform(1, std::min<int64_t>(64, length - e.position));
        } else if (kind < 85 && length > 0) {  // other K/V at written positions
          e.position = Uniform(0, length - 1);
          e.num_tokens = Uniform(1, 64);
          conflict = true;
        } else if (kind < 90) {  // a gap
          e.position = length + Uniform(1, 4);
          e.num_tokens = Uniform(1, 8);
        } else if (kind < 96) {  // past the reservation
          e.position = Uniform(std::max<int64_t>(0, length - 3), length);
          e.num_tokens = reserved - e.position + Uniform(1, 3);
        } else {  // malformed
          switch (Uniform(0, 3)) {
            case 0:
              e.layer = s.shape.num_layers;
              break;
            case 1:
              e.layer = -1;
              break;
            case 2:
              e.num_tokens = 0;
              break;
            default:
              e.position = -1;
          }
          if (e.num_tokens == 0 && Coin(0.5)) e.num_tokens = Uniform(1, 4);
        }
        MakeRows(s, e.layer, e.position, e.num_tokens, conflict, &data);
      }
    }
    batch.push_back(std::move(data));
  }

  void StepOp() {
    std::vector<EntryData> batch;
    const int64_t entries = Coin(0.6) ? 1 : Uniform(2, 5);
    for (int64_t i = 0; i < entries; ++i) AddEntry(batch);
    // Sometimes one append split in two entries listed in reverse order.
    if (Coin(0.1) && !batch.empty() && (sessions_.count(batch[0].entry.session_id) > 0) &&
        batch[0].entry.num_tokens >= 2 && !batch[0].retry) {
      EntryData& first = batch[0];
      const int64_t split = Uniform(1, first.entry.num_tokens - 1);
      const Session& s = sessions_.at(first.entry.session_id);
      EntryData second;
      second.entry = first.entry;
      second.entry.position += split;
      second.entry.num_tokens -= split;
      const int64_t qrow = s.shape.num_heads * s.shape.head_dim;
      second.q.assign(first.q.begin() + split * qrow, first.q.end());
      second.k.assign(first.k.begin() + split * s.KeyRow(), first.k.end());
      second.v.assign(first.v.begin() + split * s.ValueRow(), first.v.end());
      first.q.resize(split * qrow);
      first.k.resize(split * s.KeyRow());
      first.v.resize(split * s.ValueRow());
      first.entry.num_tokens = split;
      batch.insert(batch.begin(), std::move(second));
    }
    std::vector<StepEntry> entries_in;
    std::string line = "step";
    for (EntryData& data : batch) {
      StepEntry& e = data.entry;
      const auto it = sessions_.find(e.session_id);
      const SessionShape shape =
          it != sessions_.end() ? it->second.shape : SessionShape{1, 8, 8, 64, 64};
      const int64_t n = std::max<int64_t>(e.num_tokens, 0);
      data.output.assign(n * shape.num_heads * ValueDim(shape), -7.5f);
      if (Coin(0.8)) data.lse.assign(n * shape.num_heads, -7.5f);
      e.query = data.q.data();
      e.key = data.k.data();
      e.value = data.v.data();
      e.output = data.output.data();
      e.log_sum_exp = data.lse.empty() ? nullptr : data.lse.data();
      entries_in.push_back(e);
      absl::StrAppend(&line, " [", e.session_id, " layer=", e.layer, " pos=", e.position,
                      " n=", e.num_tokens, data.retry ? " retry" : "", "]");
    }
    Log(line);
    const std::vector<absl::Status> statuses = table_->Step(entries_in, now_);
    ASSERT_EQ(statuses.size(), batch.size());

    // The model, in the table's order: by session, layer and position, stable.
    std::vector<size_t> order(batch.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const StepEntry &x = batch[a].entry, &y = batch[b].entry;
      return std::tie(x.session_id, x.layer, x.position) <
             std::tie(y.session_id, y.layer, y.position);
    });
    std::vector<Session*> ok(batch.size(), nullptr);
    for (const size_t i : order) {
      const StepEntry& e = batch[i].entry;
      const absl::Status& status = statuses[i];
      Count("step", status);
      std::vector<std::string> parts;
      Session* s = Find(e.session_id, &parts);
      if (s == nullptr) {
        EXPECT_TRUE(HasCode(status, Code::kNotFound, parts)) << "entry " << i;
        continue;
      }
      if (e.layer < 0 || e.layer >= s->shape.num_layers || e.num_tokens < 1 || e.position < 0) {
        EXPECT_TRUE(HasCode(status, Code::kInvalidArgument)) << "entry " << i;
        continue;
      }
      const int64_t length = s->Length(e.layer), end = e.position + e.num_tokens;
      if (e.position > length) {
        EXPECT_TRUE(HasCode(status, Code::kOutOfRange, {"leaves a gap"})) << "entry " << i;
        continue;
      }
      if (end > s->sequence.reserved) {
        EXPECT_TRUE(HasCode(status, Code::kOutOfRange, {"past the session's reservation"}))
            << "entry " << i;
        continue;
      }
      const int64_t key_row = s->KeyRow(), value_row = s->ValueRow();
      int64_t conflict = -1;
      for (int64_t t = e.position; t < std::min(end, length) && conflict < 0; ++t) {
        const int64_t row = t - e.position;
        for (int64_t c = 0; c < key_row && conflict < 0; ++c) {
          const float x = AsStored(e.key[row * key_row + c], s->shape.kv_dtype);
          if (!SameBits(x, s->k[e.layer][t * key_row + c])) conflict = t;
        }
        for (int64_t c = 0; c < value_row && conflict < 0; ++c) {
          const float x = AsStored(e.value[row * value_row + c], s->shape.kv_dtype);
          if (!SameBits(x, s->v[e.layer][t * value_row + c])) conflict = t;
        }
      }
      if (conflict >= 0) {
        EXPECT_TRUE(HasCode(status, Code::kFailedPrecondition,
                            {absl::StrCat("position ", conflict, " of layer ", e.layer,
                                          " already holds other keys or values")}))
            << "entry " << i;
        continue;
      }
      EXPECT_TRUE(status.ok()) << status << " entry " << i;
      if (!status.ok()) continue;
      ok[i] = s;
      if (end > length) {
        Grow(*s, end);
        for (int64_t t = length; t < end; ++t) {
          const int64_t row = t - e.position;
          for (int64_t c = 0; c < key_row; ++c) {
            const float x = e.key[row * key_row + c];
            s->raw_k[e.layer].push_back(x);
            s->k[e.layer].push_back(AsStored(x, s->shape.kv_dtype));
          }
          for (int64_t c = 0; c < value_row; ++c) {
            const float x = e.value[row * value_row + c];
            s->raw_v[e.layer].push_back(x);
            s->v[e.layer].push_back(AsStored(x, s->shape.kv_dtype));
          }
        }
      }
    }
    // Answers: failed entries are untouched; the others hold the rule against the dense
    // reference of the session's K/V after the whole step, and a retry repeats its bits.
    for (size_t i = 0; i < batch.size(); ++i) {
      EntryData& data = batch[i];
      const StepEntry& e = data.entry;
      if (ok[i] == nullptr) {
        EXPECT_TRUE(
            std::all_of(data.output.begin(), data.output.end(), [](float x) { return x == -7.5f; }))
            << "a failed entry wrote its output, entry " << i;
        EXPECT_TRUE(
            std::all_of(data.lse.begin(), data.lse.end(), [](float x) { return x == -7.5f; }))
            << "a failed entry wrote its log-sum-exp, entry " << i;
        continue;
      }
      Session& s = *ok[i];
      EXPECT_TRUE(MatchesDense(s.shape, e.query, e.position, e.num_tokens, s.k[e.layer].data(),
                               s.v[e.layer].data(), data.output, data.lse, output_stats_,
                               lse_stats_))
          << "entry " << i << " (" << Describe(s.shape) << ")";
      ++steps_checked_;
      tokens_attended_ += e.num_tokens;
      if (data.retry) {
        ++outcomes_["step exact retries"];
        EXPECT_EQ(data.output, data.last.output) << "a retry answered other bits, entry " << i;
        if (data.last.with_lse && !data.lse.empty()) {
          EXPECT_EQ(data.lse, data.last.lse) << "a retry answered other bits, entry " << i;
        }
      }
      Last& last = s.last;
      last.valid = true;
      last.layer = e.layer;
      last.position = e.position;
      last.n = e.num_tokens;
      last.q = data.q;
      last.k = data.k;
      last.v = data.v;
      last.output = data.output;
      last.lse = data.lse;
      last.with_lse = !data.lse.empty();
    }
  }

  std::mt19937_64 rng_;
  FuzzConfig config_;
  SessionTableOptions options_;
  std::unique_ptr<SessionTable> table_;
  int64_t total_blocks_ = 0;
  absl::Time now_ = kT0;
  int64_t op_ = 0;
  std::map<std::string, Session> sessions_;
  std::vector<std::string> alive_, ended_;
  std::vector<std::pair<int64_t, std::string>> ended_this_op_;
  int64_t next_serial_ = 0;
  std::deque<Tombstone> tombstones_;
  std::map<std::string, std::pair<int64_t, Ending>> batch_of_;
  std::map<int64_t, int64_t> batch_count_;
  std::set<int64_t> uncertain_;
  int64_t next_batch_ = 0;
  int64_t next_block_ = 0;
  std::deque<std::string> log_;
  std::map<std::string, int64_t> outcomes_;
  int64_t steps_checked_ = 0, tokens_attended_ = 0;
  FidelityStats output_stats_{"session fuzz output"};
  FidelityStats lse_stats_{"session fuzz log-sum-exp"};
};

// Runs the fuzzer over each block layout, a third of `ops` each, on `storage`'s blocks, and
// checks that every outcome the table can give came up.
void FuzzTables(uint64_t seed, int64_t ops, const StorageFactory& storage) {
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  core::ThreadPool pool(2);
  // Small blocks (4 to 64 tokens) make forks share, copy and cross block boundaries often;
  // the last pool is small enough that admission and rollbacks into shared blocks run out.
  const FuzzConfig configs[] = {{1024, 480}, {4096, 160}, {1024, 64}};
  const auto start = std::chrono::steady_clock::now();
  std::map<std::string, int64_t> outcomes;
  int64_t steps = 0, tokens = 0;
  for (size_t c = 0; c < std::size(configs); ++c) {
    SCOPED_TRACE(absl::StrCat("block_bytes ", configs[c].block_bytes));
    SessionFuzzer fuzzer(seed + c, configs[c], pool, storage);
    fuzzer.Run(ops / static_cast<int64_t>(std::size(configs)));
    for (const auto& [name, count] : fuzzer.outcomes()) outcomes[name] += count;
    steps += fuzzer.steps_checked();
    tokens += fuzzer.tokens_attended();
    if (::testing::Test::HasFailure()) return;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::string summary;
  for (const auto& [name, count] : outcomes) absl::StrAppend(&summary, "\n  ", name, ": ", count);
  std::printf("seed %llu, %lld operations in %.2f s: %lld step entries checked (%lld tokens)%s\n",
              static_cast<unsigned long long>(seed), static_cast<long long>(ops), seconds,
              static_cast<long long>(steps), static_cast<long long>(tokens), summary.c_str());
  // Every outcome the table can give came up, so the run exercised what it claims.
  for (const char* outcome :
       {"step OK", "step NOT_FOUND", "step OUT_OF_RANGE", "step FAILED_PRECONDITION",
        "step INVALID_ARGUMENT", "step exact retries", "create OK", "create RESOURCE_EXHAUSTED",
        "fork OK", "fork OUT_OF_RANGE", "truncate OK", "drop OK", "drop NOT_FOUND", "get OK",
        "expired sessions"}) {
    EXPECT_GT(outcomes[outcome], 0) << outcome;
  }
}

TEST(SessionTableFuzzTest, RandomOperationsMatchADenseReference) {
  FuzzTables(TestSeed(20260325), EnvInt("ATTENTION_SESSION_FUZZ_OPS", kSanitized ? 1000 : 3000),
             nullptr);
}

// The same on a GPU's KV storage (--kv_cache_device=cuda:0): writes, retries, block copies,
// poisoned frees and the CUDA paged decode kernel against the same dense reference.
TEST(SessionTableFuzzTest, OnCudaStorageRandomOperationsMatchADenseReference) {
  core::Devices devices(1);
  std::string why_none;
  if (devices.GpuCount(&why_none) == 0) GTEST_SKIP() << "no GPU: " << why_none;
  const auto probe = devices.CreateKvStorage("cuda:0", 1, 1024);
  ASSERT_TRUE(probe.ok()) << probe.status();
  FuzzTables(TestSeed(20261126), EnvInt("ATTENTION_SESSION_FUZZ_OPS", 3000),
             [&](int64_t num_blocks, int64_t block_bytes) {
               auto storage = devices.CreateKvStorage("cuda:0", num_blocks, block_bytes);
               EXPECT_TRUE(storage.ok()) << storage.status();
               EXPECT_EQ((*storage)->device(), "cuda:0");
               return *std::move(storage);
             });
}

// ---------------------------------------------------------------------------------------
// Races: threads step, fork, truncate, drop and expire shared sessions. Every session of a
// shape holds the same K/V at each position (a prefix of one source), whatever the
// interleaving, so no step may conflict and every answer is checked against the source.

// A cyclic barrier: every thread starts round i + 1 after all have finished round i, so
// that the threads' calls overlap (without it, each would run its loop within one time
// slice of two shared cores). std:: synchronization, which TSAN sees.
class Rounds {
 public:
  explicit Rounds(int threads) : threads_(threads) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t round = round_;
    if (++waiting_ == threads_) {
      waiting_ = 0;
      ++round_;
      all_here_.notify_all();
      return;
    }
    all_here_.wait(lock, [&] { return round_ != round; });
  }

 private:
  const int threads_;
  std::mutex mu_;
  std::condition_variable all_here_;
  int waiting_ = 0;
  int64_t round_ = 0;
};

TEST(SessionTableRaceTest, StepsForksTruncationsDropsAndExpiriesOnSharedSessions) {
  const uint64_t seed = TestSeed(20260326);
  const int64_t iterations = EnvInt("ATTENTION_SESSION_RACE_ITERATIONS", 2000);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  core::ThreadPool pool(2);
  SessionTableOptions options;
  options.block_bytes = 4096;
  options.kv_cache_bytes = 160 * options.block_bytes;
  options.max_sessions = 12;
  options.default_ttl = absl::Seconds(4);
  options.tombstone_ttl = absl::Seconds(10);
  options.max_tombstones = 32;
  options.poison_freed_blocks = true;
  auto created = SessionTable::Create(options, pool);
  ASSERT_TRUE(created.ok()) << created.status();
  SessionTable& table = **created;
  const core::kv_cache::KvPoolCounters baseline = table.Counters().pool;

  constexpr int64_t kTokens = 96;  // every session reserves this many
  struct Source {
    SessionShape shape;
    std::vector<float> raw_k, raw_v, k, v;  // [kTokens][Hkv][d], as sent and as stored
  };
  std::vector<Source> sources;
  std::mt19937_64 source_rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const SessionShape& shape : {SessionShape{2, 4, 2, 16, 8, DType::kFloat32, 0},
                                    SessionShape{1, 4, 1, 16, 0, DType::kBFloat16, 0}}) {
    Source source;
    source.shape = shape;
    source.raw_k.resize(kTokens * shape.num_kv_heads * shape.head_dim);
    source.raw_v.resize(kTokens * shape.num_kv_heads * ValueDim(shape));
    for (float& x : source.raw_k) x = normal(source_rng);
    for (float& x : source.raw_v) x = normal(source_rng);
    for (const float x : source.raw_k) source.k.push_back(AsStored(x, shape.kv_dtype));
    for (const float x : source.raw_v) source.v.push_back(AsStored(x, shape.kv_dtype));
    sources.push_back(std::move(source));
  }

  std::mutex mu;  // std::, not absl::: TSAN cannot see into Debian's prebuilt Abseil
  std::vector<std::pair<std::string, size_t>> ids;  // session, source; under mu
  std::map<std::string, int64_t> outcomes;          // under mu
  // The fake clock moves 10 ms with every call any thread makes, so a session no thread
  // touched in its last 400 calls (its TTL of 4 s) expires.
  std::atomic<int64_t> calls{0};
  const auto now = [&calls] { return kT0 + absl::Milliseconds(10 * calls.fetch_add(1)); };
  const auto pick = [&](std::mt19937_64& rng) -> std::pair<std::string, size_t> {
    std::lock_guard<std::mutex> lock(mu);
    if (ids.empty()) return {"none", 0};
    return ids[std::uniform_int_distribution<size_t>(0, ids.size() - 1)(rng)];
  };
  const auto forget = [&](const std::string& id) {
    std::lock_guard<std::mutex> lock(mu);
    ids.erase(std::remove_if(ids.begin(), ids.end(), [&](const auto& e) { return e.first == id; }),
              ids.end());
  };
  // Expects one of `allowed` and counts the outcome.
  const auto expect = [&](absl::string_view op, const absl::Status& status,
                          std::initializer_list<Code> allowed) {
    EXPECT_TRUE(std::find(allowed.begin(), allowed.end(), status.code()) != allowed.end())
        << op << ": " << status;
    std::lock_guard<std::mutex> lock(mu);
    ++outcomes[absl::StrCat(op, " ", absl::StatusCodeToString(status.code()))];
  };

  const auto creator = [&](std::mt19937_64& rng, Rounds& rounds) {
    for (int64_t i = 0; i < iterations; ++i) {
      rounds.Wait();
      const auto [id, source] = pick(rng);
      size_t live = 0;
      {
        std::lock_guard<std::mutex> lock(mu);
        live = ids.size();
      }
      if (live >= 10) continue;
      // Half the sessions live 4 s, the others 150 ms (15 calls of any thread): they expire.
      const absl::Duration ttl = rng() % 2 == 0 ? absl::ZeroDuration() : absl::Milliseconds(150);
      const bool create = live < 6 || rng() % 4 == 0;
      absl::StatusOr<SessionInfo> info;
      size_t shape = source;
      if (create || id == "none") {
        shape = rng() % sources.size();
        info = table.CreateSession(sources[shape].shape, kTokens, ttl, now());
        expect("create", info.status(), {Code::kOk, Code::kResourceExhausted});
      } else {
        // At most what Get just saw (OUT_OF_RANGE if a truncation came between).
        const absl::StatusOr<SessionInfo> seen = table.Get(id, now());
        const int64_t length = seen.ok() ? seen->length : 0;
        info = table.Fork(id, static_cast<int64_t>(rng() % (length + 1)), kTokens, ttl, now());
        expect("fork", info.status(),
               {Code::kOk, Code::kNotFound, Code::kOutOfRange, Code::kResourceExhausted});
        if (info.status().code() == Code::kNotFound) forget(id);
      }
      if (info.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        ids.emplace_back(info->id, shape);
      }
    }
  };
  const auto stepper = [&](std::mt19937_64& rng, Rounds& rounds) {
    FidelityStats output_stats("race step output"), lse_stats("race step log-sum-exp");
    for (int64_t i = 0; i < iterations; ++i) {
      rounds.Wait();
      const auto [id, index] = pick(rng);
      const Source& source = sources[index];
      const SessionShape& shape = source.shape;
      const absl::StatusOr<SessionInfo> info = table.Get(id, now());
      if (!info.ok()) {
        expect("get", info.status(), {Code::kNotFound});
        forget(id);
        continue;
      }
      int64_t position = std::max<int64_t>(0, info->length - static_cast<int64_t>(rng() % 4));
      int64_t n = 1 + static_cast<int64_t>(rng() % 8);
      if (position >= kTokens) position = static_cast<int64_t>(rng() % kTokens);
      n = std::min(n, kTokens - position);
      StepEntry entry;
      entry.session_id = id;
      entry.layer = static_cast<int64_t>(rng() % shape.num_layers);
      entry.position = position;
      entry.num_tokens = n;
      std::vector<float> q(n * shape.num_heads * shape.head_dim);
      for (float& x : q) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
      std::vector<float> output(n * shape.num_heads * ValueDim(shape), -7.5f);
      std::vector<float> lse(n * shape.num_heads, -7.5f);
      entry.query = q.data();
      entry.key = source.raw_k.data() + position * shape.num_kv_heads * shape.head_dim;
      entry.value = source.raw_v.data() + position * shape.num_kv_heads * ValueDim(shape);
      entry.output = output.data();
      entry.log_sum_exp = lse.data();
      const absl::Status status = table.Step({&entry, 1}, now())[0];
      // A gap when another thread truncated after the Get; never a conflict.
      expect("step", status, {Code::kOk, Code::kNotFound, Code::kOutOfRange});
      if (status.code() == Code::kNotFound) forget(id);
      if (status.ok()) {
        EXPECT_TRUE(MatchesDense(shape, q.data(), position, n, source.k.data(), source.v.data(),
                                 output, lse, output_stats, lse_stats))
            << "session " << id << " position " << position << " n " << n;
      }
    }
  };
  const auto truncater = [&](std::mt19937_64& rng, Rounds& rounds) {
    for (int64_t i = 0; i < iterations; ++i) {
      rounds.Wait();
      const auto [id, source] = pick(rng);
      // Mostly a rollback of a few tokens from what Get just saw.
      const absl::StatusOr<SessionInfo> seen = table.Get(id, now());
      const int64_t length = seen.ok() ? seen->length : 0;
      const int64_t tokens = rng() % 4 == 0 ? static_cast<int64_t>(rng() % kTokens)
                                            : std::max<int64_t>(0, length - rng() % 8);
      const absl::StatusOr<SessionInfo> info = table.Truncate(id, tokens, now());
      // ABORTED: another thread's step of the session is in flight (SESSION_BUSY).
      expect("truncate", info.status(),
             {Code::kOk, Code::kNotFound, Code::kOutOfRange, Code::kResourceExhausted,
              Code::kAborted});
      if (info.status().code() == Code::kNotFound) forget(id);
    }
  };
  const auto dropper = [&](std::mt19937_64& rng, Rounds& rounds) {
    for (int64_t i = 0; i < iterations; ++i) {
      rounds.Wait();
      const auto [id, source] = pick(rng);
      if (rng() % 6 != 0) continue;  // drops are rarer than the rest
      const absl::Status status = table.Drop(id, now());
      expect("drop", status, {Code::kOk, Code::kNotFound});
      forget(id);
    }
  };
  const auto expirer = [&](std::mt19937_64& rng, Rounds& rounds) {
    for (int64_t i = 0; i < iterations; ++i) {
      rounds.Wait();
      const int64_t expired = table.ExpireIdle(now());
      EXPECT_GE(expired, 0);
      {
        std::lock_guard<std::mutex> lock(mu);
        outcomes["expired sessions"] += expired;
      }
      if (rng() % 8 == 0) {
        for (const SessionInfo& info : table.List(now())) {
          EXPECT_LE(info.length, info.reserved_tokens);
          EXPECT_EQ(info.reserved_tokens, kTokens);
        }
      }
    }
  };

  // Sessions with a few tokens in every layer, so that every thread has work from the start.
  for (int s = 0; s < 6; ++s) {
    const Source& source = sources[s % sources.size()];
    const SessionShape& shape = source.shape;
    const absl::StatusOr<SessionInfo> info = table.CreateSession(shape, kTokens, {}, now());
    ASSERT_TRUE(info.ok()) << info.status();
    const int64_t n = 16;
    for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
      const std::vector<float> q(n * shape.num_heads * shape.head_dim, 0.5f);
      std::vector<float> output(n * shape.num_heads * ValueDim(shape));
      const StepEntry entry{
          info->id, layer, 0, n, q.data(), source.raw_k.data(), source.raw_v.data(), output.data()};
      ASSERT_TRUE(table.Step({&entry, 1}, now())[0].ok());
    }
    std::lock_guard<std::mutex> lock(mu);
    ids.emplace_back(info->id, s % sources.size());
  }

  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::function<void(std::mt19937_64&, Rounds&)>> roles = {
      creator, stepper, stepper, truncater, dropper, expirer};
  Rounds rounds(static_cast<int>(roles.size()));
  std::vector<std::thread> threads;
  for (size_t t = 0; t < roles.size(); ++t) {
    threads.emplace_back([&, t] {
      // gtest's traces are per thread.
      SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED), thread " +
                   std::to_string(t));
      std::mt19937_64 rng(seed + 1 + t);
      roles[t](rng, rounds);
    });
  }
  for (std::thread& thread : threads) thread.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Everything dropped: the pool is back at its baseline.
  // One instant: a session List shows is not idle past its TTL then (each now() is later).
  const absl::Time end = now();
  for (const SessionInfo& info : table.List(end)) {
    const absl::Status status = table.Drop(info.id, end);
    EXPECT_TRUE(status.ok()) << status;
  }
  const SessionCounters after = table.Counters();
  EXPECT_EQ(after.sessions, 0);
  EXPECT_EQ(after.pool.sequences, 0);
  EXPECT_EQ(after.pool.blocks_free, baseline.blocks_free);
  EXPECT_EQ(after.pool.blocks_available, baseline.blocks_available);
  EXPECT_EQ(after.pool.blocks_reserved, 0);
  EXPECT_EQ(after.pool.blocks_shared, 0);
  std::lock_guard<std::mutex> lock(mu);
  std::string summary;
  for (const auto& [name, count] : outcomes) absl::StrAppend(&summary, "\n  ", name, ": ", count);
  std::printf("seed %llu, %lld iterations x %zu threads in %.2f s:%s\n",
              static_cast<unsigned long long>(seed), static_cast<long long>(iterations),
              roles.size(), seconds, summary.c_str());
  EXPECT_GT(outcomes["step OK"], 0);
}

// ---------------------------------------------------------------------------------------
// Memory: `forks` forks of a `prefix`-token session, each with `suffix` tokens of its own,
// hold the prefix once. Measured through the pool's counters: blocks held x tokens per block.

struct MemoryCase {
  std::string name;
  SessionShape shape;
  int64_t block_bytes, prefix, suffix, forks;
};

struct MemoryNumbers {
  int64_t tokens_per_block = 0, blocks_held = 0, expected_blocks = 0, tokens_held = 0;
  int64_t tokens_written = 0, bytes_held = 0, bytes_written = 0, kv_bytes_listed = 0;
  double ratio = 0, seconds = 0;
};

MemoryNumbers RunMemoryCase(const MemoryCase& c, uint64_t seed) {
  const SessionShape& shape = c.shape;
  MemoryNumbers numbers;
  const auto start = std::chrono::steady_clock::now();
  const int64_t tpb = TokensPerBlockOf(shape, c.block_bytes);
  const int64_t layers = shape.num_layers, dk = shape.head_dim, dv = ValueDim(shape);
  const int64_t heads = shape.num_heads, kv_heads = shape.num_kv_heads;
  // A fork copies the prefix's partial tail block (if any) and grows from there.
  const int64_t fork_blocks = CeilDiv(c.prefix + c.suffix, tpb) - c.prefix / tpb;
  numbers.tokens_per_block = tpb;
  numbers.expected_blocks = layers * (CeilDiv(c.prefix, tpb) + c.forks * fork_blocks);
  core::ThreadPool pool(2);
  SessionTableOptions options;
  options.block_bytes = c.block_bytes;
  options.kv_cache_bytes = (numbers.expected_blocks + layers * (c.forks + 2)) * c.block_bytes;
  options.max_sessions = c.forks + 1;
  options.default_ttl = absl::Seconds(60);
  options.poison_freed_blocks = true;
  auto created = SessionTable::Create(options, pool);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return numbers;
  SessionTable& table = **created;
  const core::kv_cache::KvPoolCounters baseline = table.Counters().pool;

  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  const auto random = [&](int64_t count) {
    std::vector<float> values(count);
    for (float& x : values) x = uniform(rng);
    return values;
  };
  // The prefix, as sent, layer 0's also as stored (for the check below).
  const absl::StatusOr<SessionInfo> source = table.CreateSession(shape, c.prefix, {}, kT0);
  EXPECT_TRUE(source.ok()) << source.status();
  if (!source.ok()) return numbers;
  std::vector<float> prefix_k, prefix_v;
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int64_t position = 0; position < c.prefix; position += 1024) {
      const int64_t n = std::min<int64_t>(1024, c.prefix - position);
      const std::vector<float> q = random(n * heads * dk), k = random(n * kv_heads * dk),
                               v = random(n * kv_heads * dv);
      std::vector<float> output(n * heads * dv);
      const StepEntry entry{source->id, layer,    position, n,
                            q.data(),   k.data(), v.data(), output.data()};
      const absl::Status status = table.Step({&entry, 1}, kT0)[0];
      EXPECT_TRUE(status.ok()) << status;
      if (layer == 0) {
        for (const float x : k) prefix_k.push_back(AsStored(x, shape.kv_dtype));
        for (const float x : v) prefix_v.push_back(AsStored(x, shape.kv_dtype));
      }
    }
  }
  // The forks, and one step writing every fork's suffix in every layer.
  std::vector<SessionInfo> forks;
  for (int64_t f = 0; f < c.forks; ++f) {
    const absl::StatusOr<SessionInfo> fork =
        table.Fork(source->id, c.prefix, c.prefix + c.suffix, {}, kT0);
    EXPECT_TRUE(fork.ok()) << fork.status();
    if (!fork.ok()) return numbers;
    forks.push_back(*fork);
  }
  std::vector<std::vector<float>> qs, ks, vs, outputs;
  std::vector<StepEntry> entries;
  for (int64_t f = 0; f < c.forks; ++f) {
    for (int64_t layer = 0; layer < layers; ++layer) {
      qs.push_back(random(c.suffix * heads * dk));
      ks.push_back(random(c.suffix * kv_heads * dk));
      vs.push_back(random(c.suffix * kv_heads * dv));
      outputs.emplace_back(c.suffix * heads * dv);
    }
  }
  for (size_t i = 0; i < qs.size(); ++i) {
    entries.push_back({forks[i / layers].id, static_cast<int64_t>(i % layers), c.prefix, c.suffix,
                       qs[i].data(), ks[i].data(), vs[i].data(), outputs[i].data()});
  }
  for (const absl::Status& status : table.Step(entries, kT0)) EXPECT_TRUE(status.ok()) << status;

  const core::kv_cache::KvPoolCounters held = table.Counters().pool;
  numbers.blocks_held = held.blocks_total - held.blocks_free;
  numbers.tokens_held = numbers.blocks_held * tpb / layers;
  numbers.tokens_written = c.prefix + c.forks * c.suffix;
  numbers.ratio = static_cast<double>(numbers.tokens_held) / numbers.tokens_written;
  numbers.bytes_held = numbers.blocks_held * c.block_bytes;
  numbers.bytes_written =
      numbers.tokens_written * layers * kv_heads * (dk + dv) * core::ElementSize(shape.kv_dtype);
  for (const SessionInfo& info : table.List(kT0)) numbers.kv_bytes_listed += info.kv_bytes;
  EXPECT_EQ(numbers.blocks_held, numbers.expected_blocks);
  // Each fork sees the shared prefix and only its own suffix: its last token of layer 0
  // against the dense reference.
  FidelityStats output_stats("memory fork output"), lse_stats("memory fork log-sum-exp");
  for (int64_t f = 0; f < c.forks; ++f) {
    const size_t i = f * layers;
    std::vector<float> k = prefix_k, v = prefix_v;
    for (const float x : ks[i]) k.push_back(AsStored(x, shape.kv_dtype));
    for (const float x : vs[i]) v.push_back(AsStored(x, shape.kv_dtype));
    const int64_t last = 1, row = heads * dv;
    EXPECT_TRUE(MatchesDense(shape, qs[i].data() + (c.suffix - last) * heads * dk,
                             c.prefix + c.suffix - last, last, k.data(), v.data(),
                             absl::MakeConstSpan(outputs[i]).subspan((c.suffix - last) * row), {},
                             output_stats, lse_stats))
        << "fork " << f;
  }

  // Half the forks dropped, the rest and the source expired: back to the baseline.
  for (int64_t f = 0; f < c.forks / 2; ++f) EXPECT_TRUE(table.Drop(forks[f].id, kT0).ok());
  EXPECT_EQ(table.ExpireIdle(kT0 + absl::Seconds(60)), 0);
  EXPECT_EQ(table.ExpireIdle(kT0 + absl::Seconds(61)), c.forks - c.forks / 2 + 1);
  const SessionCounters after = table.Counters();
  EXPECT_EQ(after.sessions, 0);
  EXPECT_EQ(after.pool.blocks_free, baseline.blocks_free);
  EXPECT_EQ(after.pool.blocks_available, baseline.blocks_available);
  EXPECT_EQ(after.pool.blocks_reserved, 0);
  EXPECT_EQ(after.pool.blocks_shared, 0);
  EXPECT_EQ(after.pool.sequences, 0);
  numbers.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "%s (%s, %lld-byte blocks, %lld tokens a block): %lld forks of %lld tokens + %lld each: "
      "%lld blocks held = %lld tokens for %lld written (%.3fx); %.2f MiB held for %.2f MiB "
      "written; sum of the sessions' kv_bytes %.2f MiB; %.2f s\n",
      c.name.c_str(), Describe(shape).c_str(), static_cast<long long>(c.block_bytes),
      static_cast<long long>(tpb), static_cast<long long>(c.forks),
      static_cast<long long>(c.prefix), static_cast<long long>(c.suffix),
      static_cast<long long>(numbers.blocks_held), static_cast<long long>(numbers.tokens_held),
      static_cast<long long>(numbers.tokens_written), numbers.ratio, numbers.bytes_held / 1048576.0,
      numbers.bytes_written / 1048576.0, numbers.kv_bytes_listed / 1048576.0, numbers.seconds);
  return numbers;
}

// The headline: a Llama-like KV layout (8 KV heads of 128, float32, one layer) in the
// default 256 KiB blocks (32 tokens). Eight query heads (MHA) keep the attention cheap; the
// memory depends on the KV layout only. Sanitizer builds run it at 1/8 of the tokens in
// 32 KiB blocks (4 tokens): the same blocks, 1/64 of the attention.
TEST(SessionTableMemoryTest, SixteenForksOfA4096TokenPrefixHoldAtMostATenthMore) {
  const uint64_t seed = TestSeed(20260327);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  const int64_t scale = kSanitized ? 8 : 1;
  const MemoryCase headline{kSanitized ? "headline, scaled down for a sanitizer" : "headline",
                            {1, 8, 8, 128, 0, DType::kFloat32, 0},
                            core::kv_cache::kDefaultBlockBytes / scale,
                            4096 / scale,
                            256 / scale,
                            16};
  const MemoryNumbers numbers = RunMemoryCase(headline, seed);
  EXPECT_LE(numbers.tokens_held, 1.1 * numbers.tokens_written);
  EXPECT_LE(numbers.bytes_held, 1.1 * numbers.bytes_written);
}

// Other layouts and prefixes: the blocks held must be exactly the prefix's blocks plus each
// fork's copied tail and suffix blocks; the ratio is printed (a layout whose block holds
// more tokens than a suffix pays for the whole block). The Llama-like ones take seconds
// each: they run with ATTENTION_SESSION_MEMORY_ALL=1.
TEST(SessionTableMemoryTest, BlockGranularityAcrossLayouts) {
  if (kSanitized) GTEST_SKIP() << "seconds of attention; the headline covers the code";
  const uint64_t seed = TestSeed(20260328);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  const bool all = EnvInt("ATTENTION_SESSION_MEMORY_ALL", 0) != 0;
  const int64_t kDefault = core::kv_cache::kDefaultBlockBytes;
  struct Case {
    MemoryCase c;
    bool slow;
  };
  const Case cases[] = {
      {{"llama bf16", {1, 8, 8, 128, 0, DType::kBFloat16, 0}, kDefault, 4096, 256, 16}, true},
      {{"llama prefix 4100", {1, 8, 8, 128, 0, DType::kFloat32, 0}, kDefault, 4100, 256, 16}, true},
      {{"small gqa bf16", {1, 2, 2, 64, 0, DType::kBFloat16, 0}, kDefault, 4096, 256, 16}, false},
      {{"small gqa bf16 64k", {1, 2, 2, 64, 0, DType::kBFloat16, 0}, 64 << 10, 4096, 256, 16},
       false},
      {{"mqa f32 2 layers", {2, 2, 1, 64, 0, DType::kFloat32, 0}, kDefault, 4096, 256, 16}, false},
  };
  for (const Case& c : cases) {
    if (c.slow && !all) continue;
    SCOPED_TRACE(c.c.name);
    RunMemoryCase(c.c, seed);
  }
}

}  // namespace
}  // namespace attention::server

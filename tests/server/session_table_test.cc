// KV-cache sessions (issue 25): incremental decode through the session table against the
// one-shot causal attention of the same tokens (FlashAttention's rule, float64 oracle and
// float32 textbook from core), idempotent retries, conflicts and gaps, fork and truncate,
// expiry on a fake clock, admission control and the pool back at its baseline.
#include "server/sessions/session_table.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "core/cpu/host_kv_storage.h"

#include "core/mha_layer.h"
#include "gtest/gtest.h"
#include "server/common/status_util.h"
#include "tests/core/fidelity.h"
#include "tests/core/test_backends.h"
#include "tests/server/session_tokens.h"

namespace attention::server {
namespace {

using core::testing::FidelityStats;
using testing::Entry;
using testing::Options;
using testing::RandomTokens;
using testing::Tokens;

const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);

// [L][heads][d] -> [heads][L][d], as SdpaInput wants.
std::vector<float> HeadMajor(const std::vector<float>& rows, int64_t length, int64_t heads,
                             int64_t dim) {
  std::vector<float> out(rows.size());
  for (int64_t t = 0; t < length; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t d = 0; d < dim; ++d) {
        out[(h * length + t) * dim + d] = rows[(t * heads + h) * dim + d];
      }
    }
  }
  return out;
}

// The one-shot causal attention of all `length` tokens, as [L][H][dv] in T (float: the
// textbook reference; double: the oracle). bfloat16 sessions attend bf16-rounded K/V.
template <typename T>
std::vector<T> OneShot(const SessionShape& shape, const Tokens& tokens, int64_t length) {
  const int64_t dv = shape.v_head_dim > 0 ? shape.v_head_dim : shape.head_dim;
  auto stored = [&shape](std::vector<float> values) {
    if (shape.kv_dtype == core::DType::kBFloat16) {
      for (float& x : values) x = core::BFloat16ToFloat(core::FloatToBFloat16(x));
    }
    return values;
  };
  const std::vector<float> q = HeadMajor(tokens.q, length, shape.num_heads, shape.head_dim);
  const std::vector<float> k =
      stored(HeadMajor(tokens.k, length, shape.num_kv_heads, shape.head_dim));
  const std::vector<float> v = stored(HeadMajor(tokens.v, length, shape.num_kv_heads, dv));
  core::SdpaInput input;
  input.dims = {1, shape.num_heads, shape.num_kv_heads, length, length, shape.head_dim, dv};
  input.query = q;
  input.key = k;
  input.value = v;
  input.options.causal = true;
  if (shape.scale > 0) input.options.scale = shape.scale;
  input.options.sliding_window = shape.sliding_window;
  const std::vector<T> head_major = core::SdpaTextbook<T>(input).output;
  std::vector<T> rows(head_major.size());
  for (int64_t h = 0; h < shape.num_heads; ++h) {
    for (int64_t t = 0; t < length; ++t) {
      for (int64_t d = 0; d < dv; ++d) {
        rows[(t * shape.num_heads + h) * dv + d] = head_major[(h * length + t) * dv + d];
      }
    }
  }
  return rows;
}

class SessionTableTest : public ::testing::Test {
 protected:
  SessionTableTest() : pool_(2) {}

  std::unique_ptr<SessionTable> Table(SessionTableOptions options = Options()) {
    options.poison_freed_blocks = true;  // a read outside a block table shows as NaN
    auto table = SessionTable::Create(options, pool_);
    EXPECT_TRUE(table.ok()) << table.status();
    return *std::move(table);
  }

  // Steps `tokens` [0, length) of layer `layer` into `session` in chunks of `chunk`
  // tokens, answering into rows of `outputs` ([L][H][dv]).
  void StepAll(SessionTable& table, const SessionInfo& session, const Tokens& tokens, int64_t layer,
               int64_t from, int64_t length, int64_t chunk, std::vector<float>* outputs) {
    const int64_t dv =
        session.shape.v_head_dim > 0 ? session.shape.v_head_dim : session.shape.head_dim;
    const int64_t row = session.shape.num_heads * dv;
    outputs->resize(length * row);
    for (int64_t position = from; position < length; position += chunk) {
      const int64_t n = std::min(chunk, length - position);
      std::vector<float> output;
      const StepEntry entry = Entry(session, tokens, layer, position, n, &output);
      const std::vector<absl::Status> statuses = table.Step({&entry, 1}, kT0);
      ASSERT_TRUE(statuses[0].ok()) << statuses[0];
      std::copy(output.begin(), output.end(), outputs->begin() + position * row);
    }
  }

  core::ThreadPool pool_;
};

TEST_F(SessionTableTest, IncrementalDecodeHoldsTheRuleAgainstTheOneShotForward) {
  FidelityStats stats("session decode output");
  const uint64_t seed = 20261125;
  std::mt19937_64 rng(seed);
  const SessionShape shapes[] = {
      {1, 4, 4, 16, 0, core::DType::kFloat32, 0},       // multi-head
      {2, 8, 2, 32, 0, core::DType::kFloat32, 0},       // GQA, two layers
      {1, 6, 1, 24, 40, core::DType::kFloat32, 0.3f},   // MQA, dk != dv, a given scale
      {1, 8, 2, 64, 0, core::DType::kBFloat16, 0},      // bf16 KV
      {1, 4, 2, 16, 0, core::DType::kFloat32, 0, 100},  // a sliding window of 100 keys
  };
  for (const SessionShape& shape : shapes) {
    for (const int64_t length : {1, 37, 300, 1500}) {
      // The window is exercised past its width by 300 tokens; the kernel test covers more.
      if (shape.sliding_window > 0 && length > 300) continue;
      // One sequence and its references (quadratic in the length) for every chunking.
      const Tokens tokens = RandomTokens(shape, length, rng());
      const std::vector<float> reference = OneShot<float>(shape, tokens, length);
      const std::vector<double> oracle = OneShot<double>(shape, tokens, length);
      for (const int64_t chunk : {1, 7, 64}) {
        SCOPED_TRACE(::testing::Message()
                     << "seed " << seed << " H=" << shape.num_heads << " Hkv=" << shape.num_kv_heads
                     << " dk=" << shape.head_dim << " L=" << length << " chunk=" << chunk
                     << " dtype=" << core::DTypeName(shape.kv_dtype)
                     << " window=" << shape.sliding_window);
        auto table = Table();
        const absl::StatusOr<SessionInfo> session = table->CreateSession(shape, length, {}, kT0);
        ASSERT_TRUE(session.ok()) << session.status();
        for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
          std::vector<float> outputs;
          StepAll(*table, *session, tokens, layer, 0, length, chunk, &outputs);
          EXPECT_TRUE(stats.Check(outputs, reference, oracle));
        }
        EXPECT_EQ(table->Get(session->id, kT0)->length, length);
      }
    }
  }
}

TEST_F(SessionTableTest, ARetryAnswersTheSameBitsAndWritesNothing) {
  const SessionShape shape{1, 4, 2, 16, 0, core::DType::kFloat32, 0};
  auto table = Table();
  const SessionInfo session = *table->CreateSession(shape, 64, {}, kT0);
  const Tokens tokens = RandomTokens(shape, 20, 5);
  std::vector<float> first;
  StepAll(*table, session, tokens, 0, 0, 20, 5, &first);
  // The last step again, and an older one: the same output, the same length.
  for (const int64_t position : {15, 5}) {
    std::vector<float> again;
    const StepEntry entry = Entry(session, tokens, 0, position, 5, &again);
    ASSERT_TRUE(table->Step({&entry, 1}, kT0)[0].ok());
    const int64_t row = 4 * 16;
    EXPECT_EQ(again, std::vector<float>(first.begin() + position * row,
                                        first.begin() + (position + 5) * row));
    EXPECT_EQ(table->Get(session.id, kT0)->length, 20);
  }
}

// `status` is `code` with a message containing `part`.
::testing::AssertionResult Refused(const absl::Status& status, absl::StatusCode code,
                                   absl::string_view part) {
  if (status.code() == code && absl::StrContains(status.message(), part)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << status << "; want " << absl::StatusCodeToString(code) << " with \"" << part << "\"";
}

TEST_F(SessionTableTest, ConflictsGapsAndOverrunsAreRefusedNamingThePositions) {
  const SessionShape shape{2, 2, 1, 8, 0, core::DType::kFloat32, 0};
  auto table = Table();
  const SessionInfo session = *table->CreateSession(shape, 10, {}, kT0);
  const Tokens tokens = RandomTokens(shape, 12, 6);
  std::vector<float> outputs;
  StepAll(*table, session, tokens, 0, 0, 4, 4, &outputs);
  std::vector<float> output;
  // Other K/V at a written position.
  Tokens other = tokens;
  other.k[3 * 8] += 1.0f;
  StepEntry conflict = Entry(session, other, 0, 2, 2, &output);
  EXPECT_TRUE(Refused(table->Step({&conflict, 1}, kT0)[0], absl::StatusCode::kFailedPrecondition,
                      "position 3 of layer 0 already holds other keys"));
  // A gap: layer 1 holds nothing yet.
  StepEntry gap = Entry(session, tokens, 1, 2, 1, &output);
  EXPECT_TRUE(Refused(table->Step({&gap, 1}, kT0)[0], absl::StatusCode::kOutOfRange,
                      "position = 2 leaves a gap: layer 1 of the session holds 0"));
  // Past the reservation of 10.
  StepEntry overrun = Entry(session, tokens, 0, 4, 7, &output);
  EXPECT_TRUE(Refused(table->Step({&overrun, 1}, kT0)[0], absl::StatusCode::kOutOfRange,
                      "11 is past the session's reservation of 10"));
  // A layer the session does not have.
  StepEntry layer = Entry(session, tokens, 2, 0, 1, &output);
  EXPECT_EQ(table->Step({&layer, 1}, kT0)[0].code(), absl::StatusCode::kInvalidArgument);
  // After truncating to 3, position 3 takes the other K/V.
  ASSERT_TRUE(table->Truncate(session.id, 3, kT0).ok());
  StepEntry rewrite = Entry(session, other, 0, 3, 1, &output);
  EXPECT_TRUE(table->Step({&rewrite, 1}, kT0)[0].ok());
  EXPECT_EQ(table->Get(session.id, kT0)->length, 0);  // layer 1 is still empty
}

TEST_F(SessionTableTest, AForkSharesThePrefixAndEachBranchSeesOnlyItsOwnTokens) {
  const SessionShape shape{1, 4, 2, 16, 0, core::DType::kFloat32, 0};
  auto table = Table(Options(4 << 20, 4096));
  const int64_t prefix = 45, total = 80;  // a prefix ending inside a block: copy on write
  const SessionInfo source = *table->CreateSession(shape, total, {}, kT0);
  const Tokens source_tokens = RandomTokens(shape, total, 7);
  Tokens fork_tokens = RandomTokens(shape, total, 8);
  for (auto [from, to] :
       {std::pair{&source_tokens.q, &fork_tokens.q}, std::pair{&source_tokens.k, &fork_tokens.k},
        std::pair{&source_tokens.v, &fork_tokens.v}}) {
    const int64_t per_token = static_cast<int64_t>(from->size()) / total;
    std::copy(from->begin(), from->begin() + prefix * per_token, to->begin());
  }
  std::vector<float> outputs;
  StepAll(*table, source, source_tokens, 0, 0, prefix, 9, &outputs);
  const absl::StatusOr<SessionInfo> fork = table->Fork(source.id, prefix, total, {}, kT0);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_GT(table->Counters().pool.blocks_shared, 0);
  // Both branches go on; each must equal the one-shot forward of its own tokens.
  std::vector<float> fork_outputs;
  StepAll(*table, *fork, fork_tokens, 0, prefix, total, 6, &fork_outputs);
  StepAll(*table, source, source_tokens, 0, prefix, total, 6, &outputs);
  FidelityStats stats("session fork output");
  const int64_t row = 4 * 16;
  using Branch = std::pair<const Tokens*, const std::vector<float>*>;
  for (const auto& [tokens, got] :
       {Branch{&source_tokens, &outputs}, Branch{&fork_tokens, &fork_outputs}}) {
    const std::vector<float> reference = OneShot<float>(shape, *tokens, total);
    const std::vector<double> oracle = OneShot<double>(shape, *tokens, total);
    EXPECT_TRUE(stats.Check(absl::MakeConstSpan(*got).subspan(prefix * row),
                            absl::MakeConstSpan(reference).subspan(prefix * row),
                            absl::MakeConstSpan(oracle).subspan(prefix * row)));
  }
}

TEST_F(SessionTableTest, OptionsOutOfRangeAreRefusedNamingTheField) {
  struct Case {
    std::function<void(SessionTableOptions&)> change;
    std::string message_part;
  };
  const std::vector<Case> cases = {
      {[](auto& o) { o.block_bytes = 100; }, "block_bytes = 100 must be a positive multiple of 64"},
      {[](auto& o) { o.block_bytes = 0; }, "block_bytes = 0 must be"},
      {[](auto& o) { o.kv_cache_bytes = 1000; }, "kv_cache_bytes = 1000 must hold at least one"},
      {[](auto& o) { o.max_sessions = 0; }, "max_sessions = 0 must be >= 1"},
      {[](auto& o) { o.max_session_tokens = 0; }, "max_session_tokens = 0 must be >= 1"},
      {[](auto& o) { o.default_ttl = absl::ZeroDuration(); }, "default_ttl = 0 must be > 0"},
      {[](auto& o) { o.max_ttl = absl::Seconds(1); }, "<= max_ttl = 1s"},
      {[](auto& o) { o.max_tombstones = -1; }, "max_tombstones must be >= 0"},
      {[](auto& o) { o.prefill_min_queries = 0; }, "prefill_min_queries = 0 must be >= 1"},
  };
  for (const Case& c : cases) {
    SessionTableOptions options = Options();
    c.change(options);
    const absl::Status status = SessionTable::Create(options, pool_).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message_part;
    EXPECT_TRUE(absl::StrContains(status.message(), c.message_part)) << status.message();
  }
  // A small block for small heads: 64 KiB holds 128 tokens of 2 bf16 KV heads of 64 dims.
  SessionTableOptions small = Options(1 << 20, 64 << 10);
  EXPECT_TRUE(SessionTable::Create(small, pool_).ok());
}

TEST_F(SessionTableTest, EachLayerAttendsWithItsOwnWindow) {
  auto table = Table();
  SessionShape mixed{2, 2, 1, 8, 0, core::DType::kFloat32, 0};
  mixed.layer_sliding_windows = {4, 0};
  SessionShape windowed{1, 2, 1, 8, 0, core::DType::kFloat32, 0, /*sliding_window=*/4};
  SessionShape full{1, 2, 1, 8, 0, core::DType::kFloat32, 0};
  const SessionInfo session = *table->CreateSession(mixed, 16, {}, kT0);
  EXPECT_EQ(session.shape.WindowOf(0), 4);
  EXPECT_EQ(session.shape.WindowOf(1), 0);
  const Tokens tokens = RandomTokens(mixed, 12, 7);
  // Each layer answers bitwise as a session of one layer with that window: a prefill chunk
  // and decode steps, the windowed layer past its window.
  std::vector<float> layer0, layer1, alone0, alone1;
  StepAll(*table, session, tokens, 0, 0, 12, 5, &layer0);
  StepAll(*table, session, tokens, 1, 0, 12, 5, &layer1);
  StepAll(*table, *table->CreateSession(windowed, 16, {}, kT0), tokens, 0, 0, 12, 5, &alone0);
  StepAll(*table, *table->CreateSession(full, 16, {}, kT0), tokens, 0, 0, 12, 5, &alone1);
  EXPECT_EQ(layer0, alone0);
  EXPECT_EQ(layer1, alone1);
  EXPECT_NE(layer0, layer1) << "the window made no difference";
  // One window per layer, or one for all.
  SessionShape refused = mixed;
  refused.layer_sliding_windows = {4};
  EXPECT_TRUE(absl::StrContains(table->CreateSession(refused, 8, {}, kT0).status().message(),
                                "layer_sliding_windows has 1 windows for num_layers = 2"));
  refused = mixed;
  refused.sliding_window = 4;
  EXPECT_TRUE(absl::StrContains(table->CreateSession(refused, 8, {}, kT0).status().message(),
                                "go one or the other"));
  refused = mixed;
  refused.layer_sliding_windows = {4, -1};
  EXPECT_TRUE(absl::StrContains(table->CreateSession(refused, 8, {}, kT0).status().message(),
                                "layer_sliding_windows[1] = -1 must be >= 0"));
}

TEST_F(SessionTableTest, AnOwnersLimitsCountItsForksAndFreeWithExpiry) {
  SessionTableOptions options = Options();
  options.default_ttl = absl::Seconds(10);
  options.max_sessions_per_owner = 2;
  options.max_reserved_tokens_per_owner = 20;
  auto table = Table(options);
  const SessionShape shape{1, 2, 2, 8, 0, core::DType::kFloat32, 0};
  const SessionInfo source = *table->CreateSession(shape, 8, {}, kT0, "alice");
  EXPECT_EQ(source.owner, "alice");
  // A fork is its source's owner's, and counts against it.
  const SessionInfo fork = *table->Fork(source.id, 0, 0, {}, kT0);
  EXPECT_EQ(fork.owner, "alice");
  EXPECT_EQ(ReasonOf(table->CreateSession(shape, 1, {}, kT0, "alice").status()),
            "MAX_SESSIONS_PER_IDENTITY");
  // Sessions without an owner are not counted, nor held back.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(table->CreateSession(shape, 8, {}, kT0).ok());
  // Expiry gives an owner's share back: 8 + 8 reserved, then none.
  EXPECT_EQ(table->ExpireIdle(kT0 + absl::Seconds(11)), 5);
  EXPECT_TRUE(table->CreateSession(shape, 20, {}, kT0 + absl::Seconds(11), "alice").ok());
  EXPECT_EQ(ReasonOf(table->CreateSession(shape, 1, {}, kT0 + absl::Seconds(11), "alice").status()),
            "MAX_RESERVED_TOKENS_PER_IDENTITY");
  options.max_sessions_per_owner = -1;
  EXPECT_EQ(options.Validate().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SessionTableTest, ExpiredDroppedAndUnknownAreToldApart) {
  SessionTableOptions options = Options();
  options.default_ttl = absl::Seconds(10);
  options.tombstone_ttl = absl::Minutes(1);
  auto table = Table(options);
  const SessionShape shape{1, 2, 2, 8, 0, core::DType::kFloat32, 0};
  const SessionInfo idle = *table->CreateSession(shape, 8, {}, kT0);
  const SessionInfo used = *table->CreateSession(shape, 8, {}, kT0);
  const SessionInfo dropped = *table->CreateSession(shape, 8, {}, kT0);
  ASSERT_TRUE(table->Drop(dropped.id, kT0).ok());
  // Every use renews the TTL: `used` is touched at 8 s and so lives past 10 s.
  ASSERT_TRUE(table->Get(used.id, kT0 + absl::Seconds(8)).ok());
  EXPECT_EQ(table->ExpireIdle(kT0 + absl::Seconds(11)), 1);
  EXPECT_TRUE(table->Get(used.id, kT0 + absl::Seconds(12)).ok());
  const auto message = [&](const std::string& id, absl::Time now) {
    const absl::Status status = table->Get(id, now).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
    return std::string(status.message());
  };
  EXPECT_NE(message(idle.id, kT0 + absl::Seconds(12)).find("expired"), std::string::npos);
  EXPECT_NE(message(dropped.id, kT0 + absl::Seconds(12)).find("was dropped"), std::string::npos);
  EXPECT_NE(message("nope", kT0).find("is unknown"), std::string::npos);
  // The same three apart by a machine-readable reason.
  const auto reason = [&](const std::string& id, absl::Time now) {
    return ReasonOf(table->Get(id, now).status());
  };
  EXPECT_EQ(reason(idle.id, kT0 + absl::Seconds(12)), "SESSION_EXPIRED");
  EXPECT_EQ(reason(dropped.id, kT0 + absl::Seconds(12)), "SESSION_DROPPED");
  EXPECT_EQ(reason("nope", kT0), "SESSION_UNKNOWN");
  // A session idle past its TTL expires when next looked up, sweep or not.
  EXPECT_NE(message(used.id, kT0 + absl::Seconds(30)).find("expired"), std::string::npos);
  // Tombstones are forgotten after tombstone_ttl.
  EXPECT_NE(message(idle.id, kT0 + absl::Minutes(5)).find("is unknown"), std::string::npos);
  // A TTL past the server's max is refused.
  EXPECT_EQ(table->CreateSession(shape, 8, absl::Hours(48), kT0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // An empty id is malformed; an id naming another replica is told apart from text that
  // is not an id at all, which is never echoed as a replica name.
  EXPECT_EQ(table->Get("", kT0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reason("replica-b/0123456789abcdef0123456789abcdef", kT0), "WRONG_REPLICA");
  EXPECT_EQ(reason("DROP TABLE sessions; --/0123456789abcdef0123456789abcdef", kT0),
            "SESSION_UNKNOWN");
  EXPECT_EQ(reason("replica-b/nope", kT0), "SESSION_UNKNOWN");
}

// While a restarted replica restores its snapshot (its port already open), a session it does
// not hold yet and a new session are UNAVAILABLE (SESSION_RESTORING), which clients retry;
// those it holds answer as ever, and once restored an unknown one is NOT_FOUND again.
TEST_F(SessionTableTest, WhileRestoringUnknownSessionsAreToldToRetry) {
  auto table = Table();
  const SessionShape shape{1, 2, 2, 8, 0, core::DType::kFloat32, 0};
  const SessionInfo held = *table->CreateSession(shape, 8, {}, kT0);
  table->SetRestoring(true);
  const absl::Status unknown = table->Get("nope", kT0).status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kUnavailable) << unknown;
  EXPECT_EQ(ReasonOf(unknown), "SESSION_RESTORING");
  const absl::Status created = table->CreateSession(shape, 8, {}, kT0).status();
  EXPECT_EQ(created.code(), absl::StatusCode::kUnavailable) << created;
  EXPECT_EQ(ReasonOf(created), "SESSION_RESTORING");
  EXPECT_TRUE(table->Get(held.id, kT0).ok());
  table->SetRestoring(false);
  EXPECT_EQ(ReasonOf(table->Get("nope", kT0).status()), "SESSION_UNKNOWN");
  EXPECT_TRUE(table->CreateSession(shape, 8, {}, kT0).ok());
}

// A read that keeps the session idle (GetSessionRequest.keep_idle, issue 38) is not a use:
// a monitor watching a session does not keep it alive.
TEST_F(SessionTableTest, AReadThatKeepsIdleDoesNotRenewTheTtl) {
  SessionTableOptions options = Options();
  options.default_ttl = absl::Seconds(10);
  auto table = Table(options);
  const SessionShape shape{1, 2, 2, 8, 0, core::DType::kFloat32, 0};
  const SessionInfo watched = *table->CreateSession(shape, 8, {}, kT0);
  const SessionInfo used = *table->CreateSession(shape, 8, {}, kT0);
  const absl::StatusOr<SessionInfo> read =
      table->Get(watched.id, kT0 + absl::Seconds(8), /*renew_ttl=*/false);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->last_used, kT0);
  ASSERT_TRUE(table->Get(used.id, kT0 + absl::Seconds(8)).ok());
  // At 11 s the watched one has been idle past its TTL; the used one was renewed at 8 s.
  const absl::Status late = table->Get(watched.id, kT0 + absl::Seconds(11), false).status();
  EXPECT_EQ(ReasonOf(late), "SESSION_EXPIRED") << late;
  const absl::StatusOr<SessionInfo> renewed = table->Get(used.id, kT0 + absl::Seconds(11), false);
  ASSERT_TRUE(renewed.ok()) << renewed.status();
  EXPECT_EQ(renewed->last_used, kT0 + absl::Seconds(8));
}

// A fork that names no reservation or TTL (0) inherits the source's (issue 38), rather than
// being refused or taking the server's default TTL.
TEST_F(SessionTableTest, AForkWithoutReservationOrTtlInheritsTheSources) {
  auto table = Table();
  const SessionShape shape{1, 2, 2, 8, 0, core::DType::kFloat32, 0};
  const SessionInfo source = *table->CreateSession(shape, 40, absl::Seconds(30), kT0);
  const Tokens tokens = RandomTokens(shape, 5, 38);
  std::vector<float> output;
  StepAll(*table, source, tokens, 0, 0, 5, 5, &output);
  const absl::StatusOr<SessionInfo> inherited = table->Fork(source.id, 5, 0, {}, kT0);
  ASSERT_TRUE(inherited.ok()) << inherited.status();
  EXPECT_EQ(inherited->reserved_tokens, 40);
  EXPECT_EQ(inherited->ttl, absl::Seconds(30));
  EXPECT_EQ(inherited->length, 5);
  const absl::StatusOr<SessionInfo> named = table->Fork(source.id, 3, 20, absl::Seconds(3), kT0);
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->reserved_tokens, 20);
  EXPECT_EQ(named->ttl, absl::Seconds(3));
  EXPECT_TRUE(Refused(table->Fork(source.id, 5, -1, {}, kT0).status(),
                      absl::StatusCode::kInvalidArgument,
                      "reserved_tokens = -1 must be >= 0 (0 for the source's reservation)"));
  // The inherited TTL is the source's 30 s, not the default 10 min.
  EXPECT_EQ(ReasonOf(table->Get(inherited->id, kT0 + absl::Seconds(31)).status()),
            "SESSION_EXPIRED");
}

TEST_F(SessionTableTest, ForksTruncationsAndReservationsPastTheLimitsSayWhy) {
  SessionTableOptions options = Options(1 << 20, 64 << 10);
  options.max_session_tokens = 4096;
  auto table = Table(options);
  // 256 tokens a block, 16 blocks.
  const SessionShape shape{1, 2, 2, 16, 0, core::DType::kFloat32, 0};
  const absl::StatusOr<SessionInfo> too_long = table->CreateSession(shape, 4097, {}, kT0);
  EXPECT_TRUE(Refused(too_long.status(), absl::StatusCode::kInvalidArgument,
                      "reserved_tokens = 4097 must be in [1, 4096]"));
  EXPECT_EQ(ReasonOf(too_long.status()), "MAX_SESSION_TOKENS");
  const SessionInfo source = *table->CreateSession(shape, 300, {}, kT0);
  const Tokens tokens = RandomTokens(shape, 300, 5);
  std::vector<float> output;
  StepAll(*table, source, tokens, 0, 0, 300, 300, &output);
  const absl::StatusOr<SessionInfo> fork = table->Fork(source.id, 301, 400, {}, kT0);
  EXPECT_TRUE(Refused(fork.status(), absl::StatusCode::kOutOfRange, "tokens = 301"));
  EXPECT_EQ(ReasonOf(fork.status()), "PAST_LENGTH");
  const absl::StatusOr<SessionInfo> truncated = table->Truncate(source.id, 301, kT0);
  EXPECT_TRUE(Refused(truncated.status(), absl::StatusCode::kOutOfRange, "tokens = 301"));
  EXPECT_EQ(ReasonOf(truncated.status()), "PAST_LENGTH");
  // A fork of all 300 tokens shares the partial second block; the rest of the pool is
  // taken, so rolling the source back into that shared block (whose regrowth needs a copy)
  // cannot be promised.
  ASSERT_TRUE(table->Fork(source.id, 300, 300, {}, kT0).ok());
  const int64_t available = table->Counters().pool.blocks_available;
  if (available > 0) {
    ASSERT_TRUE(table->CreateSession(shape, available * 256, {}, kT0).ok());
  }
  const absl::StatusOr<SessionInfo> rolled_back = table->Truncate(source.id, 200, kT0);
  EXPECT_EQ(rolled_back.status().code(), absl::StatusCode::kResourceExhausted)
      << rolled_back.status();
  EXPECT_EQ(ReasonOf(rolled_back.status()), "KV_POOL_EXHAUSTED");
}

TEST_F(SessionTableTest, ReservationsAreAdmittedOrRefusedAndThePoolReturnsToItsBaseline) {
  SessionTableOptions options = Options(1 << 20, 64 << 10);
  options.max_sessions = 3;
  auto table = Table(options);
  const core::kv_cache::KvPoolCounters baseline = table->Counters().pool;
  // 2 KV heads x (16 + 16) x 4 bytes = 256 bytes a token: 256 tokens a block, 16 blocks.
  const SessionShape shape{1, 2, 2, 16, 0, core::DType::kFloat32, 0};
  const SessionInfo a = *table->CreateSession(shape, 256 * 10, {}, kT0);
  absl::Status status = table->CreateSession(shape, 256 * 7, {}, kT0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  const SessionInfo b = *table->CreateSession(shape, 256 * 5, {}, kT0);
  const SessionInfo c = *table->CreateSession(shape, 1, {}, kT0);  // the last free block
  status = table->CreateSession(shape, 1, {}, kT0).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("max_sessions"), std::string::npos) << status;
  const Tokens tokens = RandomTokens(shape, 300, 9);
  std::vector<float> outputs;
  StepAll(*table, a, tokens, 0, 0, 300, 100, &outputs);
  EXPECT_EQ(table->Get(a.id, kT0)->kv_bytes, 2 * (64 << 10));
  for (const SessionInfo* session : {&a, &b, &c}) {
    ASSERT_TRUE(table->Drop(session->id, kT0).ok());
  }
  const core::kv_cache::KvPoolCounters after = table->Counters().pool;
  EXPECT_EQ(after.blocks_free, baseline.blocks_free);
  EXPECT_EQ(after.blocks_available, baseline.blocks_available);
  EXPECT_EQ(after.sequences, 0);
}

TEST_F(SessionTableTest, AnEntryAnswersTheSameBitsAloneOrInABatch) {
  const SessionShape shape{1, 8, 2, 32, 0, core::DType::kFloat32, 0};
  auto alone_table = Table(), batch_table = Table();
  const Tokens tokens = RandomTokens(shape, 600, 10);
  std::vector<float> alone, prefix;
  const SessionInfo alone_session = *alone_table->CreateSession(shape, 600, {}, kT0);
  StepAll(*alone_table, alone_session, tokens, 0, 0, 600, 50, &alone);
  // The same steps, each batched with two other sessions' steps.
  std::vector<SessionInfo> sessions;
  for (int s = 0; s < 3; ++s) sessions.push_back(*batch_table->CreateSession(shape, 600, {}, kT0));
  const std::vector<Tokens> others = {RandomTokens(shape, 600, 11), RandomTokens(shape, 600, 12)};
  const int64_t row = 8 * 32;
  for (int64_t position = 0; position < 600; position += 50) {
    std::vector<float> outputs[3];
    const StepEntry entries[] = {Entry(sessions[1], others[0], 0, position, 50, &outputs[1]),
                                 Entry(sessions[0], tokens, 0, position, 50, &outputs[0]),
                                 Entry(sessions[2], others[1], 0, position, 50, &outputs[2])};
    for (const absl::Status& status : batch_table->Step(entries, kT0)) ASSERT_TRUE(status.ok());
    EXPECT_EQ(outputs[0], std::vector<float>(alone.begin() + position * row,
                                             alone.begin() + (position + 50) * row))
        << "position " << position;
  }
}

// Two forks of one 1,100-token prefix stepped together read its first 1,024 keys (one whole
// split of the CPU kernel) once, count those bytes once, and answer the bits a replay of
// the same tokens in blocks of its own answers alone.
TEST_F(SessionTableTest, ForksSteppedTogetherReadTheirPrefixOnceAndAnswerTheirOwnBits) {
  const SessionShape shape{1, 8, 2, 32, 0, core::DType::kFloat32, 0};
  auto table = Table();
  constexpr int64_t kPrefix = 1100;
  const SessionInfo source = *table->CreateSession(shape, kPrefix + 1, {}, kT0);
  Tokens tokens[2] = {RandomTokens(shape, kPrefix + 1, 21), RandomTokens(shape, kPrefix + 1, 22)};
  // The second fork's tokens differ from the first's after the shared prefix only.
  const auto share_prefix = [](const std::vector<float>& from, std::vector<float>& to) {
    std::copy(from.begin(), from.begin() + from.size() / (kPrefix + 1) * kPrefix, to.begin());
  };
  share_prefix(tokens[0].q, tokens[1].q);
  share_prefix(tokens[0].k, tokens[1].k);
  share_prefix(tokens[0].v, tokens[1].v);
  std::vector<float> outputs;
  StepAll(*table, source, tokens[0], 0, 0, kPrefix, 275, &outputs);
  const SessionInfo forks[2] = {*table->Fork(source.id, kPrefix, kPrefix + 1, {}, kT0),
                                *table->Fork(source.id, kPrefix, kPrefix + 1, {}, kT0)};
  const SessionCounters before = table->Counters();
  std::vector<float> fork_outputs[2];
  const StepEntry entries[] = {Entry(forks[0], tokens[0], 0, kPrefix, 1, &fork_outputs[0]),
                               Entry(forks[1], tokens[1], 0, kPrefix, 1, &fork_outputs[1])};
  for (const absl::Status& status : table->Step(entries, kT0)) ASSERT_TRUE(status.ok()) << status;
  const SessionCounters after = table->Counters();
  // 64 KiB blocks of 512-byte tokens: 1,024 keys are 8 blocks.
  const int64_t token_bytes = 2 * (32 + 32) * 4;
  EXPECT_EQ(after.shared_blocks_read - before.shared_blocks_read, 8);
  EXPECT_EQ(after.kv_bytes_read - before.kv_bytes_read, (2 * (kPrefix + 1) - 1024) * token_bytes);
  for (int f = 0; f < 2; ++f) {
    const SessionInfo replay = *table->CreateSession(shape, kPrefix + 1, {}, kT0);
    std::vector<float> replayed;
    StepAll(*table, replay, tokens[f], 0, 0, kPrefix + 1, 275, &replayed);
    EXPECT_EQ(fork_outputs[f], std::vector<float>(replayed.end() - 8 * 32, replayed.end()))
        << "fork " << f;
    ASSERT_TRUE(table->Drop(replay.id, kT0).ok());
  }
}

TEST_F(SessionTableTest, EntriesOfOneSessionApplyInPositionOrder) {
  const SessionShape shape{1, 2, 1, 8, 0, core::DType::kFloat32, 0};
  auto table = Table();
  const SessionInfo session = *table->CreateSession(shape, 16, {}, kT0);
  const Tokens tokens = RandomTokens(shape, 6, 13);
  std::vector<float> late, early;
  // Positions 3..5 listed before 0..2: applied in position order, both succeed.
  const StepEntry entries[] = {Entry(session, tokens, 0, 3, 3, &late),
                               Entry(session, tokens, 0, 0, 3, &early)};
  for (const absl::Status& status : table->Step(entries, kT0)) EXPECT_TRUE(status.ok()) << status;
  std::vector<float> one_by_one;
  auto other = Table();
  const SessionInfo again = *other->CreateSession(shape, 16, {}, kT0);
  StepAll(*other, again, tokens, 0, 0, 6, 3, &one_by_one);
  early.insert(early.end(), late.begin(), late.end());
  EXPECT_EQ(early, one_by_one);
}

// Host storage whose attention records each pass's first sequence length and, while
// `hold` is set, waits in its first pass for `release`: a step computing for as long as a
// test likes, without a sleep.
class HeldStorage final : public core::kv_cache::KvStorage {
 public:
  HeldStorage(const SessionTableOptions& options, core::ThreadPool& pool)
      : KvStorage(options.kv_cache_bytes / options.block_bytes, options.block_bytes),
        host_(num_blocks(), block_bytes(), pool, options.prefill_min_queries) {}

  const std::string& device() const override { return host_.device(); }
  absl::Status WriteTokens(core::kv_cache::BlockId block, const core::kv_cache::KvLayout& layout,
                           int64_t tokens_per_block, int64_t slot, int64_t tokens, const void* keys,
                           const void* values) override {
    return host_.WriteTokens(block, layout, tokens_per_block, slot, tokens, keys, values);
  }
  absl::Status ReadTokens(core::kv_cache::BlockId block, const core::kv_cache::KvLayout& layout,
                          int64_t tokens_per_block, int64_t slot, int64_t tokens, void* keys,
                          void* values) const override {
    return host_.ReadTokens(block, layout, tokens_per_block, slot, tokens, keys, values);
  }
  absl::Status ReadBlock(core::kv_cache::BlockId block, void* bytes) const override {
    return host_.ReadBlock(block, bytes);
  }
  absl::Status WriteBlock(core::kv_cache::BlockId block, const void* bytes) override {
    return host_.WriteBlock(block, bytes);
  }
  absl::Status CopyBlock(core::kv_cache::BlockId from, core::kv_cache::BlockId to) override {
    return host_.CopyBlock(from, to);
  }
  absl::Status Poison(core::kv_cache::BlockId block) override { return host_.Poison(block); }
  absl::Status Attend(const core::PagedDecodeBatch& batch) override {
    bool hold = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      passes_.push_back(batch.sequences[0].length);
      bf16_products_.push_back(batch.bf16_products);
      std::swap(hold, hold_);
    }
    if (hold) {
      held.Notify();
      release.WaitForNotification();
    }
    return host_.Attend(batch);
  }

  void HoldNextPass() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = true;
  }
  std::vector<int64_t> Passes() {
    std::lock_guard<std::mutex> lock(mu_);
    return passes_;
  }
  std::vector<bool> Bf16Products() {
    std::lock_guard<std::mutex> lock(mu_);
    return bf16_products_;
  }
  std::map<std::string, int64_t> AttendCallsByPath() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return {{"held", static_cast<int64_t>(passes_.size())}};
  }

  absl::Notification held, release;

 private:
  core::HostKvStorage host_;
  mutable std::mutex mu_;
  bool hold_ = false;
  std::vector<int64_t> passes_;  // the first sequence's length in each pass
  std::vector<bool> bf16_products_;  // each pass's PagedDecodeBatch::bf16_products
};

// Steps of sessions over BFLOAT16 layers reach the storage marked bf16_products (a GPU may
// then run them on cuDNN's paged SDPA), in passes apart from other sessions' steps, which
// stay unmarked; the storage's calls by path reach the table's counters.
TEST_F(SessionTableTest, StepsOfBf16LayersAreMarkedForBf16Products) {
  SessionTableOptions options = Options();
  auto owned = std::make_unique<HeldStorage>(options, pool_);
  HeldStorage& storage = *owned;
  const std::unique_ptr<SessionTable> table = *SessionTable::Create(options, std::move(owned));
  core::MhaConfig config;
  config.embed_dim = 64;
  config.num_heads = 4;
  config.num_kv_heads = 2;
  config.compute_dtype = core::DType::kBFloat16;
  const core::MhaConfig resolved = *core::MhaConfig::Resolve(config);
  auto layer = core::MhaLayer::Create(resolved, core::MhaWeights::Random(resolved, 3),
                                      core::testing::CpuForTests());
  ASSERT_TRUE(layer.ok()) << layer.status();
  SessionShape over_bf16_layer{1, 4, 2, 16, 0, core::DType::kBFloat16, 0};
  over_bf16_layer.layers = std::make_shared<const ServedLayers>(
      ServedLayers{{std::shared_ptr<const core::MhaLayer>(*std::move(layer))}, {"bf16-layer"}});
  const SessionShape raw{1, 4, 2, 16, 0, core::DType::kBFloat16, 0};
  const SessionInfo marked = *table->CreateSession(over_bf16_layer, 8, {}, kT0);
  const SessionInfo unmarked = *table->CreateSession(raw, 8, {}, kT0);
  const Tokens tokens = RandomTokens(raw, 1, 5);
  std::vector<float> marked_output, unmarked_output;
  const StepEntry entries[] = {Entry(marked, tokens, 0, 0, 1, &marked_output),
                               Entry(unmarked, tokens, 0, 0, 1, &unmarked_output)};
  for (const absl::Status& status : table->Step(entries, kT0)) {
    ASSERT_TRUE(status.ok()) << status;
  }
  std::vector<bool> passes = storage.Bf16Products();
  std::sort(passes.begin(), passes.end());
  EXPECT_EQ(passes, (std::vector<bool>{false, true})) << "one pass each";
  EXPECT_EQ(marked_output, unmarked_output) << "the host's kernels compute both alike";
  const SessionCounters counters = table->Counters();
  EXPECT_EQ(counters.kv_device, "cpu");
  EXPECT_EQ(counters.attend_calls_by_path, (std::map<std::string, int64_t>{{"held", 2}}));
}

class SessionTableConcurrencyTest : public SessionTableTest {
 protected:
  void SetUp() override {
    SessionTableOptions options = Options();
    options.prefill_chunk_tokens = 64;
    options.poison_freed_blocks = true;
    auto storage = std::make_unique<HeldStorage>(options, pool_);
    storage_ = storage.get();
    table_ = *SessionTable::Create(options, std::move(storage));
    prefilling_ = *table_->CreateSession(shape_, 256, {}, kT0);
    prefill_tokens_ = RandomTokens(shape_, 256, 21);
  }

  // Starts a 256-token prefill (four chunks) that holds its first chunk until released.
  void StartHeldPrefill() {
    storage_->HoldNextPass();
    prefill_ = std::thread([this] {
      const StepEntry entry = Entry(prefilling_, prefill_tokens_, 0, 0, 256, &prefill_output_);
      prefill_status_ = table_->Step({&entry, 1}, kT0)[0];
    });
    storage_->held.WaitForNotification();
  }

  void FinishPrefill() {
    storage_->release.Notify();
    prefill_.join();
    ASSERT_TRUE(prefill_status_.ok()) << prefill_status_;
  }

  // Runs `call` on another thread: true when it returned within a minute (it must not
  // wait for the held prefill; the minute only turns a hang into a failure).
  static bool ReturnsWhileThePrefillIsHeld(const std::function<void()>& call) {
    auto done = std::make_shared<absl::Notification>();
    std::thread([call, done] {
      call();
      done->Notify();
    }).detach();
    return done->WaitForNotificationWithTimeout(absl::Minutes(1));
  }

  const SessionShape shape_{1, 4, 2, 16, 0, core::DType::kFloat32, 0};
  HeldStorage* storage_ = nullptr;
  std::unique_ptr<SessionTable> table_;
  SessionInfo prefilling_;
  Tokens prefill_tokens_;
  std::vector<float> prefill_output_;
  std::thread prefill_;
  absl::Status prefill_status_;
};

TEST_F(SessionTableConcurrencyTest, OtherCallsDoNotWaitForAStepsAttention) {
  const SessionInfo other = *table_->CreateSession(shape_, 16, {}, kT0);
  StartHeldPrefill();
  EXPECT_TRUE(ReturnsWhileThePrefillIsHeld([&] {
    EXPECT_TRUE(table_->Get(prefilling_.id, kT0).ok());
    EXPECT_TRUE(table_->CreateSession(shape_, 16, {}, kT0).ok());
    EXPECT_TRUE(table_->Fork(prefilling_.id, 0, 16, {}, kT0).ok());
    EXPECT_TRUE(table_->Drop(other.id, kT0).ok());
    EXPECT_EQ(table_->List(kT0).size(), 3u);
    EXPECT_EQ(table_->Counters().sessions, 3);
  }));
  FinishPrefill();
}

TEST_F(SessionTableConcurrencyTest, ADecodeStepRunsBetweenTheChunksOfALongPrefill) {
  const SessionInfo decoding = *table_->CreateSession(shape_, 16, {}, kT0);
  const Tokens tokens = RandomTokens(shape_, 1, 22);
  std::vector<float> output;
  StartHeldPrefill();
  absl::Status decoded;
  std::thread decode([&] {
    const StepEntry entry = Entry(decoding, tokens, 0, 0, 1, &output);
    decoded = table_->Step({&entry, 1}, kT0)[0];
  });
  // Once the decode step waits for its turn, that turn comes before the prefill's second
  // chunk: it runs once the first chunk ends, not after all four.
  while (table_->StepsWaitingForATurn() == 0) std::this_thread::yield();
  FinishPrefill();
  decode.join();
  ASSERT_TRUE(decoded.ok()) << decoded;
  EXPECT_EQ(storage_->Passes(), (std::vector<int64_t>{64, 1, 128, 192, 256}));
  // Chunked, the prefill answers what four steps of 64 tokens answer.
  auto whole = Table();
  const SessionInfo again = *whole->CreateSession(shape_, 256, {}, kT0);
  std::vector<float> stepwise;
  StepAll(*whole, again, prefill_tokens_, 0, 0, 256, 64, &stepwise);
  EXPECT_EQ(prefill_output_, stepwise);
}

TEST_F(SessionTableConcurrencyTest, ASessionInAStepKeepsItsBlocksUntilTheStepEnds) {
  StartHeldPrefill();
  const core::kv_cache::KvPoolCounters during = table_->Counters().pool;
  const absl::StatusOr<SessionInfo> truncated = table_->Truncate(prefilling_.id, 0, kT0);
  EXPECT_EQ(truncated.status().code(), absl::StatusCode::kAborted) << truncated.status();
  EXPECT_EQ(ReasonOf(truncated.status()), "SESSION_BUSY");
  // Dropped, the session is gone at once, but its blocks stay held for the step, which
  // still answers (poisoned blocks would show as NaN).
  EXPECT_TRUE(table_->Drop(prefilling_.id, kT0).ok());
  EXPECT_EQ(table_->Get(prefilling_.id, kT0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table_->Counters().pool.blocks_free, during.blocks_free);
  FinishPrefill();
  for (const float x : prefill_output_) ASSERT_TRUE(std::isfinite(x));
  EXPECT_EQ(table_->Counters().pool.blocks_free, table_->Counters().pool.blocks_total);
}

}  // namespace
}  // namespace attention::server

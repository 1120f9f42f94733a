// Sessions through a restart (issue 41): a table written to a snapshot and restored answers
// its next steps with the same bits, forks still sharing their blocks; a torn or corrupt
// snapshot restores nothing and leaves the table serving; and through a real server, a
// session whose layer changed meanwhile is left out while the others come back.
#include "server/sessions/session_snapshot.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/cpu/thread_pool.h"
#include "core/devices.h"
#include "gtest/gtest.h"
#include "server/sessions/session_table.h"
#include "tests/server/session_tokens.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1'000'000);

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

class SessionSnapshotTest : public ::testing::Test {
 protected:
  SessionSnapshotTest() : pool_(2) {}

  static SessionTableOptions TableOptions(const std::string& replica) {
    SessionTableOptions options = Options(/*kv_cache_bytes=*/8 << 20, /*block_bytes=*/16 << 10);
    options.poison_freed_blocks = true;  // a read outside a block table shows as NaN
    options.replica = replica;
    return options;
  }

  // A table whose KV blocks live in host memory.
  std::unique_ptr<SessionTable> Table(const std::string& replica = "attention-0") {
    auto table = SessionTable::Create(TableOptions(replica), pool_);
    EXPECT_TRUE(table.ok()) << table.status();
    return *std::move(table);
  }

  static void Step(SessionTable& table, const SessionInfo& session, const Tokens& tokens,
                   int64_t from, int64_t to, std::vector<float>* answers) {
    StepOneTokenAtATime(table, session, tokens, from, to, kT0, answers);
  }

  void ExpectTheSameBitsAfterARestore(
      const std::function<std::unique_ptr<SessionTable>()>& make_table);

  core::ThreadPool pool_;
};

SessionShape Bf16WindowShape() {
  SessionShape shape;
  shape.num_heads = 2;
  shape.head_dim = 32;
  shape.v_head_dim = 16;
  shape.kv_dtype = core::DType::kBFloat16;
  shape.sliding_window = 7;
  shape.scale = 0.2f;
  return shape;
}

// Sessions of two shapes, a fork sharing blocks among them, written from one table of
// `make_table` and restored into another: the same sessions, pool and next answers' bits.
void SessionSnapshotTest::ExpectTheSameBitsAfterARestore(
    const std::function<std::unique_ptr<SessionTable>()>& make_table) {
  const uint64_t seed = 4101;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  auto before = make_table();
  const SessionShape gqa = GqaShape(), bf16 = Bf16WindowShape();
  // 2 layers x 64 tokens per 16 KiB block of GQA: a fork of 100 tokens shares 1 whole and 1
  // partial block per layer.
  const SessionInfo source = *before->CreateSession(gqa, 160, absl::Minutes(5), kT0, "alice");
  const SessionInfo windowed = *before->CreateSession(bf16, 64, absl::ZeroDuration(), kT0);
  const Tokens source_tokens = RandomTokens(gqa, 160, seed);
  Tokens fork_tokens = RandomTokens(gqa, 160, seed + 1);
  const Tokens windowed_tokens = RandomTokens(bf16, 64, seed + 2);
  std::vector<float> ignored;
  Step(*before, source, source_tokens, 0, 120, &ignored);
  const SessionInfo fork = *before->Fork(source.id, 100, 0, absl::ZeroDuration(), kT0);
  // The fork's own tokens follow the shared 100.
  for (auto [own, shared] : {std::pair{&fork_tokens.q, &source_tokens.q},
                             {&fork_tokens.k, &source_tokens.k},
                             {&fork_tokens.v, &source_tokens.v}}) {
    std::copy(shared->begin(), shared->begin() + shared->size() * 100 / 160, own->begin());
  }
  Step(*before, fork, fork_tokens, 100, 110, &ignored);
  Step(*before, windowed, windowed_tokens, 0, 30, &ignored);
  const std::string path = FreshDirectory("snapshot") + "/attention-0.kvsnap";
  const absl::StatusOr<SnapshotReport> written =
      before->WriteSnapshot(path, kT0 + absl::Minutes(1));
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->sessions, 3);
  const core::kv_cache::KvPoolCounters pool_before = before->Counters().pool;
  EXPECT_EQ(written->blocks, pool_before.blocks_total - pool_before.blocks_free)
      << "each held block once, the forks' shared ones included";
  EXPECT_GT(pool_before.blocks_shared, 0);

  auto after = make_table();
  const absl::StatusOr<SnapshotReport> restored = after->RestoreSnapshot(
      path, [](const std::string& name) { return absl::NotFoundError(name); },
      kT0 + absl::Hours(1));
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->sessions, 3);
  EXPECT_EQ(restored->refused_sessions, 0);
  EXPECT_EQ(restored->bytes, written->bytes);
  const core::kv_cache::KvPoolCounters pool_after = after->Counters().pool;
  EXPECT_EQ(pool_after.blocks_free, pool_before.blocks_free);
  EXPECT_EQ(pool_after.blocks_shared, pool_before.blocks_shared);
  EXPECT_EQ(pool_after.blocks_available, pool_before.blocks_available);
  EXPECT_EQ(after->Counters().restored, 3);
  for (const std::string& id : {source.id, fork.id, windowed.id}) {
    const SessionInfo was = *before->Get(id, kT0 + absl::Minutes(1), /*renew_ttl=*/false);
    const SessionInfo is = *after->Get(id, kT0 + absl::Hours(1), /*renew_ttl=*/false);
    EXPECT_EQ(is.owner, was.owner) << id;
    EXPECT_EQ(is.layer_lengths, was.layer_lengths) << id;
    EXPECT_EQ(is.reserved_tokens, was.reserved_tokens) << id;
    EXPECT_EQ(is.kv_bytes, was.kv_bytes) << id;
    EXPECT_EQ(is.ttl, was.ttl) << id;
    EXPECT_EQ(is.shape.kv_dtype, was.shape.kv_dtype) << id;
    EXPECT_EQ(is.shape.sliding_window, was.shape.sliding_window) << id;
    EXPECT_EQ(is.shape.scale, was.shape.scale) << id;
    // The time the server was down is not idle time.
    EXPECT_EQ(kT0 + absl::Hours(1) - is.last_used, kT0 + absl::Minutes(1) - was.last_used) << id;
  }
  // The next steps, on both tables: the same bits.
  std::vector<float> expected, got;
  Step(*before, source, source_tokens, 120, 160, &expected);
  Step(*before, fork, fork_tokens, 110, 130, &expected);
  Step(*before, windowed, windowed_tokens, 30, 64, &expected);
  Step(*after, source, source_tokens, 120, 160, &got);
  Step(*after, fork, fork_tokens, 110, 130, &got);
  Step(*after, windowed, windowed_tokens, 30, 64, &got);
  ASSERT_EQ(got.size(), expected.size());
  EXPECT_EQ(0, std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)));
}

TEST_F(SessionSnapshotTest, ARestoredTableAnswersItsNextStepsWithTheSameBits) {
  ExpectTheSameBitsAfterARestore([this] { return Table(); });
}

TEST_F(SessionSnapshotTest, OnCudaStorageARestoredTableAnswersItsNextStepsWithTheSameBits) {
  core::Devices devices(1);
  std::string why_none;
  if (devices.GpuCount(&why_none) == 0) GTEST_SKIP() << "no GPU: " << why_none;
  ExpectTheSameBitsAfterARestore([&] {
    const SessionTableOptions options = TableOptions("attention-0");
    auto storage = devices.CreateKvStorage("cuda:0", options.kv_cache_bytes / options.block_bytes,
                                           options.block_bytes);
    EXPECT_TRUE(storage.ok()) << storage.status();
    auto table = SessionTable::Create(options, *std::move(storage));
    EXPECT_TRUE(table.ok()) << table.status();
    return *std::move(table);
  });
}

TEST_F(SessionSnapshotTest, ATornOrCorruptSnapshotRestoresNothingAndTheTableServes) {
  const uint64_t seed = 4102;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  auto before = Table();
  const SessionShape shape = GqaShape();
  const SessionInfo session = *before->CreateSession(shape, 100, absl::ZeroDuration(), kT0);
  const Tokens tokens = RandomTokens(shape, 100, seed);
  std::vector<float> ignored;
  Step(*before, session, tokens, 0, 90, &ignored);
  const std::string directory = FreshDirectory("corrupt");
  const std::string good_path = directory + "/good.kvsnap";
  ASSERT_TRUE(before->WriteSnapshot(good_path, kT0).ok());
  const std::string good = ReadAll(good_path);
  const size_t kTrailer = 16, kDigest = 32, kHeader = 16;
  ASSERT_GT(good.size(), kHeader + 8 + kDigest + kTrailer);
  const auto flipped = [&good](size_t offset) {
    std::string bytes = good;
    bytes[offset] ^= 0x10;
    return bytes;
  };
  std::string older = good;
  older[8] = 0;  // format version 0
  std::string long_index = good;  // an index length of 512 MiB, past the file's end
  long_index[kHeader + 3] = 0x20;
  struct Corruption {
    std::string name, bytes;
    absl::StatusCode code;
    std::string says;
  };
  const std::vector<Corruption> corruptions = {
      {"a write cut short in the last block", good.substr(0, good.size() - kTrailer - 100),
       absl::StatusCode::kDataLoss, "ends inside its block"},
      {"a write cut short in the index", good.substr(0, kHeader + 8 + 10),
       absl::StatusCode::kDataLoss, "ends inside its index"},
      {"an index length past the file (nothing allocated for it)", long_index,
       absl::StatusCode::kDataLoss, "ends inside its index: 5368"},
      {"a bit flipped in the index", flipped(kHeader + 8 + 3), absl::StatusCode::kDataLoss,
       "index does not match its SHA-256"},
      {"a bit flipped in a KV block", flipped(good.size() - kTrailer - kDigest - 7),
       absl::StatusCode::kDataLoss, "does not match its SHA-256"},
      {"an older format", older, absl::StatusCode::kFailedPrecondition, "format version 0"},
      {"bytes past the trailer", good + "x", absl::StatusCode::kDataLoss, "past its trailer"},
      {"not a snapshot", std::string(4096, 'z'), absl::StatusCode::kDataLoss, "ATTNKVSS"},
  };
  for (const Corruption& corruption : corruptions) {
    SCOPED_TRACE(corruption.name);
    const std::string path = directory + "/corrupt.kvsnap";
    WriteAll(path, corruption.bytes);
    auto after = Table();
    const core::kv_cache::KvPoolCounters empty = after->Counters().pool;
    const absl::StatusOr<SnapshotReport> restored = after->RestoreSnapshot(
        path, [](const std::string& name) { return absl::NotFoundError(name); }, kT0);
    ASSERT_FALSE(restored.ok());
    EXPECT_EQ(restored.status().code(), corruption.code) << restored.status();
    EXPECT_TRUE(absl::StrContains(restored.status().message(), corruption.says))
        << restored.status();
    EXPECT_EQ(after->Counters().sessions, 0);
    EXPECT_FALSE(after->Get(session.id, kT0).ok());
    const core::kv_cache::KvPoolCounters pool = after->Counters().pool;
    EXPECT_EQ(pool.blocks_free, empty.blocks_free);
    EXPECT_EQ(pool.blocks_available, empty.blocks_available);
    // Still serving: a new session steps.
    const SessionInfo fresh = *after->CreateSession(shape, 8, absl::ZeroDuration(), kT0);
    Step(*after, fresh, tokens, 0, 4, &ignored);
  }
  // Another replica's snapshot, whole and sound, is not this one's.
  auto other = Table("attention-1");
  const absl::StatusOr<SnapshotReport> foreign = other->RestoreSnapshot(
      good_path, [](const std::string& name) { return absl::NotFoundError(name); }, kT0);
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kFailedPrecondition) << foreign.status();
  EXPECT_TRUE(absl::StrContains(foreign.status().message(), "replica \"attention-0\""))
      << foreign.status();
}

// Through real servers in this process: one drains its sessions to the snapshot directory,
// the next with the same replica name restores them on the same port. The C++ client steps
// through the restart without an error (its retry policy); a session whose layer changed
// meanwhile is left out with its reason while the other comes back.
class SessionSnapshotServerTest : public ::testing::Test {
 protected:
  ServerOptions Options(const std::string& repository, const std::string& listen) {
    ServerOptions options;
    options.listen_address = listen;
    options.metrics_address = "";
    options.compute_threads = 2;
    options.sessions.kv_cache_bytes = 16 << 20;
    options.sessions.replica = "attention-0";
    options.registry.model_repository = repository;
    options.session_snapshot_dir = snapshots_;
    return options;
  }

  std::unique_ptr<AttentionServer> Start(const ServerOptions& options) {
    auto started = AttentionServer::Start(options);
    EXPECT_TRUE(started.ok()) << started.status();
    return started.ok() ? *std::move(started) : nullptr;
  }

  const std::string snapshots_ = FreshDirectory("snapshots");
};

// Q, K and V of n random tokens of a 4-head (2 KV heads) session at `position`.
v1::SessionStepRequest PlainStep(const std::string& session, int64_t position,
                                 std::mt19937_64& rng) {
  v1::SessionStepRequest request;
  v1::SessionStepEntry& entry = *request.add_entries();
  entry.set_session_id(session);
  entry.set_position(position);
  wire::EncodeTensor(RandomValues(rng, 4 * 16), {1, 4, 16}, core::DType::kFloat32,
                     entry.mutable_query());
  wire::EncodeTensor(RandomValues(rng, 2 * 16), {1, 2, 16}, core::DType::kFloat32,
                     entry.mutable_key());
  wire::EncodeTensor(RandomValues(rng, 2 * 16), {1, 2, 16}, core::DType::kFloat32,
                     entry.mutable_value());
  return request;
}

TEST_F(SessionSnapshotServerTest, StepsGoOnThroughARestartAndASessionWhoseLayerChangedIsLeftOut) {
  const uint64_t seed = 4103;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const std::string repository = FreshDirectory("repository");
  auto server = Start(Options(repository, "127.0.0.1:0"));
  ASSERT_NE(server, nullptr);
  const std::string target = absl::StrCat("127.0.0.1:", server->port());
  client::AttentionClient client(target);
  v1::LoadLayerRequest layer = RandomLayerRequest("decoder", 32, /*seed=*/1);
  layer.set_persist(true);
  const absl::StatusOr<v1::LayerInfo> loaded = client.LoadLayer(layer);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  v1::CreateSessionRequest over_layer;
  over_layer.mutable_config()->add_layers("decoder");
  over_layer.set_reserved_tokens(16);
  const absl::StatusOr<v1::SessionInfo> layered = client.CreateSession(over_layer);
  ASSERT_TRUE(layered.ok()) << layered.status();
  v1::CreateSessionRequest plain;
  plain.mutable_config()->set_num_layers(1);
  plain.mutable_config()->set_num_heads(4);
  plain.mutable_config()->set_num_kv_heads(2);
  plain.mutable_config()->set_head_dim(16);
  constexpr int64_t kTokens = 200;
  plain.set_reserved_tokens(kTokens);
  const absl::StatusOr<v1::SessionInfo> session = client.CreateSession(plain);
  ASSERT_TRUE(session.ok()) << session.status();
  std::vector<v1::SessionStepRequest> steps;
  for (int64_t position = 0; position < kTokens; ++position) {
    steps.push_back(PlainStep(session->session_id(), position, rng));
  }

  // A thread steps while the server restarts under it.
  std::atomic<int64_t> answered{0};
  std::atomic<bool> stopped{false};
  std::vector<std::string> failures;  // read once the thread has ended
  const auto step_all = [&] {
    for (const v1::SessionStepRequest& step : steps) {
      const absl::StatusOr<v1::SessionStepResponse> stepped =
          client.SessionStep(step, absl::Seconds(60));
      if (!stepped.ok()) {
        failures.push_back(absl::StrCat("position ", step.entries(0).position(), ": ",
                                        stepped.status().ToString()));
        return;
      }
      ++answered;
    }
  };
  std::thread stepper([&] {
    step_all();
    stopped = true;
  });
  while (answered < kTokens / 4 && !stopped) std::this_thread::yield();
  const int port = server->port();
  server->Shutdown(absl::Seconds(10));
  const std::string path = snapshots_ + "/attention-0.kvsnap";
  EXPECT_TRUE(std::filesystem::exists(path));
  server.reset();
  // The layer's weights change while the server is down: another seed under its name.
  {
    ServerOptions other = Options(repository, "127.0.0.1:0");
    other.session_snapshot_dir = "";
    auto loader = Start(other);
    ASSERT_NE(loader, nullptr);
    v1::LoadLayerRequest changed = RandomLayerRequest("decoder", 32, /*seed=*/2);
    changed.set_persist(true);
    ASSERT_TRUE(client::AttentionClient(absl::StrCat("127.0.0.1:", loader->port()))
                    .LoadLayer(changed)
                    .ok());
  }
  server = Start(Options(repository, absl::StrCat("127.0.0.1:", port)));
  ASSERT_NE(server, nullptr);
  stepper.join();
  EXPECT_TRUE(failures.empty()) << failures[0];
  EXPECT_EQ(answered, kTokens);
  EXPECT_EQ(server->sessions()->Counters().restored, 1);
  EXPECT_FALSE(std::filesystem::exists(path)) << "a restored snapshot is not restored twice";
  const absl::StatusOr<v1::SessionInfo> after = client.GetSession(session->session_id());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->length(), kTokens);
  const absl::StatusOr<v1::SessionInfo> gone = client.GetSession(layered->session_id());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
}

TEST(SessionSnapshotOptionsTest, ASnapshotDirectoryTheServerCannotWriteIsRefusedAtStart) {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.session_snapshot_dir = FreshDirectory("missing") + "/not-there";
  const auto started = AttentionServer::Start(options);
  ASSERT_FALSE(started.ok());
  EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(started.status().message(), "session_snapshot_dir = \""))
      << started.status();
  EXPECT_TRUE(absl::StrContains(started.status().message(), "No such file or directory"))
      << started.status();
}

}  // namespace
}  // namespace attention::server::testing

// Sessions handed from a draining replica to a peer (issue 41's live handoff): the peer
// answers a handed session's next steps with the bits the sender would have given, the
// sender names the peer and its address (after its restart too), the C++ client follows
// it, and every refusal of the handoff service and its options is specific.
#include "server/native/session_handoff.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "core/cpu/thread_pool.h"
#include "gtest/gtest.h"
#include "server/common/status_util.h"
#include "server/sessions/session_table.h"
#include "tests/server/session_tokens.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(2'000'000);

absl::StatusOr<std::shared_ptr<const core::MhaLayer>> NoLayer(const std::string& name) {
  return absl::NotFoundError(name);
}

class SessionHandoffTableTest : public ::testing::Test {
 protected:
  SessionHandoffTableTest() : pool_(2) {}

  std::unique_ptr<SessionTable> Table(const std::string& replica) {
    SessionTableOptions options = Options(/*kv_cache_bytes=*/8 << 20, /*block_bytes=*/16 << 10);
    options.poison_freed_blocks = true;
    options.replica = replica;
    auto table = SessionTable::Create(options, pool_);
    EXPECT_TRUE(table.ok()) << table.status();
    return *std::move(table);
  }

  static void Step(SessionTable& table, const SessionInfo& session, const Tokens& tokens,
                   int64_t from, int64_t to, std::vector<float>* answers) {
    StepOneTokenAtATime(table, session, tokens, from, to, kT0, answers);
  }

  core::ThreadPool pool_;
};

TEST_F(SessionHandoffTableTest, ThePeerAnswersWithTheSendersBitsAndTheSenderNamesThePeer) {
  const uint64_t seed = 4111;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  auto sender = Table("attention-0");
  auto peer = Table("attention-1");
  auto control = Table("attention-0");  // restores the sender's state: its next bits
  const SessionShape shape = GqaShape();
  const SessionInfo source = *sender->CreateSession(shape, 160, absl::Minutes(5), kT0, "alice");
  const Tokens tokens = RandomTokens(shape, 160, seed);
  std::vector<float> ignored;
  Step(*sender, source, tokens, 0, 100, &ignored);
  const SessionInfo fork = *sender->Fork(source.id, 70, 0, absl::ZeroDuration(), kT0);
  const SessionInfo own = *peer->CreateSession(shape, 64, absl::ZeroDuration(), kT0);
  const Tokens own_tokens = RandomTokens(shape, 64, seed + 1);
  Step(*peer, own, own_tokens, 0, 10, &ignored);

  const std::string directory = FreshDirectory("handoff-table");
  ASSERT_TRUE(sender->WriteSnapshot(directory + "/attention-0.kvsnap", kT0).ok());
  ASSERT_TRUE(control->RestoreSnapshot(directory + "/attention-0.kvsnap", NoLayer, kT0).ok());

  const std::string path = directory + "/handoff.kvsnap";
  const absl::StatusOr<SnapshotReport> written = sender->BeginHandoff(path, kT0);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->sessions, 2);
  // Moving: every call of a live session is UNAVAILABLE, which clients retry.
  std::vector<float> output;
  const StepEntry moving_entry = Entry(source, tokens, 0, 100, 1, &output);
  const absl::Status moving = sender->Step({&moving_entry, 1}, kT0)[0];
  EXPECT_EQ(moving.code(), absl::StatusCode::kUnavailable) << moving;
  EXPECT_EQ(ReasonOf(moving), "SESSION_MOVING") << moving;
  EXPECT_EQ(sender->Get(fork.id, kT0).status().code(), absl::StatusCode::kUnavailable);

  const absl::StatusOr<SnapshotReport> adopted = peer->AdoptSnapshot(path, NoLayer, kT0);
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ(adopted->sessions, 2);
  EXPECT_EQ(adopted->refused_sessions, 0);
  EXPECT_EQ(adopted->adopted.size(), 2u);
  EXPECT_EQ(peer->Counters().adopted, 2);
  EXPECT_EQ(peer->Counters().sessions, 3) << "beside its own session";
  EXPECT_GT(peer->Counters().pool.blocks_shared, 0) << "the fork still shares its prefix";
  // Adopting the same file again adopts nothing: those ids are held here.
  const absl::StatusOr<SnapshotReport> again = peer->AdoptSnapshot(path, NoLayer, kT0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->sessions, 0);
  EXPECT_EQ(again->refused_sessions, 2);
  ASSERT_FALSE(again->refused.empty());
  EXPECT_TRUE(absl::StrContains(again->refused[0], "held here already")) << again->refused[0];
  EXPECT_EQ(peer->Counters().sessions, 3);

  sender->EndHandoff(adopted->adopted, "attention-1", "10.0.0.2:50051", kT0);
  EXPECT_EQ(sender->Counters().sessions, 0);
  EXPECT_EQ(sender->Counters().handed_off, 2);
  EXPECT_EQ(sender->Counters().pool.blocks_free, sender->Counters().pool.blocks_total);
  const absl::Status moved = sender->Get(source.id, kT0).status();
  EXPECT_EQ(moved.code(), absl::StatusCode::kFailedPrecondition) << moved;
  EXPECT_EQ(ReasonOf(moved), "WRONG_REPLICA") << moved;
  EXPECT_TRUE(absl::StrContains(moved.message(),
                                "is held by replica \"attention-1\" at \"10.0.0.2:50051\""))
      << moved;
  // A restart keeps telling it: the sender's snapshot carries where its sessions went.
  const std::string after_path = directory + "/after.kvsnap";
  ASSERT_TRUE(sender->WriteSnapshot(after_path, kT0).ok());
  auto restarted = Table("attention-0");
  const absl::StatusOr<SnapshotReport> restored =
      restarted->RestoreSnapshot(after_path, NoLayer, kT0 + absl::Minutes(1));
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->sessions, 0);
  const absl::Status still = restarted->Get(fork.id, kT0 + absl::Minutes(1)).status();
  EXPECT_EQ(ReasonOf(still), "WRONG_REPLICA") << still;
  EXPECT_TRUE(absl::StrContains(still.message(), "at \"10.0.0.2:50051\"")) << still;

  // The next steps on the peer: the bits the sender would have given.
  std::vector<float> expected, got;
  Step(*control, source, tokens, 100, 160, &expected);
  Step(*control, fork, tokens, 70, 90, &expected);
  Step(*peer, source, tokens, 100, 160, &got);
  Step(*peer, fork, tokens, 70, 90, &got);
  ASSERT_EQ(got.size(), expected.size());
  EXPECT_EQ(0, std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)));
  // The peer's own session goes on untouched.
  Step(*peer, own, own_tokens, 10, 20, &ignored);
}

TEST_F(SessionHandoffTableTest, AHandoffThePeerRefusesLeavesTheSessionsAnsweringHere) {
  auto sender = Table("attention-0");
  auto peer = Table("attention-1");
  const SessionShape shape = GqaShape();
  const SessionInfo session = *sender->CreateSession(shape, 16, absl::ZeroDuration(), kT0);
  const std::string directory = FreshDirectory("handoff-refused");
  ASSERT_TRUE(sender->BeginHandoff(directory + "/handoff.kvsnap", kT0).ok());
  // A replica adopts only other replicas' sessions.
  const absl::StatusOr<SnapshotReport> own =
      sender->AdoptSnapshot(directory + "/handoff.kvsnap", NoLayer, kT0);
  EXPECT_EQ(own.status().code(), absl::StatusCode::kFailedPrecondition) << own.status();
  EXPECT_TRUE(absl::StrContains(own.status().message(), "adopts only other named replicas"))
      << own.status();
  sender->EndHandoff({}, "", "", kT0);
  EXPECT_TRUE(sender->Get(session.id, kT0).ok());
  EXPECT_EQ(sender->Counters().handed_off, 0);
  EXPECT_EQ(peer->Counters().sessions, 0);
}

// Two servers: replica-a hands its sessions to replica-b, which adopts them.
class SessionHandoffServerTest : public ::testing::Test {
 protected:
  static ServerOptions Options(const std::string& replica) {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = "";
    options.compute_threads = 1;
    options.demo_layer = false;
    options.sessions.kv_cache_bytes = 4 << 20;
    options.sessions.replica = replica;
    options.replica_address = "127.0.0.1";
    return options;
  }

  static std::unique_ptr<AttentionServer> Start(const ServerOptions& options) {
    auto started = AttentionServer::Start(options);
    EXPECT_TRUE(started.ok()) << started.status();
    return started.ok() ? *std::move(started) : nullptr;
  }

  static std::string Target(const AttentionServer& server) {
    return absl::StrCat("127.0.0.1:", server.port());
  }

  // One random token at `position` of OneLayerSessionRequest(4, ...)'s session.
  v1::SessionStepRequest OneToken(const std::string& session_id, int64_t position) {
    v1::SessionStepRequest request;
    v1::SessionStepEntry& entry = *request.add_entries();
    entry.set_session_id(session_id);
    entry.set_position(position);
    wire::EncodeTensor(RandomValues(rng_, 4 * 8), {1, 4, 8}, core::DType::kFloat32,
                       entry.mutable_query());
    wire::EncodeTensor(RandomValues(rng_, 8), {1, 1, 8}, core::DType::kFloat32,
                       entry.mutable_key());
    wire::EncodeTensor(RandomValues(rng_, 8), {1, 1, 8}, core::DType::kFloat32,
                       entry.mutable_value());
    return request;
  }

  // Sends `bytes` to `target`'s AdoptSessions, with `token` as bearer when non-empty.
  static grpc::Status SendSnapshot(const std::string& target, const std::string& bytes,
                                   const std::string& token = "") {
    auto stub = v1::SessionHandoff::NewStub(
        grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    v1::AdoptSessionsResponse response;
    auto writer = stub->AdoptSessions(&context, &response);
    for (size_t at = 0; at < bytes.size(); at += 1 << 20) {
      v1::SessionSnapshotChunk chunk;
      chunk.set_data(bytes.substr(at, 1 << 20));
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  std::mt19937_64 rng_{4113};
};

TEST_F(SessionHandoffServerTest, TheClientFollowsASessionHandedToThePeer) {
  ServerOptions peer_options = Options("replica-b");
  peer_options.accept_session_handoff = true;
  auto peer = Start(peer_options);
  ASSERT_NE(peer, nullptr);
  auto sender = Start(Options("replica-a"));
  ASSERT_NE(sender, nullptr);
  client::AttentionClient client(Target(*sender));
  const absl::StatusOr<v1::SessionInfo> session =
      client.CreateSession(OneLayerSessionRequest(/*num_heads=*/4, /*reserved_tokens=*/8));
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(client.SessionStep(OneToken(session->session_id(), 0)).ok());

  const absl::StatusOr<HandoffReport> handed =
      HandOffSessions(*sender->sessions(), Target(*peer),
                      FreshDirectory("handoff-server") + "/replica-a.handoff.kvsnap", "",
                      absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(handed.ok()) << handed.status();
  EXPECT_EQ(handed->adopted, 1);
  EXPECT_EQ(handed->holder, "replica-b");
  EXPECT_EQ(handed->address, Target(*peer)) << "the peer's --replica_address, its port added";

  // Another client of the sender's address (nothing pinned) is told where it went, and
  // follows: the call answers.
  client::AttentionClient plain(Target(*sender));
  const absl::StatusOr<v1::SessionInfo> told = plain.GetSession(session->session_id());
  ASSERT_TRUE(told.ok()) << told.status();
  EXPECT_EQ(told->length(), 1);
  // The first client follows too, and its next steps go on at the peer.
  const absl::StatusOr<v1::SessionStepResponse> step =
      client.SessionStep(OneToken(session->session_id(), 1));
  ASSERT_TRUE(step.ok()) << step.status();
  const absl::StatusOr<v1::SessionInfo> after = client.GetSession(session->session_id());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->length(), 2);
  EXPECT_EQ(after->replica(), "replica-b");
  EXPECT_EQ(sender->sessions()->Counters().sessions, 0);
  EXPECT_EQ(sender->sessions()->Counters().handed_off, 1);

  // The refusal itself, as a client that does not follow reads it.
  auto stub = v1::AttentionService::NewStub(
      grpc::CreateChannel(Target(*sender), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::GetSessionRequest request;
  request.set_session_id(session->session_id());
  v1::GetSessionResponse response;
  const grpc::Status raw = stub->GetSession(&context, request, &response);
  EXPECT_EQ(raw.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(absl::StrContains(
      raw.error_message(),
      absl::StrCat("is held by replica \"replica-b\" at \"", Target(*peer), "\"")))
      << raw.error_message();
  EXPECT_FALSE(raw.error_details().empty()) << "the reason travels in the details";
}

TEST_F(SessionHandoffServerTest, AnUnreachablePeerLeavesTheSessionsHere) {
  auto sender = Start(Options("replica-a"));
  ASSERT_NE(sender, nullptr);
  client::AttentionClient client(Target(*sender));
  const absl::StatusOr<v1::SessionInfo> session =
      client.CreateSession(OneLayerSessionRequest(4, 8));
  ASSERT_TRUE(session.ok()) << session.status();
  // A port nothing listens on: the listener of a server that has stopped.
  int closed_port = 0;
  {
    auto gone = Start(Options("replica-c"));
    ASSERT_NE(gone, nullptr);
    closed_port = gone->port();
  }
  const absl::StatusOr<HandoffReport> handed =
      HandOffSessions(*sender->sessions(), absl::StrCat("127.0.0.1:", closed_port),
                      FreshDirectory("handoff-unreachable") + "/replica-a.handoff.kvsnap", "",
                      absl::Now() + absl::Seconds(1));
  EXPECT_FALSE(handed.ok());
  EXPECT_TRUE(absl::StrContains(handed.status().message(), "adopted nothing")) << handed.status();
  EXPECT_TRUE(client.SessionStep(OneToken(session->session_id(), 0)).ok())
      << "the session answers here again";
}

TEST_F(SessionHandoffServerTest, AdoptSessionsRefusesWhatItCannotTake) {
  ServerOptions peer_options = Options("replica-b");
  peer_options.accept_session_handoff = true;
  peer_options.access.admin_token = "admin-secret";
  auto peer = Start(peer_options);
  ASSERT_NE(peer, nullptr);
  const std::string target = Target(*peer);
  grpc::Status status = SendSnapshot(target, "x");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "admin token"));
  status = SendSnapshot(target, "x", "not-the-token");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
  status = SendSnapshot(target, std::string(4096, '\0'), "admin-secret");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DATA_LOSS) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "not a session snapshot"))
      << status.error_message();
  // Past what its pool can hold: refused while it streams, not after it is spooled whole.
  const int64_t bound = 4 << 20;
  status = SendSnapshot(target, std::string(bound + (80 << 20), '\0'), "admin-secret");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "--kv_cache_bytes"))
      << status.error_message();
  EXPECT_EQ(peer->sessions()->Counters().sessions, 0);

  // A server without --accept_session_handoff does not serve it.
  auto closed = Start(Options("replica-c"));
  ASSERT_NE(closed, nullptr);
  status = SendSnapshot(Target(*closed), "x");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
}

TEST(SessionHandoffOptionsTest, HandoffOptionsThatCannotWorkAreRefusedAtStart) {
  const auto refused = [](const std::function<void(ServerOptions&)>& change,
                          const std::string& says) {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = "";
    options.sessions.replica = "replica-a";
    options.session_handoff_peer = "127.0.0.1:1";
    change(options);
    const auto started = AttentionServer::Start(options);
    ASSERT_FALSE(started.ok()) << says;
    EXPECT_EQ(started.status().code(), absl::StatusCode::kInvalidArgument) << started.status();
    EXPECT_TRUE(absl::StrContains(started.status().message(), says)) << started.status();
  };
  refused([](ServerOptions& o) { o.sessions.replica.clear(); }, "and a replica_name");
  refused([](ServerOptions& o) { o.sessions.kv_cache_bytes = 0; }, "need sessions");
  refused(
      [](ServerOptions& o) {
        o.session_handoff_peer.clear();
        o.accept_session_handoff = true;
        o.sessions.replica.clear();
      },
      "accept_session_handoff need");
  refused([](ServerOptions& o) { o.tls.cert_file = "/nonexistent/cert.pem"; }, "with TLS");
  refused([](ServerOptions& o) { o.session_handoff_linger = absl::Seconds(-1); },
          "session_handoff_linger = -1s must be >= 0");
}

}  // namespace
}  // namespace attention::server::testing

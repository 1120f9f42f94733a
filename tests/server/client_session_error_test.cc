// The C++ client's session refusals (issue 38): every session method keeps the server's
// machine-readable reason on the absl::Status it returns, SessionRefusalOf reads it (and the
// holder of a session on another replica), and StatusOf does the same for stream answers.
#include <map>
#include <random>
#include <string>

#include <grpcpp/client_context.h>

#include "absl/strings/match.h"
#include "client/attention_client.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

using C = absl::StatusCode;

// A well-formed session id of `replica` that no server has made.
std::string IdOf(const std::string& replica) { return replica + "/" + std::string(32, '0'); }

class ClientSessionErrorTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.demo_layer = false;
    options.sessions.kv_cache_bytes = 2 << 20;
    options.sessions.replica = "replica-a";
    return options;
  }

  v1::SessionInfo Create() {
    v1::CreateSessionRequest request;
    request.mutable_config()->set_num_layers(1);
    request.mutable_config()->set_num_heads(4);
    request.mutable_config()->set_num_kv_heads(2);
    request.mutable_config()->set_head_dim(16);
    request.set_reserved_tokens(16);
    const absl::StatusOr<v1::SessionInfo> session = client_->CreateSession(request);
    EXPECT_TRUE(session.ok()) << session.status();
    return session.value_or(v1::SessionInfo());
  }

  // An entry of one random token at `position` of layer 0.
  v1::SessionStepEntry Entry(const std::string& session_id, int64_t position) {
    v1::SessionStepEntry entry;
    entry.set_session_id(session_id);
    entry.set_position(position);
    wire::EncodeTensor(RandomValues(rng_, 4 * 16), {1, 4, 16}, core::DType::kFloat32,
                       entry.mutable_query());
    wire::EncodeTensor(RandomValues(rng_, 2 * 16), {1, 2, 16}, core::DType::kFloat32,
                       entry.mutable_key());
    wire::EncodeTensor(RandomValues(rng_, 2 * 16), {1, 2, 16}, core::DType::kFloat32,
                       entry.mutable_value());
    return entry;
  }

  std::mt19937_64 rng_{38};
};

// Checks `status` has `code` and the refusal `reason` (and `holder`).
void ExpectRefusal(const absl::Status& status, C code, const std::string& reason,
                   const std::string& holder = "") {
  EXPECT_EQ(status.code(), code) << status;
  const std::optional<client::SessionRefusal> refusal = client::SessionRefusalOf(status);
  ASSERT_TRUE(refusal.has_value()) << status;
  EXPECT_EQ(refusal->reason, reason) << status;
  EXPECT_EQ(refusal->holder, holder) << status;
}

TEST_F(ClientSessionErrorTest, EverySessionMethodKeepsTheReason) {
  const v1::SessionInfo session = Create();
  v1::SessionStepRequest gap;
  *gap.add_entries() = Entry(session.session_id(), 3);
  ExpectRefusal(client_->SessionStep(gap).status(), C::kOutOfRange, "POSITION_GAP");
  ExpectRefusal(client_->GetSession(IdOf("replica-a")).status(), C::kNotFound, "SESSION_UNKNOWN");
  ExpectRefusal(client_->GetSession(IdOf("replica-b")).status(), C::kFailedPrecondition,
                "WRONG_REPLICA", "replica-b");
  v1::ForkSessionRequest fork;
  fork.set_session_id(IdOf("replica-a"));
  fork.set_reserved_tokens(16);
  ExpectRefusal(client_->ForkSession(fork).status(), C::kNotFound, "SESSION_UNKNOWN");
  ASSERT_TRUE(client_->DropSession(session.session_id()).ok());
  ExpectRefusal(client_->TruncateSession(session.session_id(), 0).status(), C::kNotFound,
                "SESSION_DROPPED");
  ExpectRefusal(client_->DropSession(session.session_id()), C::kNotFound, "SESSION_DROPPED");
}

TEST_F(ClientSessionErrorTest, ErrorsWithoutAReasonAreNoRefusal) {
  EXPECT_FALSE(client::SessionRefusalOf(absl::OkStatus()).has_value());
  v1::CreateSessionRequest malformed;  // no heads: INVALID_ARGUMENT, no reason
  malformed.set_reserved_tokens(16);
  const absl::Status status = client_->CreateSession(malformed).status();
  EXPECT_EQ(status.code(), C::kInvalidArgument) << status;
  EXPECT_FALSE(client::SessionRefusalOf(status).has_value()) << status;
}

// A step with entries on two replicas is sent to each and its failure renamed; the reason and
// holder survive the renaming. The second "replica" is this server under another address.
TEST_F(ClientSessionErrorTest, AStepSplitOverReplicasKeepsTheReason) {
  const v1::SessionInfo session = Create();
  const std::string elsewhere = IdOf("replica-c");
  client_->PinSession(elsewhere, "ipv4:127.0.0.1:" + std::to_string(server_->port()));
  v1::SessionStepRequest step;
  *step.add_entries() = Entry(session.session_id(), 0);
  *step.add_entries() = Entry(elsewhere, 0);
  const absl::Status status = client_->SessionStep(step).status();
  EXPECT_TRUE(absl::StartsWith(status.message(), "the step's entries on the replica of entries[1]"))
      << status;
  ExpectRefusal(status, C::kFailedPrecondition, "WRONG_REPLICA", "replica-c");
}

TEST_F(ClientSessionErrorTest, StreamAnswersCarryTheReason) {
  const v1::SessionInfo session = Create();
  auto stub = v1::AttentionService::NewStub(client_->channel());
  grpc::ClientContext context;
  auto stream = stub->SessionStepStream(&context);
  const std::map<std::string, v1::SessionStepEntry> steps = {
      {"ok", Entry(session.session_id(), 0)},
      {"gap", Entry(session.session_id(), 5)},
      {"elsewhere", Entry(IdOf("replica-b"), 0)}};
  for (const auto& [id, entry] : steps) {
    v1::SessionStepRequest request;
    request.set_request_id(id);
    *request.add_entries() = entry;
    ASSERT_TRUE(stream->Write(request));
  }
  stream->WritesDone();
  std::map<std::string, absl::Status> answers;
  for (v1::SessionStepStreamResponse answer; stream->Read(&answer);) {
    answers[answer.request_id()] = client::StatusOf(answer);
  }
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_EQ(answers.size(), 3u);
  EXPECT_TRUE(answers["ok"].ok()) << answers["ok"];
  EXPECT_FALSE(client::SessionRefusalOf(answers["ok"]).has_value());
  ExpectRefusal(answers["gap"], C::kOutOfRange, "POSITION_GAP");
  ExpectRefusal(answers["elsewhere"], C::kFailedPrecondition, "WRONG_REPLICA", "replica-b");
}

// The holder comes from the message: a name the server cut short (too long to quote whole)
// is no holder rather than a wrong one, and a message without one names none.
TEST(SessionRefusalOfTest, AHolderCutShortIsNone) {
  v1::SessionStepStreamResponse answer;
  answer.set_error_code(static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
  answer.set_error_reason("WRONG_REPLICA");
  answer.set_error_message("session \"x/0\" is held by replica \"" + std::string(128, 'r') +
                           "... (200 bytes)\", not this one (\"a\")");
  std::optional<client::SessionRefusal> refusal =
      client::SessionRefusalOf(client::StatusOf(answer));
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->reason, "WRONG_REPLICA");
  EXPECT_EQ(refusal->holder, "");
  answer.set_error_message(
      "entries[0]: session \"r.1_x-2/0\" is held by replica \"r.1_x-2\", "
      "not this one (\"a\")");
  refusal = client::SessionRefusalOf(client::StatusOf(answer));
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->holder, "r.1_x-2");
  // Another reason names no holder, whatever its message says.
  answer.set_error_reason("SESSION_UNKNOWN");
  refusal = client::SessionRefusalOf(client::StatusOf(answer));
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->holder, "");
  answer.set_error_reason("");
  EXPECT_FALSE(client::SessionRefusalOf(client::StatusOf(answer)).has_value());
}

}  // namespace
}  // namespace attention::server::testing

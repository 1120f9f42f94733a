// Session credentials (issue 38, access): with --session_tokens_file every session call needs
// a token, a session is its creator's identity's alone, each identity lists its own, the
// admin token reaches every session, and per-identity limits hold; the tokens file's parser
// refuses what it cannot trust. Identities from client certificates are in tls_test.cc.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/attention_client.h"
#include "server/native/access_policy.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

using C = absl::StatusCode;

constexpr char kAliceToken[] = "alice-token-0123456789";
constexpr char kBobToken[] = "bob-token-0123456789ab";
constexpr char kAdminToken[] = "admin-token-0123456789";

class SessionAccessTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.demo_layer = false;
    options.access.admin_token = kAdminToken;
    options.access.session_tokens = {{"alice", kAliceToken}, {"bob", kBobToken}};
    options.sessions.max_sessions_per_owner = 2;
    options.sessions.max_reserved_tokens_per_owner = 100;
    return options;
  }

  // A client sending `token` with its session calls ("" for none).
  std::unique_ptr<client::AttentionClient> ClientWith(const std::string& token) {
    client::ClientOptions options;
    options.session_token = token;
    return std::make_unique<client::AttentionClient>("127.0.0.1:" + std::to_string(server_->port()),
                                                     options);
  }

  static v1::CreateSessionRequest CreateRequest(int64_t reserved_tokens) {
    return OneLayerSessionRequest(/*num_heads=*/2, reserved_tokens);
  }

  // One token of layer 0 at `position`.
  static v1::SessionStepRequest StepRequest(const std::string& session_id, int64_t position) {
    v1::SessionStepRequest request;
    v1::SessionStepEntry& entry = *request.add_entries();
    entry.set_session_id(session_id);
    entry.set_position(position);
    wire::EncodeTensor(std::vector<float>(16, 0.5f), {1, 2, 8}, core::DType::kFloat32,
                       entry.mutable_query());
    wire::EncodeTensor(std::vector<float>(8, 0.25f), {1, 1, 8}, core::DType::kFloat32,
                       entry.mutable_key());
    wire::EncodeTensor(std::vector<float>(8, 1.0f), {1, 1, 8}, core::DType::kFloat32,
                       entry.mutable_value());
    return request;
  }

  // ListSessions with `token` ("" for none): the ids, or the refusal.
  absl::StatusOr<std::vector<std::string>> List(const std::string& token) {
    auto stub = v1::AttentionService::NewStub(client_->channel());
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    v1::ListSessionsResponse response;
    const grpc::Status status = stub->ListSessions(&context, {}, &response);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          status.error_message());
    }
    std::vector<std::string> ids;
    for (const v1::SessionInfo& info : response.sessions()) ids.push_back(info.session_id());
    return ids;
  }

  static std::string ReasonOf(const absl::Status& status) {
    const std::optional<client::SessionRefusal> refusal = client::SessionRefusalOf(status);
    return refusal.has_value() ? refusal->reason : "";
  }
};

TEST_F(SessionAccessTest, SessionCallsWithoutAKnownTokenAreUnauthenticated) {
  const absl::Status anonymous = ClientWith("")->CreateSession(CreateRequest(8)).status();
  EXPECT_EQ(anonymous.code(), C::kUnauthenticated) << anonymous;
  EXPECT_EQ(ReasonOf(anonymous), "CREDENTIAL_MISSING");
  EXPECT_TRUE(absl::StrContains(anonymous.message(), "CreateSession needs a credential"))
      << anonymous;

  const absl::Status stranger =
      ClientWith("mallory-token-0123456789")->CreateSession(CreateRequest(8)).status();
  EXPECT_EQ(stranger.code(), C::kUnauthenticated) << stranger;
  EXPECT_EQ(ReasonOf(stranger), "CREDENTIAL_UNKNOWN");
  EXPECT_FALSE(absl::StrContains(stranger.message(), "mallory"))
      << "echoes the token: " << stranger;

  // Authorization metadata of another kind is no credential.
  {
    auto stub = v1::AttentionService::NewStub(client_->channel());
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Basic YWxpY2U6c2VjcmV0");
    v1::CreateSessionResponse response;
    const grpc::Status basic = stub->CreateSession(&context, CreateRequest(8), &response);
    EXPECT_EQ(basic.error_code(), grpc::StatusCode::UNAUTHENTICATED) << basic.error_message();
  }

  // Every session call, the step and GetSession included, not only CreateSession.
  const absl::StatusOr<v1::SessionInfo> session =
      ClientWith(kAliceToken)->CreateSession(CreateRequest(8));
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ(ClientWith("")->GetSession(session->session_id()).status().code(), C::kUnauthenticated);
  EXPECT_EQ(ClientWith("")->SessionStep(StepRequest(session->session_id(), 0)).status().code(),
            C::kUnauthenticated);
  EXPECT_EQ(List("").status().code(), C::kUnauthenticated);
}

TEST_F(SessionAccessTest, ASessionIsItsCreatorsIdentitysAlone) {
  auto alice = ClientWith(kAliceToken);
  auto bob = ClientWith(kBobToken);
  const absl::StatusOr<v1::SessionInfo> session = alice->CreateSession(CreateRequest(8));
  ASSERT_TRUE(session.ok()) << session.status();
  const std::string id = session->session_id();
  ASSERT_TRUE(alice->SessionStep(StepRequest(id, 0)).ok());

  v1::ForkSessionRequest fork;
  fork.set_session_id(id);
  fork.set_tokens(1);
  const std::vector<std::pair<std::string, absl::Status>> refusals = {
      {"SessionStep", bob->SessionStep(StepRequest(id, 1)).status()},
      {"GetSession", bob->GetSession(id).status()},
      {"ForkSession", bob->ForkSession(fork).status()},
      {"TruncateSession", bob->TruncateSession(id, 0).status()},
      {"DropSession", bob->DropSession(id)},
  };
  for (const auto& [method, status] : refusals) {
    EXPECT_EQ(status.code(), C::kPermissionDenied) << method << ": " << status;
    EXPECT_EQ(ReasonOf(status), "SESSION_OF_ANOTHER_IDENTITY") << method;
    EXPECT_TRUE(absl::StrContains(status.message(), "\"bob\"")) << method << ": " << status;
  }
  // Nothing bob tried changed the session: alice's next step lands at position 1.
  const absl::StatusOr<v1::SessionInfo> after = alice->GetSession(id);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->length(), 1);
  EXPECT_TRUE(alice->SessionStep(StepRequest(id, 1)).ok());

  // A fork is its source's identity's; the admin token reaches both.
  const absl::StatusOr<v1::SessionInfo> forked = alice->ForkSession(fork);
  ASSERT_TRUE(forked.ok()) << forked.status();
  EXPECT_EQ(bob->GetSession(forked->session_id()).status().code(), C::kPermissionDenied);
  auto admin = ClientWith(kAdminToken);
  EXPECT_TRUE(admin->GetSession(forked->session_id()).ok());
  EXPECT_TRUE(admin->DropSession(id).ok());
}

TEST_F(SessionAccessTest, EachIdentityListsItsOwnAndTheAdminEvery) {
  const absl::StatusOr<v1::SessionInfo> of_alice =
      ClientWith(kAliceToken)->CreateSession(CreateRequest(8));
  const absl::StatusOr<v1::SessionInfo> of_bob =
      ClientWith(kBobToken)->CreateSession(CreateRequest(8));
  ASSERT_TRUE(of_alice.ok() && of_bob.ok());
  EXPECT_EQ(*List(kAliceToken), std::vector<std::string>{of_alice->session_id()});
  EXPECT_EQ(*List(kBobToken), std::vector<std::string>{of_bob->session_id()});
  EXPECT_EQ(List(kAdminToken)->size(), 2u);
}

TEST_F(SessionAccessTest, PerIdentityLimitsHoldForSessionsAndReservedTokens) {
  auto alice = ClientWith(kAliceToken);
  const absl::StatusOr<v1::SessionInfo> first = alice->CreateSession(CreateRequest(60));
  ASSERT_TRUE(first.ok()) << first.status();
  // 60 + 50 > 100 tokens.
  absl::Status status = alice->CreateSession(CreateRequest(50)).status();
  EXPECT_EQ(status.code(), C::kResourceExhausted) << status;
  EXPECT_EQ(ReasonOf(status), "MAX_RESERVED_TOKENS_PER_IDENTITY");
  EXPECT_TRUE(absl::StrContains(status.message(), "reserve 60 tokens; 50 more")) << status;
  // A fork counts as a session of its own reservation.
  v1::ForkSessionRequest fork;
  fork.set_session_id(first->session_id());
  fork.set_reserved_tokens(40);
  ASSERT_TRUE(alice->ForkSession(fork).ok());
  status = alice->CreateSession(CreateRequest(1)).status();
  EXPECT_EQ(status.code(), C::kResourceExhausted) << status;
  EXPECT_EQ(ReasonOf(status), "MAX_SESSIONS_PER_IDENTITY");
  // Another identity is not held back by alice's; a dropped session gives its share back.
  EXPECT_TRUE(ClientWith(kBobToken)->CreateSession(CreateRequest(100)).ok());
  ASSERT_TRUE(alice->DropSession(first->session_id()).ok());
  EXPECT_TRUE(alice->CreateSession(CreateRequest(60)).ok());
}

TEST(SessionTokensTest, TheTokensFileIsParsedOrRefusedNamingTheLine) {
  const absl::StatusOr<std::vector<SessionToken>> tokens = ParseSessionTokens(
      "# identity token\n\nalice  alice-token-0123456789\n  bob\tbob-token-0123456789ab  \n");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 2u);
  EXPECT_EQ((*tokens)[0].identity, "alice");
  EXPECT_EQ((*tokens)[0].token, "alice-token-0123456789");
  EXPECT_EQ((*tokens)[1].identity, "bob");

  struct Refused {
    const char* text;
    const char* message;
  };
  for (const Refused& refused : {
           Refused{"alice\n", "line 1 has 1 fields"},
           Refused{"ok ok-token-0123456789\nalice a b\n", "line 2 has 3 fields"},
           Refused{"al/ice alice-token-0123456789\n", "line 1: the identity must be"},
           Refused{"alice short\n", "the token of \"alice\" has 5 bytes; use at least 16"},
           Refused{"alice same-token-0123456789\nbob same-token-0123456789\n",
                   "line 2: the token of \"bob\" is also the token of \"alice\""},
           Refused{"# nothing\n", "no \"IDENTITY TOKEN\" line"},
       }) {
    const absl::StatusOr<std::vector<SessionToken>> parsed = ParseSessionTokens(refused.text);
    ASSERT_FALSE(parsed.ok()) << refused.text;
    EXPECT_EQ(parsed.status().code(), C::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(parsed.status().message(), refused.message)) << parsed.status();
    EXPECT_FALSE(absl::StrContains(parsed.status().message(), "0123456789"))
        << "echoes a token: " << parsed.status();
  }
  const std::string long_identity(129, 'a');
  EXPECT_FALSE(ParseSessionTokens(long_identity + " long-token-0123456789").ok());
}

}  // namespace
}  // namespace attention::server::testing

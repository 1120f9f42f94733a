// TLS and mutual TLS on the gRPC port, with certificates made at test time by Debian's
// openssl: the handshake, refusals (plaintext, another CA, no client certificate under
// mTLS), a rotated server certificate served without a restart, and sessions owned by the
// identity of a client certificate.
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/auth_context.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

// A CA, a server certificate (CN server-1, for localhost and 127.0.0.1) and client
// certificates it signed (alice's and bob's name them in their subject alternative name),
// and a second CA with a client certificate of its own.
class Certificates {
 public:
  Certificates() {
    char pattern[] = "/tmp/attention-tls-XXXXXX";
    dir_ = ::mkdtemp(pattern);
    Run("printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > san.ext");
    MakeCa("ca");
    MakeCa("other-ca");
    Sign("server", "server-1", "ca");
    Sign("client", "client", "ca");
    Sign("intruder", "intruder", "other-ca");
    for (const std::string name : {"alice", "bob"}) {
      Run(absl::StrCat("printf 'subjectAltName=DNS:", name, "\\n' > ", name, ".ext"));
      Sign(name, name, "ca", name + ".ext");
    }
  }
  ~Certificates() { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& file) const { return dir_ + "/" + file; }

  // Re-issues the server certificate as `common_name` and swaps it in atomically.
  void RotateServer(const std::string& common_name) {
    Sign("next", common_name, "ca");
    Run("mv next.key server.key && mv next.pem server.pem");
  }

 private:
  void Run(const std::string& command) {
    const std::string full = "cd " + dir_ + " && (" + command + ") >/dev/null 2>&1";
    ASSERT_EQ(std::system(full.c_str()), 0) << command;
  }
  void MakeCa(const std::string& name) {
    Run("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 "
        "-subj /CN=" + name + " -keyout " + name + ".key -out " + name + ".pem");
  }
  void Sign(const std::string& name, const std::string& common_name, const std::string& ca,
            const std::string& extensions = "san.ext") {
    Run("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=" +
        common_name + " -keyout " + name + ".key -out " + name + ".csr && openssl x509 -req -in " +
        name + ".csr -CA " + ca + ".pem -CAkey " + ca + ".key -CAcreateserial -days 2 -extfile " +
        extensions + " -out " + name + ".pem");
  }

  std::string dir_;
};

class TlsServerTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.tls.cert_file = certificates_.Path("server.pem");
    options.tls.key_file = certificates_.Path("server.key");
    options.tls.reload_interval = absl::Seconds(1);
    if (mutual_) options.tls.client_ca_file = certificates_.Path("ca.pem");
    return options;
  }

  std::string Target() const { return "127.0.0.1:" + std::to_string(server_->port()); }

  client::ClientOptions Trusting(const std::string& ca, const std::string& identity = "") {
    client::ClientOptions options;
    options.tls_ca_file = certificates_.Path(ca + ".pem");
    if (!identity.empty()) {
      options.tls_cert_file = certificates_.Path(identity + ".pem");
      options.tls_key_file = certificates_.Path(identity + ".key");
    }
    return options;
  }

  absl::Status List(const client::ClientOptions& options) {
    return client::AttentionClient(Target(), options).ListLayers(absl::Seconds(10)).status();
  }

  Certificates certificates_;
  bool mutual_ = false;
};

TEST_F(TlsServerTest, HandshakeWorksAndPlaintextOrAnotherCaIsRefused) {
  EXPECT_TRUE(List(Trusting("ca")).ok());
  EXPECT_EQ(List(client::ClientOptions()).code(), absl::StatusCode::kUnavailable)
      << "a plaintext client must not get through";
  EXPECT_EQ(List(Trusting("other-ca")).code(), absl::StatusCode::kUnavailable)
      << "a server certificate from another CA must not be trusted";
}

TEST_F(TlsServerTest, RotatedServerCertificateIsServedWithoutRestart) {
  auto peer_name = [&]() -> std::string {
    auto credentials = client::ChannelCredentials(Trusting("ca"));
    EXPECT_TRUE(credentials.ok());
    auto channel = grpc::CreateChannel(Target(), *credentials);
    auto stub = v1::AttentionService::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ListLayersResponse response;
    if (!stub->ListLayers(&context, v1::ListLayersRequest(), &response).ok()) return "";
    const auto names = context.auth_context()->FindPropertyValues("x509_common_name");
    return names.empty() ? "" : std::string(names.front().data(), names.front().size());
  };
  ASSERT_EQ(peer_name(), "server-1");
  certificates_.RotateServer("server-2");
  // The files are re-read every second: new connections see the new certificate within a
  // few intervals. Each attempt is a full handshake; the deadline bounds the wait.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::string seen;
  while (absl::Now() < deadline && (seen = peer_name()) != "server-2") {
  }
  EXPECT_EQ(seen, "server-2");
}

class MutualTlsServerTest : public TlsServerTest {
 protected:
  MutualTlsServerTest() { mutual_ = true; }
};

TEST_F(MutualTlsServerTest, ClientsNeedACertificateFromTheClientCa) {
  EXPECT_TRUE(List(Trusting("ca", "client")).ok());
  EXPECT_EQ(List(Trusting("ca")).code(), absl::StatusCode::kUnavailable)
      << "a client without a certificate must be refused";
  EXPECT_EQ(List(Trusting("ca", "intruder")).code(), absl::StatusCode::kUnavailable)
      << "a client certificate from another CA must be refused";
}

class SessionIdentityFromCertificateTest : public MutualTlsServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = MutualTlsServerTest::Options();
    options.demo_layer = false;
    options.access.session_identity_from_client_certificate = true;
    return options;
  }
};

TEST_F(SessionIdentityFromCertificateTest, ASessionIsItsCertificatesIdentitysAlone) {
  client::AttentionClient alice(Target(), Trusting("ca", "alice"));
  client::AttentionClient bob(Target(), Trusting("ca", "bob"));
  const v1::CreateSessionRequest request =
      OneLayerSessionRequest(/*num_heads=*/1, /*reserved_tokens=*/8);
  const absl::StatusOr<v1::SessionInfo> session = alice.CreateSession(request);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_TRUE(alice.GetSession(session->session_id()).ok());
  const absl::Status refused = bob.GetSession(session->session_id()).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_NE(refused.message().find("another identity than \"bob\""), std::string::npos) << refused;
  const std::optional<client::SessionRefusal> refusal = client::SessionRefusalOf(refused);
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->reason, "SESSION_OF_ANOTHER_IDENTITY");
}

TEST(TlsOptionsTest, MisconfigurationsFailStartUp) {
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.tls.cert_file = "/nonexistent/server.pem";
  EXPECT_EQ(AttentionServer::Start(options).status().message(),
            "tls_cert_file and tls_key_file go together: give both or neither");
  options.tls.key_file = "/nonexistent/server.key";
  const absl::Status missing = AttentionServer::Start(options).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(missing.message(), "cannot read /nonexistent/server.pem");
  options.tls = {};
  options.tls.client_ca_file = "/nonexistent/ca.pem";
  EXPECT_EQ(AttentionServer::Start(options).status().message(),
            "tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file");
  options.tls = {};
  options.access.session_identity_from_client_certificate = true;
  EXPECT_EQ(AttentionServer::Start(options).status().message(),
            "session_identity_from_client_certificate needs mutual TLS (tls_client_ca_file)");
  client::ClientOptions client_options;
  client_options.tls_ca_file = "/nonexistent/ca.pem";
  EXPECT_EQ(client::AttentionClient("127.0.0.1:1", client_options).ListLayers().status().message(),
            "cannot read /nonexistent/ca.pem");
}

}  // namespace
}  // namespace attention::server::testing

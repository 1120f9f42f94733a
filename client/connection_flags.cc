#include "client/connection_flags.h"

#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/strip.h"

ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA bundle that signed the server's certificate: connect with TLS; empty = "
          "plaintext");
ABSL_FLAG(std::string, tls_cert_file, "", "PEM client certificate chain, for mutual TLS");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_server_name, "",
          "name to check the server's certificate against, when not the target's host");
ABSL_FLAG(std::string, admin_token_file, "",
          "file holding the server's admin token, sent with layer management calls");
ABSL_FLAG(std::string, lb_policy, "pick_first",
          "gRPC load balancing over the addresses the target resolves to: pick_first (one "
          "connection) or round_robin (calls spread over all of them, e.g. with "
          "--target=dns:///attention-service-headless.NAMESPACE.svc.cluster.local:50051)");

namespace attention::client {

absl::StatusOr<ClientOptions> ClientOptionsFromFlags() {
  ClientOptions options;
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  options.lb_policy = absl::GetFlag(FLAGS_lb_policy);
  if (options.lb_policy != "pick_first" && options.lb_policy != "round_robin") {
    return absl::InvalidArgumentError("--lb_policy=" + options.lb_policy.substr(0, 64) +
                                      ": use pick_first or round_robin");
  }
  if (const std::string path = absl::GetFlag(FLAGS_admin_token_file); !path.empty()) {
    std::ifstream file(path);
    if (!file) return absl::NotFoundError("cannot read " + path);
    std::stringstream contents;
    contents << file.rdbuf();
    options.admin_token = std::string(absl::StripAsciiWhitespace(contents.str()));
  }
  // Unreadable TLS files are reported now rather than at the first call.
  auto credentials = ChannelCredentials(options);
  if (!credentials.ok()) return credentials.status();
  return options;
}

}  // namespace attention::client

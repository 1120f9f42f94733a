// Transport security of the gRPC port: TLS, or mutual TLS when a client CA is given. The
// certificate files are watched and re-read (gRPC's file-watcher certificate provider), so
// a rotated certificate (cert-manager) is served without a restart.
#ifndef ATTENTION_SERVER_APP_TLS_H_
#define ATTENTION_SERVER_APP_TLS_H_

#include <memory>
#include <string>

#include <grpcpp/security/server_credentials.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attention::server {

struct TlsOptions {
  // PEM server certificate chain and private key; both empty = plaintext (the default).
  std::string cert_file;
  std::string key_file;
  // PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS).
  std::string client_ca_file;
  // How often the files are re-read. >= 1 s; default 10 s.
  absl::Duration reload_interval = absl::Seconds(10);

  bool enabled() const { return !cert_file.empty() || !key_file.empty(); }
  // INVALID_ARGUMENT when only one of cert and key is set, a client CA comes without them,
  // or the interval is below 1 s; NOT_FOUND naming a file that cannot be read.
  absl::Status Validate() const;
};

// Plaintext credentials without TLS, else TLS (or mTLS) watching the files.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsOptions& options);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_APP_TLS_H_

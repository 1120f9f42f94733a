#include "server/app/tls.h"

#include <fstream>

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/str_cat.h"

namespace attention::server {

absl::Status TlsOptions::Validate() const {
  if (cert_file.empty() != key_file.empty()) {
    return absl::InvalidArgumentError(
        "tls_cert_file and tls_key_file go together: give both or neither");
  }
  if (!client_ca_file.empty() && !enabled()) {
    return absl::InvalidArgumentError(
        "tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file");
  }
  if (reload_interval < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tls_reload_interval = ", absl::FormatDuration(reload_interval), " must be >= 1s"));
  }
  for (const std::string* file : {&cert_file, &key_file, &client_ca_file}) {
    if (!file->empty() && !std::ifstream(*file).good()) {
      return absl::NotFoundError(absl::StrCat("cannot read ", *file));
    }
  }
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsOptions& options) {
  if (!options.enabled()) return grpc::InsecureServerCredentials();
  const auto seconds = static_cast<unsigned int>(absl::ToInt64Seconds(options.reload_interval));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      options.key_file, options.cert_file, options.client_ca_file, seconds);
  grpc::experimental::TlsServerCredentialsOptions tls(provider);
  tls.watch_identity_key_cert_pairs();
  if (options.client_ca_file.empty()) {
    tls.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    tls.watch_root_certs();
    tls.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(tls);
}

}  // namespace attention::server

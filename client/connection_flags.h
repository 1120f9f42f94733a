// The connection flags attention-cli and attention-loadgen share: TLS, load balancing and
// the admin token.
#ifndef ATTENTION_CLIENT_CONNECTION_FLAGS_H_
#define ATTENTION_CLIENT_CONNECTION_FLAGS_H_

#include "absl/status/statusor.h"
#include "client/attention_client.h"

namespace attention::client {

// ClientOptions from --tls_ca_file, --tls_cert_file, --tls_key_file, --tls_server_name,
// --lb_policy and --admin_token_file (its contents, whitespace stripped). NOT_FOUND for an
// unreadable file; INVALID_ARGUMENT for an --lb_policy other than pick_first or round_robin.
absl::StatusOr<ClientOptions> ClientOptionsFromFlags();

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_CONNECTION_FLAGS_H_

// Who may do what on the native API: the admin token of layer management, and the
// credentials that make KV-cache sessions an identity's own (issue 38).
#ifndef ATTENTION_SERVER_NATIVE_ACCESS_POLICY_H_
#define ATTENTION_SERVER_NATIVE_ACCESS_POLICY_H_

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/server_context.h"
#include "server/sessions/session_table.h"

namespace attention::server {

// Tokens (admin and session ones) are at least this long, so that they cannot be guessed.
inline constexpr size_t kMinTokenBytes = 16;

// One data-plane credential: the bearer token a caller sends, and the identity it names.
struct SessionToken {
  std::string identity;
  std::string token;
};

// Who may do what (issue 13's restricted management, as Triton's restricted protocols).
struct AccessPolicy {
  // When non-empty, LoadLayer, UnloadLayer and InspectCheckpoint need "authorization: Bearer
  // <admin_token>" metadata: UNAUTHENTICATED without it, PERMISSION_DENIED for another token.
  std::string admin_token;
  // Whether MultiHeadAttention may carry an inline_layer (built per request); when not,
  // such requests are PERMISSION_DENIED.
  bool allow_inline_layers = true;
  // Whether ListSessions answers on a server without an admin token: it hands out every
  // live id, the only key to a session. With a token it needs the token either way.
  bool allow_list_sessions = false;
  // Session credentials (--session_tokens_file): with any, every session call needs
  // "authorization: Bearer <token>" of one of them, and a session is its creator's identity's.
  std::vector<SessionToken> session_tokens;
  // Or the client certificate's identity under mutual TLS
  // (--session_identity_from_client_certificate): its first subject alternative name, else
  // its common name.
  bool session_identity_from_client_certificate = false;

  // Whether session calls need a credential.
  bool SessionsNeedCredentials() const {
    return !session_tokens.empty() || session_identity_from_client_certificate;
  }
};

// Who makes a session call.
struct SessionCaller {
  // The identity its credential names; "" on a server without session credentials, where
  // every session is everyone's (as the id is the only key).
  std::string identity;
  // The admin token: every session, and no per-identity limits.
  bool admin = false;
};

// The call's "authorization: Bearer <token>": nullopt without that metadata,
// UNAUTHENTICATED when it is not of that form.
absl::StatusOr<std::optional<absl::string_view>> BearerToken(
    const grpc::ServerContextBase& context);

// OK when `access` has no admin token or the call sends it; else UNAUTHENTICATED (no
// token; the message says the server restricts `what`) or PERMISSION_DENIED (another one).
absl::Status CheckAdminToken(const grpc::ServerContextBase& context, const AccessPolicy& access,
                             absl::string_view method, absl::string_view what);

// The caller of a session call named `method`: UNAUTHENTICATED (CREDENTIAL_MISSING or
// CREDENTIAL_UNKNOWN) where the server needs a credential and the call has none it knows;
// on a server that needs none, anyone (the admin token still names the admin).
absl::StatusOr<SessionCaller> IdentifySessionCaller(const grpc::ServerContextBase& context,
                                                    const AccessPolicy& access,
                                                    absl::string_view method);
// PERMISSION_DENIED (SESSION_OF_ANOTHER_IDENTITY) unless `caller` may use `session`.
absl::Status CheckSessionOwner(const SessionCaller& caller, const SessionInfo& session);

// Parses --session_tokens_file: one "IDENTITY TOKEN" per line; blank lines and lines
// starting with '#' are skipped. Identities are 1-128 characters of [A-Za-z0-9._@:-],
// tokens at least kMinTokenBytes, and no token appears twice.
absl::StatusOr<std::vector<SessionToken>> ParseSessionTokens(absl::string_view text);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_NATIVE_ACCESS_POLICY_H_

#include "server/native/access_policy.h"

#include <algorithm>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"
#include "server/validation/request_validation.h"

namespace attention::server {
namespace {

constexpr size_t kMaxIdentityChars = 128;

bool IsIdentityChar(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '@' ||
         c == ':' || c == '-';
}

// A certificate's identity as an owner name: the first name gRPC gives (subject alternative
// name, else common name), bounded.
std::optional<std::string> CertificateIdentity(const grpc::ServerContextBase& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return std::nullopt;
  const std::vector<grpc::string_ref> names = auth->GetPeerIdentity();
  if (names.empty() || names.front().empty()) return std::nullopt;
  const grpc::string_ref& name = names.front();
  return std::string(name.data(), std::min(name.size(), kMaxIdentityChars));
}

}  // namespace

absl::Status CheckAdminToken(const grpc::ServerContextBase& context, const AccessPolicy& access,
                             absl::string_view method, absl::string_view what) {
  if (access.admin_token.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const std::optional<absl::string_view> token, BearerToken(context));
  if (!token.has_value()) {
    return absl::UnauthenticatedError(
        absl::StrCat(method,
                     " needs \"authorization: Bearer <token>\" metadata: this server "
                     "restricts ",
                     what, " (--admin_token_file)"));
  }
  if (!ConstantTimeEquals(*token, access.admin_token)) {
    return absl::PermissionDeniedError(
        absl::StrCat(method, ": the bearer token is not this server's admin token"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<absl::string_view>> BearerToken(
    const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  const auto found = metadata.find("authorization");
  if (found == metadata.end()) return std::nullopt;
  absl::string_view token(found->second.data(), found->second.size());
  if (!absl::ConsumePrefix(&token, "Bearer ")) {
    return absl::UnauthenticatedError("the authorization metadata must be \"Bearer <token>\"");
  }
  return token;
}

absl::StatusOr<SessionCaller> IdentifySessionCaller(const grpc::ServerContextBase& context,
                                                    const AccessPolicy& access,
                                                    absl::string_view method) {
  // Another kind of authorization metadata is no credential, and no refusal where the
  // server needs none (session calls ignored it before credentials existed).
  const absl::StatusOr<std::optional<absl::string_view>> bearer = BearerToken(context);
  const std::optional<absl::string_view> token = bearer.ok() ? *bearer : std::nullopt;
  if (token.has_value() && !access.admin_token.empty() &&
      ConstantTimeEquals(*token, access.admin_token)) {
    return SessionCaller{"", /*admin=*/true};
  }
  if (!access.SessionsNeedCredentials()) return SessionCaller{};
  if (!bearer.ok()) return WithReason(bearer.status(), "CREDENTIAL_UNKNOWN");
  if (token.has_value() && !access.session_tokens.empty()) {
    // Every token is compared, so the time taken does not say which one matched.
    const SessionToken* match = nullptr;
    for (const SessionToken& known : access.session_tokens) {
      if (ConstantTimeEquals(*token, known.token)) match = &known;
    }
    if (match == nullptr) {
      return WithReason(absl::UnauthenticatedError(absl::StrCat(
                            method,
                            ": the bearer token is none of this server's session tokens "
                            "(--session_tokens_file)")),
                        "CREDENTIAL_UNKNOWN");
    }
    return SessionCaller{match->identity};
  }
  if (access.session_identity_from_client_certificate) {
    if (std::optional<std::string> identity = CertificateIdentity(context)) {
      return SessionCaller{*std::move(identity)};
    }
  }
  return WithReason(
      absl::UnauthenticatedError(absl::StrCat(
          method, " needs a credential on this server: ",
          access.session_tokens.empty() ? "" : "\"authorization: Bearer <token>\" metadata",
          access.session_tokens.empty() || !access.session_identity_from_client_certificate
              ? ""
              : " or ",
          access.session_identity_from_client_certificate ? "a client certificate" : "")),
      "CREDENTIAL_MISSING");
}

absl::Status CheckSessionOwner(const SessionCaller& caller, const SessionInfo& session) {
  if (caller.admin || caller.identity == session.owner) return absl::OkStatus();
  return WithReason(absl::PermissionDeniedError(absl::StrCat("session ", Quoted(session.id),
                                                             " belongs to another identity than ",
                                                             Quoted(caller.identity))),
                    "SESSION_OF_ANOTHER_IDENTITY");
}

absl::StatusOr<std::vector<SessionToken>> ParseSessionTokens(absl::string_view text) {
  std::vector<SessionToken> tokens;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    const std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (fields.size() != 2) {
      return Invalid("line ", line_number, " has ", fields.size(),
                     " fields; want \"IDENTITY TOKEN\"");
    }
    const absl::string_view identity = fields[0], token = fields[1];
    if (identity.size() > kMaxIdentityChars ||
        !std::all_of(identity.begin(), identity.end(), IsIdentityChar)) {
      return Invalid("line ", line_number, ": the identity must be 1-", kMaxIdentityChars,
                     " characters of [A-Za-z0-9._@:-]");
    }
    // The token itself is never echoed: it is a secret.
    if (token.size() < kMinTokenBytes) {
      return Invalid("line ", line_number, ": the token of ", Quoted(identity), " has ",
                     token.size(), " bytes; use at least ", kMinTokenBytes);
    }
    for (const SessionToken& known : tokens) {
      if (known.token == token) {
        return Invalid("line ", line_number, ": the token of ", Quoted(identity),
                       " is also the token of ", Quoted(known.identity));
      }
    }
    tokens.push_back(SessionToken{std::string(identity), std::string(token)});
  }
  if (tokens.empty()) return Invalid("no \"IDENTITY TOKEN\" line");
  return tokens;
}

}  // namespace attention::server

#include "client/attention_client.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>
#include <tuple>
#include <utility>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/hash.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace attention::client {
namespace {

// The server's reasons: ErrorInfo of this domain, kept on an absl::Status as a payload under
// the Any type URL (as the server's own WithReason does, so both read it alike).
constexpr char kErrorDomain[] = "attention-service";
constexpr char kErrorInfoType[] = "type.googleapis.com/google.rpc.ErrorInfo";

// The ErrorInfo of kErrorDomain in serialized google.rpc.ErrorInfo `bytes`, if it is one.
std::optional<google::rpc::ErrorInfo> OurErrorInfo(const std::string& bytes) {
  google::rpc::ErrorInfo info;
  if (!info.ParseFromString(bytes) || info.domain() != kErrorDomain || info.reason().empty()) {
    return std::nullopt;
  }
  return info;
}

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  absl::Status converted(static_cast<absl::StatusCode>(status.error_code()),
                         status.error_message());
  google::rpc::Status details;
  if (status.error_details().empty() || !details.ParseFromString(status.error_details())) {
    return converted;
  }
  for (const google::protobuf::Any& any : details.details()) {
    if (any.type_url() == kErrorInfoType && OurErrorInfo(any.value()).has_value()) {
      converted.SetPayload(kErrorInfoType, absl::Cord(any.value()));
    }
  }
  return converted;
}

// `status` with `message`, its code and payloads (the reason) kept.
absl::Status WithMessage(const absl::Status& status, absl::string_view message) {
  absl::Status renamed(status.code(), message);
  status.ForEachPayload([&renamed](absl::string_view type, const absl::Cord& payload) {
    renamed.SetPayload(type, payload);
  });
  return renamed;
}

// The replica a WRONG_REPLICA message names: `is held by replica "NAME"`, NAME a DNS label or
// pod name (session_table.cc); "" when absent or cut short by the server's quoting.
std::string HolderIn(absl::string_view message) {
  constexpr absl::string_view kHeldBy = "is held by replica \"";
  const size_t start = message.find(kHeldBy);
  if (start == absl::string_view::npos) return "";
  const absl::string_view rest = message.substr(start + kHeldBy.size());
  size_t end = 0;
  while (end < rest.size() && (absl::ascii_isalnum(rest[end]) || rest[end] == '-' ||
                               rest[end] == '.' || rest[end] == '_')) {
    ++end;
  }
  if (end == 0 || end == rest.size() || rest[end] != '"') return "";
  return std::string(rest.substr(0, end));
}

// The session and address a WRONG_REPLICA message names for a session a draining replica
// handed over: `session "ID" is held by replica "NAME" at "ADDRESS"`; empty when not.
std::pair<std::string, std::string> HandedOffIn(absl::string_view message) {
  constexpr absl::string_view kSession = "session \"", kAt = "\" at \"";
  const size_t id_start = message.find(kSession);
  if (id_start == absl::string_view::npos) return {};
  message.remove_prefix(id_start);
  const size_t id_end = message.find('"', kSession.size());
  const size_t at = message.find(kAt);
  if (id_end == absl::string_view::npos || at == absl::string_view::npos) return {};
  const size_t address_end = message.find('"', at + kAt.size());
  if (address_end == absl::string_view::npos) return {};
  return {std::string(message.substr(kSession.size(), id_end - kSession.size())),
          std::string(message.substr(at + kAt.size(), address_end - at - kAt.size()))};
}

const absl::Status& StatusOfResult(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& StatusOfResult(const absl::StatusOr<T>& result) {
  return result.status();
}

void SetDeadline(grpc::ClientContext& context, absl::Duration timeout) {
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
}

// Calls a unary stub method and returns its response or status; `channel_status` is why the
// channel could not be set up, if it could not.
template <typename Response, typename Request, typename Method>
absl::StatusOr<Response> Call(Method method, const Request& request, absl::Duration timeout,
                              const absl::Status& channel_status,
                              const std::string& bearer_token = "") {
  if (!channel_status.ok()) return channel_status;
  grpc::ClientContext context;
  SetDeadline(context, timeout);
  if (!bearer_token.empty()) context.AddMetadata("authorization", "Bearer " + bearer_token);
  Response response;
  const grpc::Status status = method(&context, request, &response);
  if (!status.ok()) return FromGrpc(status);
  return response;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError("cannot read " + path);
  std::stringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

// The default options (plaintext, no token) with `max_message_bytes` as the size limit.
ClientOptions PlaintextWithMessageLimit(int64_t max_message_bytes) {
  ClientOptions options;
  options.max_message_bytes = max_message_bytes;
  return options;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options) {
  if (options.tls_ca_file.empty()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  auto ca = ReadFile(options.tls_ca_file);
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *std::move(ca);
  if (!options.tls_cert_file.empty()) {
    auto cert = ReadFile(options.tls_cert_file);
    if (!cert.ok()) return cert.status();
    auto key = ReadFile(options.tls_key_file);
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *std::move(cert);
    ssl.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(ssl);
}

AttentionClient::AttentionClient(const std::string& target, int64_t max_message_bytes)
    : AttentionClient(target, PlaintextWithMessageLimit(max_message_bytes)) {}

// Session calls that are safe to repeat (a step names its positions; a read or truncation
// changes nothing twice) wait for the server through a restart or a rolling update, which
// keeps sessions with --session_snapshot_dir: a caller sees latency, not UNAVAILABLE.
// Create and fork are not repeated: a second attempt would make a second session. A server
// shutting down answers calls that reach it after its drain began CANCELLED; gRPC never
// repeats a call the caller cancelled itself.
constexpr char kSessionRetryServiceConfig[] = R"json({"methodConfig": [{
  "name": [{"service": "attention.v1.AttentionService", "method": "SessionStep"},
           {"service": "attention.v1.AttentionService", "method": "GetSession"},
           {"service": "attention.v1.AttentionService", "method": "TruncateSession"},
           {"service": "attention.v1.AttentionService", "method": "ListSessions"}],
  "waitForReady": true,
  "retryPolicy": {"maxAttempts": 5, "initialBackoff": "0.2s", "maxBackoff": "5s",
                  "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"]}}]})json";

grpc::ChannelArguments ChannelArgumentsFor(const ClientOptions& options) {
  grpc::ChannelArguments arguments;
  arguments.SetInt(GRPC_ARG_ENABLE_RETRIES, 1);
  arguments.SetServiceConfigJSON(kSessionRetryServiceConfig);
  // A restarted server is found within 5 s of listening again, not gRPC's 120 s.
  arguments.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 5000);
  arguments.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  arguments.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  if (!options.tls_server_name.empty()) {
    arguments.SetSslTargetNameOverride(options.tls_server_name);
  }
  if (!options.lb_policy.empty()) arguments.SetLoadBalancingPolicyName(options.lb_policy);
  return arguments;
}

AttentionClient::AttentionClient(const std::string& target, const ClientOptions& options)
    : admin_token_(options.admin_token),
      // The admin token reaches every session, where the client has no session token.
      session_token_(options.session_token.empty() ? options.admin_token : options.session_token),
      options_(options) {
  grpc::ChannelArguments arguments = ChannelArgumentsFor(options);
  auto credentials = ChannelCredentials(options);
  channel_status_ = credentials.status();
  // Unreadable TLS files: every call answers channel_status_, never plaintext.
  channel_ = grpc::CreateCustomChannel(
      target, credentials.ok() ? *credentials : grpc::InsecureChannelCredentials(), arguments);
  stub_ = v1::AttentionService::NewStub(channel_);
}

absl::StatusOr<v1::MultiHeadAttentionResponse> AttentionClient::MultiHeadAttention(
    const v1::MultiHeadAttentionRequest& request, absl::Duration timeout) {
  return Call<v1::MultiHeadAttentionResponse>(
      [this](auto* c, const auto& q, auto* r) { return stub_->MultiHeadAttention(c, q, r); },
      request, timeout, channel_status_);
}

absl::StatusOr<v1::ScaledDotProductAttentionResponse> AttentionClient::ScaledDotProductAttention(
    const v1::ScaledDotProductAttentionRequest& request, absl::Duration timeout) {
  return Call<v1::ScaledDotProductAttentionResponse>(
      [this](auto* c, const auto& q, auto* r) {
        return stub_->ScaledDotProductAttention(c, q, r);
      },
      request, timeout, channel_status_);
}

absl::StatusOr<v1::LayerInfo> AttentionClient::LoadLayer(const v1::LoadLayerRequest& request,
                                                         absl::Duration timeout) {
  auto response = Call<v1::LoadLayerResponse>(
      [this](auto* c, const auto& q, auto* r) { return stub_->LoadLayer(c, q, r); }, request,
      timeout, channel_status_, admin_token_);
  if (!response.ok()) return response.status();
  return response->layer();
}

absl::Status AttentionClient::UnloadLayer(const std::string& name, absl::Duration timeout) {
  v1::UnloadLayerRequest request;
  request.set_name(name);
  return Call<v1::UnloadLayerResponse>(
             [this](auto* c, const auto& q, auto* r) { return stub_->UnloadLayer(c, q, r); },
             request, timeout, channel_status_, admin_token_)
      .status();
}

absl::StatusOr<v1::InspectCheckpointResponse> AttentionClient::InspectCheckpoint(
    const v1::InspectCheckpointRequest& request, absl::Duration timeout) {
  return Call<v1::InspectCheckpointResponse>(
      [this](auto* c, const auto& q, auto* r) { return stub_->InspectCheckpoint(c, q, r); },
      request, timeout, channel_status_, admin_token_);
}

absl::StatusOr<std::vector<v1::LayerInfo>> AttentionClient::ListLayers(absl::Duration timeout) {
  auto response = Call<v1::ListLayersResponse>(
      [this](auto* c, const auto& q, auto* r) { return stub_->ListLayers(c, q, r); },
      v1::ListLayersRequest(), timeout, channel_status_);
  if (!response.ok()) return response.status();
  return std::vector<v1::LayerInfo>(response->layers().begin(), response->layers().end());
}

absl::StatusOr<v1::LayerInfo> AttentionClient::GetLayer(const std::string& name,
                                                        absl::Duration timeout) {
  v1::GetLayerRequest request;
  request.set_name(name);
  auto response = Call<v1::GetLayerResponse>(
      [this](auto* c, const auto& q, auto* r) { return stub_->GetLayer(c, q, r); }, request,
      timeout, channel_status_);
  if (!response.ok()) return response.status();
  return response->layer();
}

absl::StatusOr<bool> AttentionClient::IsServing(const std::string& service,
                                                absl::Duration timeout) {
  auto health = grpc::health::v1::Health::NewStub(channel_);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  auto response = Call<grpc::health::v1::HealthCheckResponse>(
      [&health](auto* c, const auto& q, auto* r) { return health->Check(c, q, r); }, request,
      timeout, channel_status_);
  if (!response.ok()) return response.status();
  return response->status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

void AttentionClient::PinSession(const std::string& session_id,
                                 const std::string& replica_address) {
  core::MutexLock lock(replicas_mu_);
  if (replica_address.empty()) {
    pinned_.erase(session_id);
  } else {
    pinned_[session_id] = replica_address;
  }
}

v1::AttentionService::Stub* AttentionClient::StubFor(const std::string& session_id) {
  core::MutexLock lock(replicas_mu_);
  const auto pinned = pinned_.find(session_id);
  if (pinned == pinned_.end()) return stub_.get();
  std::unique_ptr<v1::AttentionService::Stub>& stub = replica_stubs_[pinned->second];
  if (stub == nullptr) {
    // The replica's own channel: the target's credentials and limits, one address, so no
    // load-balancing policy.
    ClientOptions direct = options_;
    direct.lb_policy.clear();
    auto credentials = ChannelCredentials(direct);
    stub = v1::AttentionService::NewStub(grpc::CreateCustomChannel(
        pinned->second, credentials.ok() ? *credentials : grpc::InsecureChannelCredentials(),
        ChannelArgumentsFor(direct)));
  }
  return stub.get();
}

template <typename Result>
Result AttentionClient::FollowingHandoffs(int sessions, const std::function<Result()>& attempt) {
  absl::flat_hash_set<std::string> followed;
  while (true) {
    Result result = attempt();
    const std::optional<SessionRefusal> refusal = SessionRefusalOf(StatusOfResult(result));
    if (!refusal.has_value() || refusal->holder_address.empty() ||
        static_cast<int>(followed.size()) >= sessions ||
        !followed.insert(refusal->session_id).second) {
      return result;
    }
    PinSession(refusal->session_id, refusal->holder_address);
  }
}

absl::StatusOr<v1::SessionInfo> AttentionClient::CreateSession(
    const v1::CreateSessionRequest& request, absl::Duration timeout) {
  auto response = Call<v1::CreateSessionResponse>(
      [this](auto* c, const auto& q, auto* r) { return stub_->CreateSession(c, q, r); }, request,
      timeout, channel_status_, session_token_);
  if (!response.ok()) return response.status();
  Pin(response->session());
  return response->session();
}

absl::StatusOr<v1::SessionStepResponse> AttentionClient::SessionStep(
    const v1::SessionStepRequest& request, absl::Duration timeout) {
  return FollowingHandoffs<absl::StatusOr<v1::SessionStepResponse>>(
      request.entries_size(), [&] { return SessionStepOnce(request, timeout); });
}

absl::StatusOr<v1::SessionStepResponse> AttentionClient::SessionStepOnce(
    const v1::SessionStepRequest& request, absl::Duration timeout) {
  // Entries grouped by replica, in order of first appearance.
  std::vector<std::pair<v1::AttentionService::Stub*, std::vector<int>>> groups;
  for (int i = 0; i < request.entries_size(); ++i) {
    v1::AttentionService::Stub* stub = StubFor(request.entries(i).session_id());
    auto group = std::find_if(groups.begin(), groups.end(),
                              [stub](const auto& g) { return g.first == stub; });
    if (group == groups.end()) group = groups.insert(groups.end(), {stub, {}});
    group->second.push_back(i);
  }
  if (groups.size() <= 1) {
    v1::AttentionService::Stub* stub = groups.empty() ? stub_.get() : groups[0].first;
    return Call<v1::SessionStepResponse>(
        [stub](auto* c, const auto& q, auto* r) { return stub->SessionStep(c, q, r); }, request,
        timeout, channel_status_, session_token_);
  }
  v1::SessionStepResponse merged;
  merged.set_request_id(request.request_id());
  for (int i = 0; i < request.entries_size(); ++i) merged.add_results();
  for (const auto& group : groups) {
    v1::AttentionService::Stub* stub = group.first;
    const std::vector<int>& indices = group.second;
    v1::SessionStepRequest part = request;
    part.clear_entries();
    for (const int i : indices) *part.add_entries() = request.entries(i);
    auto answer = Call<v1::SessionStepResponse>(
        [stub](auto* c, const auto& q, auto* r) { return stub->SessionStep(c, q, r); }, part,
        timeout, channel_status_, session_token_);
    if (!answer.ok()) {
      return WithMessage(
          answer.status(),
          absl::StrCat("the step's entries on the replica of entries[", indices.front(), "] (",
                       indices.size(),
                       " entries, numbered among themselves): ", answer.status().message()));
    }
    for (size_t j = 0; j < indices.size(); ++j) {
      *merged.mutable_results(indices[j]) = std::move(*answer->mutable_results(j));
    }
  }
  return merged;
}

absl::StatusOr<v1::SessionInfo> AttentionClient::ForkSession(const v1::ForkSessionRequest& request,
                                                             absl::Duration timeout) {
  auto response = FollowingHandoffs<absl::StatusOr<v1::ForkSessionResponse>>(1, [&] {
    v1::AttentionService::Stub* stub = StubFor(request.session_id());
    return Call<v1::ForkSessionResponse>(
        [stub](auto* c, const auto& q, auto* r) { return stub->ForkSession(c, q, r); }, request,
        timeout, channel_status_, session_token_);
  });
  if (!response.ok()) return response.status();
  Pin(response->session());
  return response->session();
}

absl::StatusOr<v1::SessionInfo> AttentionClient::TruncateSession(const std::string& session_id,
                                                                 int64_t tokens,
                                                                 absl::Duration timeout) {
  v1::TruncateSessionRequest request;
  request.set_session_id(session_id);
  request.set_tokens(tokens);
  auto response = FollowingHandoffs<absl::StatusOr<v1::TruncateSessionResponse>>(1, [&] {
    v1::AttentionService::Stub* stub = StubFor(session_id);
    return Call<v1::TruncateSessionResponse>(
        [stub](auto* c, const auto& q, auto* r) { return stub->TruncateSession(c, q, r); }, request,
        timeout, channel_status_, session_token_);
  });
  if (!response.ok()) return response.status();
  return response->session();
}

absl::Status AttentionClient::DropSession(const std::string& session_id, absl::Duration timeout) {
  v1::DropSessionRequest request;
  request.set_session_id(session_id);
  absl::Status status = FollowingHandoffs<absl::Status>(1, [&] {
    v1::AttentionService::Stub* stub = StubFor(session_id);
    return Call<v1::DropSessionResponse>(
               [stub](auto* c, const auto& q, auto* r) { return stub->DropSession(c, q, r); },
               request, timeout, channel_status_, session_token_)
        .status();
  });
  if (status.ok()) PinSession(session_id, "");
  return status;
}

absl::StatusOr<v1::SessionInfo> AttentionClient::GetSession(const std::string& session_id,
                                                            absl::Duration timeout) {
  v1::GetSessionRequest request;
  request.set_session_id(session_id);
  auto response = FollowingHandoffs<absl::StatusOr<v1::GetSessionResponse>>(1, [&] {
    v1::AttentionService::Stub* stub = StubFor(session_id);
    return Call<v1::GetSessionResponse>(
        [stub](auto* c, const auto& q, auto* r) { return stub->GetSession(c, q, r); }, request,
        timeout, channel_status_, session_token_);
  });
  if (!response.ok()) return response.status();
  return response->session();
}

std::optional<SessionRefusal> SessionRefusalOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kErrorInfoType);
  if (status.ok() || !payload.has_value()) return std::nullopt;
  const std::optional<google::rpc::ErrorInfo> info = OurErrorInfo(std::string(*payload));
  if (!info.has_value()) return std::nullopt;
  SessionRefusal refusal;
  refusal.reason = info->reason();
  if (refusal.reason == "WRONG_REPLICA") {
    refusal.holder = HolderIn(status.message());
    std::tie(refusal.session_id, refusal.holder_address) = HandedOffIn(status.message());
  }
  return refusal;
}

absl::Status StatusOf(const v1::SessionStepStreamResponse& answer) {
  if (answer.error_code() == 0) return absl::OkStatus();
  absl::Status status(static_cast<absl::StatusCode>(answer.error_code()), answer.error_message());
  if (!answer.error_reason().empty()) {
    google::rpc::ErrorInfo info;
    info.set_reason(answer.error_reason());
    info.set_domain(kErrorDomain);
    status.SetPayload(kErrorInfoType, absl::Cord(info.SerializeAsString()));
  }
  return status;
}

std::vector<std::string> SplitWords(const std::string& text) {
  std::istringstream stream(text);
  std::vector<std::string> words;
  for (std::string word; stream >> word;) words.push_back(word);
  return words;
}

std::vector<float> EmbedWords(const std::vector<std::string>& words, int64_t dim, uint64_t seed) {
  std::vector<float> embedding;
  embedding.reserve(words.size() * dim);
  for (const std::string& word : words) {
    uint64_t state = core::Mix64(seed ^ 0x5eed);
    for (unsigned char ch : word) state = core::Mix64(state ^ ch);
    for (int64_t e = 0; e < dim; ++e) {
      // Box-Muller on two uniforms from the word's counter stream.
      const double u1 = (static_cast<double>(core::Mix64(state + 2 * e) >> 11) + 0.5) * 0x1.0p-53;
      const double u2 = core::UnitInterval(core::Mix64(state + 2 * e + 1));
      embedding.push_back(
          static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2)));
    }
  }
  return embedding;
}

}  // namespace attention::client

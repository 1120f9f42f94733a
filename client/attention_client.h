// C++ client for attention.v1.AttentionService.
#ifndef ATTENTION_CLIENT_ATTENTION_CLIENT_H_
#define ATTENTION_CLIENT_ATTENTION_CLIENT_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "core/mutex.h"
#include "tensor_codec.h"

namespace attention::client {

struct ClientOptions {
  // Largest message sent or received, bytes; the server's default.
  int64_t max_message_bytes = wire::kDefaultMaxMessageBytes;
  // When non-empty, sent as "authorization: Bearer <admin_token>" with LoadLayer,
  // UnloadLayer and InspectCheckpoint (for a server started with --admin_token_file).
  std::string admin_token;
  // When non-empty, sent the same way with every session call (for a server started with
  // --session_tokens_file): the sessions this client creates are its identity's alone.
  // When empty, session calls carry admin_token, which reaches every session.
  std::string session_token;
  // TLS: the PEM CA bundle that signed the server's certificate; empty = plaintext. With
  // mutual TLS also this client's PEM certificate chain and key.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // The name checked against the server's certificate, when it differs from the target's
  // host (e.g. connecting by IP to a certificate for "localhost").
  std::string tls_server_name;
  // gRPC load-balancing policy: "round_robin" spreads calls over every address the target
  // resolves to (a headless Service's pods); empty = gRPC's default, pick_first.
  std::string lb_policy;
};

// The channel credentials `options` ask for: plaintext, TLS or mutual TLS. NOT_FOUND naming
// a file that cannot be read.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& options);

// The channel arguments `options` ask for: message size limits, the TLS name override and
// the load-balancing policy.
grpc::ChannelArguments ChannelArgumentsFor(const ClientOptions& options);

// A session call the server refused, as a program acts on it. The server names the reason in
// the gRPC status details (a google.rpc.ErrorInfo of domain "attention-service"); every
// method of AttentionClient keeps it on the absl::Status it returns, so read it here rather
// than from the message.
struct SessionRefusal {
  // "SESSION_EXPIRED", "SESSION_DROPPED", "SESSION_UNKNOWN", "WRONG_REPLICA", "MAX_SESSIONS",
  // "MAX_SESSION_TOKENS", "KV_POOL_EXHAUSTED", "POSITION_GAP", "POSITION_CONFLICT",
  // "PAST_RESERVATION", "PAST_LENGTH", "SESSION_BUSY", "SESSIONS_OFF", "CREDENTIAL_MISSING",
  // "CREDENTIAL_UNKNOWN", "SESSION_OF_ANOTHER_IDENTITY", "MAX_SESSIONS_PER_IDENTITY",
  // "MAX_RESERVED_TOKENS_PER_IDENTITY", or another the server
  // adds.
  std::string reason;
  // For WRONG_REPLICA, the replica that holds the session, as the server's message names it
  // ("" when the message does not: a name too long to quote whole); "" for other reasons.
  std::string holder;
  // For a session a draining replica handed to `holder`: its id and where the holder
  // answers (the client follows it); "" otherwise.
  std::string session_id, holder_address;
};

// The refusal `status` carries, or nullopt: OK, or an error the server gave no reason for
// (a malformed request, a deadline, an unreachable server).
std::optional<SessionRefusal> SessionRefusalOf(const absl::Status& status);

// A SessionStepStream answer's status (OK when error_code is 0), its error_reason carried as
// a unary call's is, so that SessionRefusalOf reads it.
absl::Status StatusOf(const v1::SessionStepStreamResponse& answer);

// Thread-safe: one client may serve many threads.
class AttentionClient {
 public:
  // `target` is a gRPC target such as "localhost:50051". Unreadable TLS files make every
  // call fail with the reason (see ChannelCredentials).
  explicit AttentionClient(const std::string& target,
                           int64_t max_message_bytes = wire::kDefaultMaxMessageBytes);
  AttentionClient(const std::string& target, const ClientOptions& options);

  absl::StatusOr<v1::MultiHeadAttentionResponse> MultiHeadAttention(
      const v1::MultiHeadAttentionRequest& request, absl::Duration timeout = absl::Seconds(30));
  absl::StatusOr<v1::ScaledDotProductAttentionResponse> ScaledDotProductAttention(
      const v1::ScaledDotProductAttentionRequest& request,
      absl::Duration timeout = absl::Seconds(30));
  absl::StatusOr<v1::LayerInfo> LoadLayer(const v1::LoadLayerRequest& request,
                                          absl::Duration timeout = absl::Seconds(60));
  absl::Status UnloadLayer(const std::string& name, absl::Duration timeout = absl::Seconds(10));
  absl::StatusOr<v1::InspectCheckpointResponse> InspectCheckpoint(
      const v1::InspectCheckpointRequest& request, absl::Duration timeout = absl::Seconds(30));
  absl::StatusOr<std::vector<v1::LayerInfo>> ListLayers(absl::Duration timeout = absl::Seconds(10));
  absl::StatusOr<v1::LayerInfo> GetLayer(const std::string& name,
                                         absl::Duration timeout = absl::Seconds(10));
  // grpc.health.v1 Check for `service` ("" = the whole server); true when SERVING.
  absl::StatusOr<bool> IsServing(const std::string& service = "",
                                 absl::Duration timeout = absl::Seconds(5));

  // KV-cache sessions. Sessions live in one replica's memory, so each session's calls go to
  // the replica_address its CreateSession or ForkSession answer gave, over a channel of that
  // replica's own (same credentials), whatever load balancer the target goes through. A
  // step with entries on several replicas is sent to each, its results kept in order. A
  // call answered WRONG_REPLICA naming where a draining replica handed its session
  // (--session_handoff_peer) is sent there, and the session's later calls too.
  absl::StatusOr<v1::SessionInfo> CreateSession(const v1::CreateSessionRequest& request,
                                                absl::Duration timeout = absl::Seconds(30));
  absl::StatusOr<v1::SessionStepResponse> SessionStep(const v1::SessionStepRequest& request,
                                                      absl::Duration timeout = absl::Seconds(30));
  absl::StatusOr<v1::SessionInfo> ForkSession(const v1::ForkSessionRequest& request,
                                              absl::Duration timeout = absl::Seconds(30));
  absl::StatusOr<v1::SessionInfo> TruncateSession(const std::string& session_id, int64_t tokens,
                                                  absl::Duration timeout = absl::Seconds(30));
  absl::Status DropSession(const std::string& session_id,
                           absl::Duration timeout = absl::Seconds(30));
  absl::StatusOr<v1::SessionInfo> GetSession(const std::string& session_id,
                                             absl::Duration timeout = absl::Seconds(30));
  // Sends `session_id`'s calls to `replica_address` (for a session another client
  // created; "" sends them to the target).
  void PinSession(const std::string& session_id, const std::string& replica_address);

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  absl::StatusOr<v1::SessionStepResponse> SessionStepOnce(const v1::SessionStepRequest& request,
                                                          absl::Duration timeout);
  // The stub for `session_id`'s replica: the target's unless the session is pinned.
  v1::AttentionService::Stub* StubFor(const std::string& session_id);
  void Pin(const v1::SessionInfo& session) {
    PinSession(session.session_id(), session.replica_address());
  }
  // Makes `attempt` again while it answers WRONG_REPLICA naming where a handed-off session
  // went, pinning that session there: once per session, for at most `sessions` of them.
  template <typename Result>
  Result FollowingHandoffs(int sessions, const std::function<Result()>& attempt);

  const std::string admin_token_;
  const std::string session_token_;
  const ClientOptions options_;
  absl::Status channel_status_;  // why the channel could not be set up
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  core::Mutex replicas_mu_;
  absl::flat_hash_map<std::string, std::string> pinned_ ABSL_GUARDED_BY(replicas_mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<v1::AttentionService::Stub>> replica_stubs_
      ABSL_GUARDED_BY(replicas_mu_);
};

// A deterministic stand-in for a trained token embedding (the seeds' randomly initialised
// nn.Embedding): each whitespace-separated word maps to `dim` values drawn from N(0, 1),
// seeded by the word and `seed`. Returns [number of words, dim], row-major.
std::vector<float> EmbedWords(const std::vector<std::string>& words, int64_t dim,
                              uint64_t seed = 0);
std::vector<std::string> SplitWords(const std::string& text);

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_ATTENTION_CLIENT_H_

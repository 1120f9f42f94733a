// The attention.v1.AttentionService implementation on gRPC's callback API. Handlers parse
// and validate on the gRPC thread, hand compute to the batcher and return; a batch worker
// finishes the call.
#ifndef ATTENTION_SERVER_NATIVE_ATTENTION_SERVICE_H_
#define ATTENTION_SERVER_NATIVE_ATTENTION_SERVICE_H_

#include <functional>
#include <optional>
#include <string>

#include "attention/v1/attention.grpc.pb.h"
#include "core/devices.h"
#include "server/batching/batcher.h"
#include "server/batching/loader_pool.h"
#include "server/models/inline_layer_cache.h"
#include "server/models/layer_registry.h"
#include "server/native/access_policy.h"
#include "server/observability/metrics.h"
#include "server/observability/request_log.h"
#include "server/rpc/call.h"
#include "server/sessions/session_table.h"
#include "server/validation/input_decoding.h"
#include "server/validation/request_validation.h"

namespace attention::server {

template <typename Request, typename StreamAnswer>
class StreamReactor;  // stream_reactor.cc
class MultiHeadAttentionStreamReactor;
class SessionStepStreamReactor;

// The call's deadline (infinite when the caller set none).
absl::Time Deadline(const grpc::CallbackServerContext* context);

// Thread-safe.
class AttentionServiceImpl final : public v1::AttentionService::CallbackService {
 public:
  // Requests past `budget` are refused before anything is allocated or queued. Layers are
  // placed on `devices` (`default_backend` unless LoadLayerRequest.device says otherwise);
  // inline layers and scaled dot-product attention run on `default_backend`. KV-cache
  // sessions are held in `sessions` (null: sessions are off).
  AttentionServiceImpl(LayerRegistry& registry, Batcher& batcher, Metrics& metrics, RequestLog& log,
                       const RequestBudget& budget, core::Devices& devices,
                       std::shared_ptr<const core::Backend> default_backend,
                       const AccessPolicy& access, LoaderPool& loader,
                       int64_t inline_layer_cache_bytes = kDefaultInlineLayerCacheBytes,
                       SessionTable* sessions = nullptr)
      : registry_(registry),
        batcher_(batcher),
        metrics_(metrics),
        log_(log),
        budget_(budget),
        devices_(devices),
        default_backend_(std::move(default_backend)),
        access_(access),
        loader_(loader),
        inline_cache_(inline_layer_cache_bytes, registry, &metrics),
        sessions_(sessions) {}

  // Sets the loaded-layer gauges from the registry.
  void RefreshLayerMetrics();
  // Where callers reach this replica (host:port), told in every SessionInfo so that a
  // client pins a session's calls to it; set once the listening port is known.
  void SetReplicaAddress(std::string address);
  // Sets the KV-cache gauges from the session table.
  void RefreshSessionMetrics();
  const InlineLayerCache& inline_layer_cache() const { return inline_cache_; }

  grpc::ServerUnaryReactor* MultiHeadAttention(grpc::CallbackServerContext* context,
                                               const v1::MultiHeadAttentionRequest* request,
                                               v1::MultiHeadAttentionResponse* response) override;
  grpc::ServerBidiReactor<v1::MultiHeadAttentionRequest, v1::MultiHeadAttentionStreamResponse>*
  MultiHeadAttentionStream(grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<v1::SessionStepRequest, v1::SessionStepStreamResponse>* SessionStepStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ScaledDotProductAttention(
      grpc::CallbackServerContext* context, const v1::ScaledDotProductAttentionRequest* request,
      v1::ScaledDotProductAttentionResponse* response) override;
  grpc::ServerUnaryReactor* LoadLayer(grpc::CallbackServerContext* context,
                                      const v1::LoadLayerRequest* request,
                                      v1::LoadLayerResponse* response) override;
  grpc::ServerUnaryReactor* UnloadLayer(grpc::CallbackServerContext* context,
                                        const v1::UnloadLayerRequest* request,
                                        v1::UnloadLayerResponse* response) override;
  grpc::ServerUnaryReactor* ListLayers(grpc::CallbackServerContext* context,
                                       const v1::ListLayersRequest* request,
                                       v1::ListLayersResponse* response) override;
  grpc::ServerUnaryReactor* GetLayer(grpc::CallbackServerContext* context,
                                     const v1::GetLayerRequest* request,
                                     v1::GetLayerResponse* response) override;
  grpc::ServerUnaryReactor* InspectCheckpoint(grpc::CallbackServerContext* context,
                                              const v1::InspectCheckpointRequest* request,
                                              v1::InspectCheckpointResponse* response) override;
  // KV-cache sessions (session_service.cc).
  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* context,
                                          const v1::CreateSessionRequest* request,
                                          v1::CreateSessionResponse* response) override;
  grpc::ServerUnaryReactor* SessionStep(grpc::CallbackServerContext* context,
                                        const v1::SessionStepRequest* request,
                                        v1::SessionStepResponse* response) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* context,
                                        const v1::ForkSessionRequest* request,
                                        v1::ForkSessionResponse* response) override;
  grpc::ServerUnaryReactor* TruncateSession(grpc::CallbackServerContext* context,
                                            const v1::TruncateSessionRequest* request,
                                            v1::TruncateSessionResponse* response) override;
  grpc::ServerUnaryReactor* DropSession(grpc::CallbackServerContext* context,
                                        const v1::DropSessionRequest* request,
                                        v1::DropSessionResponse* response) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* context,
                                       const v1::GetSessionRequest* request,
                                       v1::GetSessionResponse* response) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* context,
                                         const v1::ListSessionsRequest* request,
                                         v1::ListSessionsResponse* response) override;

  // In-process entry points: the gRPC handlers (unary and stream) and the request fuzzer
  // share them, so every path validates and completes alike.
  //
  // Validates `request` and queues it. When queued, `finish` is called exactly once, on a
  // batch worker, after `response` is filled (OK) or with the error; when this returns an
  // error, `finish` is never called.
  // With `borrow_inputs`, FLOAT32 inputs are read in place from `request`, which must then
  // outlive the call to `finish` (a unary call's request does; a stream reuses its own).
  // The layer is `resolved` when given (an inline layer looked up or built already, or the
  // model a KServe call named), else the one `request` names, or its inline layer from the
  // cache or built on the calling thread. Tensors in `on_gpu` (which must outlive the call
  // to `finish`) are read and written by that layer in its GPU's memory.
  absl::Status SubmitMultiHeadAttention(const v1::MultiHeadAttentionRequest& request,
                                        absl::Time deadline, std::function<bool()> is_cancelled,
                                        v1::MultiHeadAttentionResponse* response,
                                        std::function<void(const absl::Status&)> finish,
                                        bool borrow_inputs = false,
                                        std::shared_ptr<const LayerSnapshot> resolved = nullptr,
                                        const GpuTensors* on_gpu = nullptr);
  // The same for scaled dot-product attention.
  absl::Status SubmitScaledDotProductAttention(
      const v1::ScaledDotProductAttentionRequest& request, absl::Time deadline,
      std::function<bool()> is_cancelled, v1::ScaledDotProductAttentionResponse* response,
      std::function<void(const absl::Status&)> finish);
  // Validates a SessionStep and queues it as SubmitMultiHeadAttention does.
  absl::Status SubmitSessionStep(const v1::SessionStepRequest& request, const SessionCaller& caller,
                                 absl::Time deadline, std::function<bool()> is_cancelled,
                                 v1::SessionStepResponse* response,
                                 std::function<void(const absl::Status&)> finish);
  // Builds and publishes a layer, on the calling thread (the handler runs it on the loader
  // pool, after the admin check), and refreshes the layer gauges.
  absl::Status DoLoadLayer(const v1::LoadLayerRequest& request, v1::LoadLayerResponse* response);
  // Unpublishes a layer and refreshes the layer gauges.
  absl::Status DoUnloadLayer(const std::string& name);
  // Lists a checkpoint of the model repository, on the calling thread.
  absl::Status DoInspectCheckpoint(const v1::InspectCheckpointRequest& request,
                                   v1::InspectCheckpointResponse* response);

 private:
  template <typename Request, typename StreamAnswer>
  friend class StreamReactor;  // stream_reactor.cc
  friend class MultiHeadAttentionStreamReactor;
  friend class SessionStepStreamReactor;
  // The Open Inference Protocol's service shares the admin check and call starts.
  friend class InferenceServiceImpl;

  // FAILED_PRECONDITION when the server holds no sessions.
  absl::Status SessionsEnabled() const;
  // Answers a session call that completes on the gRPC thread: the known-fields and
  // sessions-on checks, who calls, then `handle`.
  template <typename Request>
  grpc::ServerUnaryReactor* AnswerSessionCall(
      grpc::CallbackServerContext* context, absl::string_view method, const Request& request,
      const std::function<absl::Status(const SessionCaller&)>& handle);
  // Whether `caller` may use session `id` (read without renewing its TTL).
  absl::Status CheckOwnsSession(const SessionCaller& caller, const std::string& id,
                                absl::Time now) const;
  // A unary call of `method` (a string literal) starting now.
  UnaryCall StartCall(grpc::CallbackServerContext* context, absl::string_view method);

  // Submits a request with its inline layer (null without one).
  using SubmitWithLayer = std::function<absl::Status(const v1::MultiHeadAttentionRequest&,
                                                     std::shared_ptr<const LayerSnapshot>)>;
  // Calls `submit` at once when the request has no inline layer or the cache holds it,
  // else after building the layer on the loader pool; `refused` answers a request refused
  // at any step. `request` must outlive the call, unless `copy_to_build` (a stream reuses
  // its request): then the build keeps a copy.
  void SubmitWithInlineLayer(const v1::MultiHeadAttentionRequest& request, absl::Time deadline,
                             std::function<bool()> is_cancelled, const SubmitWithLayer& submit,
                             const std::function<void(const absl::Status&)>& refused,
                             bool copy_to_build);
  // The layer of a request: `resolved` when given, else the one it names, or its inline
  // layer from the cache or built on this thread.
  absl::StatusOr<std::shared_ptr<const LayerSnapshot>> ResolveLayer(
      const v1::MultiHeadAttentionRequest& request, std::shared_ptr<const LayerSnapshot> resolved);
  // DoLoadLayer without the gauges.
  absl::Status PublishLayer(const v1::LoadLayerRequest& request, v1::LoadLayerResponse* response);
  // The checks of a MultiHeadAttention request that come before its layer is found.
  absl::Status CheckMultiHeadAttentionRequest(const v1::MultiHeadAttentionRequest& request) const;
  // A request's inline layer before any build: `cached` when the cache holds it, else
  // `key` (nullopt for layers that are never cached) to build it under.
  struct InlineLayerLookup {
    std::shared_ptr<const LayerSnapshot> cached;
    std::optional<std::string> key;
  };
  absl::StatusOr<InlineLayerLookup> LookUpInlineLayer(
      const v1::MultiHeadAttentionRequest& request);
  // Builds an inline layer (through the cache under `key`, when given), on this thread.
  absl::StatusOr<std::shared_ptr<const LayerSnapshot>> BuildInlineLayer(
      const v1::LayerSpec& spec, const std::optional<std::string>& key);
  // OK, or why the caller may not call the management RPC `method`.
  absl::Status CheckAdmin(const grpc::CallbackServerContext& context,
                          absl::string_view method) const;

  LayerRegistry& registry_;
  Batcher& batcher_;
  Metrics& metrics_;
  RequestLog& log_;
  const RequestBudget budget_;
  core::Devices& devices_;
  const std::shared_ptr<const core::Backend> default_backend_;
  const AccessPolicy access_;
  LoaderPool& loader_;
  InlineLayerCache inline_cache_;
  SessionTable* const sessions_;
  std::string ReplicaAddress() const;
  // Counts a refusal that carries a reason in attention_kv_session_refusals_total.
  void CountSessionRefusal(const absl::Status& status);
  mutable core::Mutex replica_address_mu_;
  std::string replica_address_ ABSL_GUARDED_BY(replica_address_mu_);
};

// Fills `info` from a snapshot.
void DescribeLayer(const LayerSnapshot& snapshot, const BatchLimits& server_limits,
                   v1::LayerInfo* info);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_NATIVE_ATTENTION_SERVICE_H_

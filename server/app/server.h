// The whole service in one object: compute pool, batcher, layer registry, gRPC server with
// health and reflection. main.cc and the in-process tests both start it through here.
#ifndef ATTENTION_SERVER_APP_SERVER_H_
#define ATTENTION_SERVER_APP_SERVER_H_

#include <atomic>
#include <condition_variable>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/devices.h"
#include "core/mutex.h"
#include "server/app/tls.h"
#include "server/batching/batcher.h"
#include "server/kserve/kserve_service.h"
#include "server/models/layer_registry.h"
#include "server/native/attention_service.h"
#include "server/native/session_handoff.h"
#include "server/observability/metrics.h"
#include "server/observability/request_log.h"
#include "server/validation/request_validation.h"

namespace attention::server {

// Name, shape and seed of the built-in demo layer (BERT-base attention, as seed 000).
inline constexpr char kDemoLayerName[] = "demo-bert-base";
inline constexpr int64_t kDemoEmbedDim = 768;
inline constexpr int64_t kDemoNumHeads = 12;
inline constexpr uint64_t kDemoSeed = 0;

struct ServerOptions {
  // host:port to listen on; port 0 picks a free port (see AttentionServer::port()).
  std::string listen_address = "0.0.0.0:50051";
  // host:port serving Prometheus /metrics; port 0 picks one; empty disables the endpoint.
  std::string metrics_address = "0.0.0.0:9464";
  // Compute threads of the CPU backend; 0 means one per hardware thread.
  int compute_threads = 0;
  // Where layers compute unless LoadLayerRequest.device says otherwise, and where scaled
  // dot-product attention runs: "auto" (the first GPU if one is visible, else the CPU),
  // "cpu", "cuda" or "cuda:N". A GPU that is not there fails Start with
  // FAILED_PRECONDITION.
  std::string device = "auto";
  BatcherOptions batcher;
  // Error lines and the sampled access log on stderr.
  RequestLogOptions request_log;
  // On Shutdown, how long health reports NOT_SERVING while calls are still accepted, so
  // load balancers and probes see the drain before the listener closes. >= 0; default 0.
  absl::Duration drain_delay = absl::ZeroDuration();
  // Per-connection limits (gRPC channel arguments):
  // Concurrent calls (HTTP/2 streams) on one connection. >= 1; default 1024, a layer's
  // default queue bound, so that one connection can still fill a queue and see it shed
  // (RESOURCE_EXHAUSTED) rather than wait in HTTP/2 flow control.
  int max_concurrent_streams = 1024;
  // Clients pinging more often than this (keepalive) are sent GOAWAY. > 0; default 10 s.
  absl::Duration keepalive_min_ping_interval = absl::Seconds(10);
  // A connection older than this is asked to go away (GOAWAY), so clients reconnect and
  // rebalance across replicas behind a Kubernetes Service; calls in flight then get
  // max_connection_age_grace to finish. Zero = no limit. >= 0; defaults 10 min and 30 s.
  absl::Duration max_connection_age = absl::Minutes(10);
  absl::Duration max_connection_age_grace = absl::Seconds(30);
  // Largest request metadata (headers) accepted, bytes. >= 1 KiB; default 16 KiB.
  int64_t max_metadata_bytes = 16 << 10;
  // Load kDemoLayerName with seeded weights at start-up (unless a persisted layer has its
  // name). Default off (--demo_layer): a server serves only what its operator loads.
  bool demo_layer = false;
  // Weight budget (--max_weight_bytes) and model repository (--model_repository).
  LayerRegistryOptions registry;
  // Layer builds (LoadLayer, inline layers) running at once on the loader pool; more wait
  // in its FIFO queue, within their deadlines. >= 1; default 2.
  int max_concurrent_loads = 2;
  // Builds that may wait for a loader thread; past it (or past batcher.max_queued_bytes,
  // which their request messages count against) they are RESOURCE_EXHAUSTED. >= 0;
  // default 256.
  int max_queued_loads = 256;
  // Host bytes of recently built inline layers kept for requests that send the same layer
  // again (counted against registry.max_weight_bytes). 0 disables the cache. >= 0;
  // default 256 MiB.
  int64_t inline_layer_cache_bytes = kDefaultInlineLayerCacheBytes;
  // KV-cache sessions: the pool (--kv_cache_bytes, 0 turns sessions off) and their limits
  // (--max_sessions, --max_session_tokens, --session_ttl, --max_session_ttl, --replica_name,
  // --max_sessions_per_identity, --max_session_tokens_per_identity).
  SessionTableOptions sessions;
  // Where sessions survive a restart (--session_snapshot_dir): Shutdown writes every live
  // session to <dir>/<replica or "sessions">.kvsnap once calls have drained, and Start
  // restores that file, then removes it. "" (default): sessions end with the process.
  std::string session_snapshot_dir;
  // Live handoff (--session_handoff_peer): on Shutdown, once the drain delay has passed, the
  // live sessions go to the peer replica at this address (plaintext gRPC; its
  // --accept_session_handoff), and this server keeps listening for
  // session_handoff_linger, answering the moved sessions' calls WRONG_REPLICA with the
  // peer's address, before it closes its port. Sessions the peer refuses stay here for the
  // snapshot. Needs replica_name and sessions. "" for none.
  std::string session_handoff_peer;
  absl::Duration session_handoff_linger = absl::Seconds(5);
  // Serve SessionHandoff (--accept_session_handoff): adopt a draining peer's sessions. Off
  // by default: whoever reaches the port may then add sessions (with the admin token
  // where there is one). Needs replica_name and sessions.
  bool accept_session_handoff = false;
  // How often a thread ends the sessions idle past their TTL and refreshes the session and
  // weight gauges (--session_sweep_interval), so both are true without a call coming. > 0;
  // default 1 s.
  absl::Duration session_sweep_interval = absl::Seconds(1);
  // Where the KV blocks of sessions live and their attention runs (--kv_cache_device): "cpu"
  // (default) or "cuda:N". Sessions over served layers still project on their layers'
  // device.
  std::string kv_cache_device = "cpu";
  // Where callers reach this replica, told in every SessionInfo (--replica_address): host or
  // host:port; without a port the listening port is added. "" tells nothing.
  std::string replica_address;
  // Largest request or response message, bytes. >= 1 MiB; default 64 MiB. Also the most a
  // KServe call may read from system shared memory.
  int64_t max_message_bytes = wire::kDefaultMaxMessageBytes;
  // Triton's system shared memory extension on the KServe endpoint
  // (--kserve_system_shared_memory): callers on this host register POSIX shared memory
  // regions and pass tensors through them instead of the message. Off by default: a caller
  // that may register regions can read and write any shared memory object this server can.
  bool kserve_system_shared_memory = false;
  // Triton's CUDA shared memory extension (--kserve_cuda_shared_memory): callers on this
  // host register GPU buffers they exported with cudaIpcGetMemHandle; inputs are copied from
  // them and outputs to them. Off by default, for the same reason.
  bool kserve_cuda_shared_memory = false;
  // Opens those buffers; unset, this process's GPUs (core::Devices::OpenIpcMemory). Tests
  // give a twin over host memory.
  kserve::DeviceMemoryOpener device_memory_opener;
  // TLS or mutual TLS on the gRPC port (--tls_cert_file, --tls_key_file,
  // --tls_client_ca_file); plaintext by default.
  TlsOptions tls;
  // Restricted layer management, inline layers and session credentials (--admin_token_file,
  // --allow_inline_layers, --session_tokens_file,
  // --session_identity_from_client_certificate).
  AccessPolicy access;
  // Offer the gRPC reflection service (--reflection); default on.
  bool reflection = true;
  // The CPU's kernels forced by flags (--bf16_kernels, --bf16_attention_kernels,
  // --float32_kernels); each unset one is the host's fastest, measured
  // (core/cpu/bf16_linear.h, core/cpu/attention_cpu.h, core/cpu/float32_linear.h).
  core::CpuKernelChoice cpu_kernels;
  // Per-request work and memory limits (--max_request_flops, --max_request_memory_bytes);
  // its max_response_bytes is ignored: answers are bounded by max_message_bytes.
  RequestBudget request_budget;

  absl::Status Validate() const;
  // request_budget with max_response_bytes = max_message_bytes.
  RequestBudget RequestBudgetWithMessageLimit() const;
};

// Thread-safe.
class AttentionServer {
 public:
  static absl::StatusOr<std::unique_ptr<AttentionServer>> Start(const ServerOptions& options);
  ~AttentionServer();  // Shutdown(absl::ZeroDuration())

  int port() const { return port_; }
  // The default device's backend ("cpu", "cuda:0").
  const core::Backend& default_backend() const { return *default_backend_; }
  const core::CpuBackend& cpu_backend() const { return *devices_->cpu(); }
  // Port of /metrics, 0 when disabled.
  int metrics_port() const { return metrics_.port(); }
  LayerRegistry& registry() { return registry_; }
  Metrics& metrics() { return metrics_; }
  LoaderPool& loader() { return loader_; }
  const InlineLayerCache& inline_layer_cache() const { return service_.inline_layer_cache(); }
  // Null when sessions are off.
  const SessionTable* sessions() const { return sessions_.get(); }
  SessionTable* sessions() { return sessions_.get(); }
  // The snapshot file of this replica's sessions; "" when snapshots are off.
  const std::string& session_snapshot_path() const { return session_snapshot_path_; }
  // Files skipped while loading persisted layers at start-up (also printed to stderr).
  const std::vector<std::string>& startup_problems() const { return startup_problems_; }

  // Health turns NOT_SERVING, new calls are refused, calls in flight get up to `grace` to
  // finish, then the batcher drains and stops. Idempotent.
  void Shutdown(absl::Duration grace);

 private:
  AttentionServer(const ServerOptions& options, std::unique_ptr<core::Devices> devices,
                  std::shared_ptr<const core::Backend> default_backend,
                  std::unique_ptr<SessionTable> sessions);

  // The sweeper thread: every `interval` until Shutdown, expires idle sessions and refreshes
  // the gauges they change.
  void SweepSessions(absl::Duration interval);
  // Restores the sessions of session_snapshot_path_, if there is one, and logs what came
  // back and what did not; a refused file is kept beside as <path>.refused.
  void RestoreSessions();
  // Writes the live sessions to session_snapshot_path_ and logs it (on Shutdown).
  void SnapshotSessions();
  // Hands the live sessions to session_handoff_peer_, logs it, and lingers (on Shutdown).
  void HandOffSessions(absl::Duration grace);

  const std::unique_ptr<core::Devices> devices_;
  const std::shared_ptr<const core::Backend> default_backend_;
  Metrics metrics_;
  RequestLog request_log_;
  const absl::Duration drain_delay_;
  Batcher batcher_;
  LayerRegistry registry_;
  LoaderPool loader_;
  const std::unique_ptr<SessionTable> sessions_;
  const std::string session_snapshot_path_;
  const std::string session_handoff_peer_, session_spool_dir_, admin_token_;
  const absl::Duration session_handoff_linger_;
  std::unique_ptr<SessionHandoffService> handoff_service_;  // with accept_session_handoff
  // Set once Start has restored the snapshot: a server that failed to start before then
  // must not overwrite a snapshot it never read.
  bool snapshot_on_shutdown_ = false;
  AttentionServiceImpl service_;
  // What the health service says, for the Open Inference Protocol's ServerReady.
  std::atomic<bool> ready_{false};
  InferenceServiceImpl kserve_service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::vector<std::string> startup_problems_;
  bool shut_down_ = false;
  core::Mutex sweep_mu_;  // see core/mutex.h
  std::condition_variable_any sweep_stop_;
  bool stop_sweeping_ ABSL_GUARDED_BY(sweep_mu_) = false;
  std::thread sweeper_;  // runs while sessions are on
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_APP_SERVER_H_

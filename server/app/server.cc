#include "server/app/server.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

#include <unistd.h>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/impl/server_builder_option.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "grpc/health/v1/health.pb.h"

namespace attention::server {
namespace {

constexpr char kServiceName[] = "attention.v1.AttentionService";

// Turns the reflection service on or off for one server. Linking gRPC's reflection library
// registers its plugin for every server of the process at static initialization, so "off"
// removes it and "on" adds it where it is missing.
class ReflectionOption final : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionOption(bool enabled) : enabled_(enabled) {}
  void UpdateArguments(grpc::ChannelArguments* /*arguments*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    const std::string name = grpc::reflection::ProtoServerReflectionPlugin().name();
    const auto is_reflection = [&name](const auto& plugin) { return plugin->name() == name; };
    const bool present = std::any_of(plugins->begin(), plugins->end(), is_reflection);
    if (!enabled_) {
      plugins->erase(std::remove_if(plugins->begin(), plugins->end(), is_reflection),
                     plugins->end());
    } else if (!present) {
      plugins->push_back(std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>());
    }
  }

 private:
  const bool enabled_;
};

// gRPC duration arguments are int milliseconds; longer durations are capped there.
int MillisecondsArgument(absl::Duration duration) {
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(duration), INT_MAX));
}

int ComputeThreads(int requested) {
  if (requested > 0) return requested;
  return std::max(1u, std::thread::hardware_concurrency());
}

// The session table, its KV blocks on --kv_cache_device, or null when sessions are off.
// `options` were validated with the server's.
absl::StatusOr<std::unique_ptr<SessionTable>> MakeSessionTable(const ServerOptions& options,
                                                               core::Devices& devices) {
  const SessionTableOptions& sessions = options.sessions;
  if (sessions.kv_cache_bytes == 0) return nullptr;
  absl::StatusOr<std::unique_ptr<core::kv_cache::KvStorage>> storage =
      devices.CreateKvStorage(options.kv_cache_device,
                              sessions.kv_cache_bytes / sessions.block_bytes, sessions.block_bytes);
  if (!storage.ok()) {
    return absl::Status(storage.status().code(),
                        absl::StrCat("--kv_cache_device: ", storage.status().message()));
  }
  return SessionTable::Create(sessions, *std::move(storage));
}

// `address` with `port` added when it names none ("10.0.0.7", "[fd00::7]").
std::string WithPort(const std::string& address, int port) {
  const bool bracketed = !address.empty() && address.front() == '[';
  const bool has_port = bracketed ? address.back() != ']' : address.find(':') != std::string::npos;
  return has_port ? address : absl::StrCat(address, ":", port);
}

// Where snapshots in transit between replicas are spooled: the snapshot directory, else
// the system's temporary one.
std::string SpoolDir(const ServerOptions& options) {
  if (!options.session_snapshot_dir.empty()) return options.session_snapshot_dir;
  const char* tmpdir = std::getenv("TMPDIR");
  return tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
}

// Where this replica's sessions are snapshot, or "" when snapshots are off.
std::string SnapshotPath(const ServerOptions& options) {
  if (options.session_snapshot_dir.empty() || options.sessions.kv_cache_bytes == 0) return "";
  const std::string& replica = options.sessions.replica;
  return absl::StrCat(options.session_snapshot_dir, "/", replica.empty() ? "sessions" : replica,
                      ".kvsnap");
}

// What opens CUDA shared memory regions' buffers: none when the extension is off.
kserve::DeviceMemoryOpener CudaMemoryOpener(const ServerOptions& options, core::Devices& devices) {
  if (!options.kserve_cuda_shared_memory) return nullptr;
  if (options.device_memory_opener != nullptr) return options.device_memory_opener;
  return [&devices](int64_t device, absl::string_view handle, uint64_t byte_size) {
    return devices.OpenIpcMemory(device, handle, byte_size);
  };
}

}  // namespace

absl::Status ServerOptions::Validate() const {
  if (compute_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute_threads = ", compute_threads, " must be >= 0"));
  }
  if (max_message_bytes < (1 << 20) || max_message_bytes > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_message_bytes = ", max_message_bytes, " must be in [1 MiB, 2 GiB)"));
  }
  if (max_concurrent_loads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_concurrent_loads = ", max_concurrent_loads, " must be >= 1"));
  }
  if (max_queued_loads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queued_loads = ", max_queued_loads, " must be >= 0"));
  }
  if (inline_layer_cache_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inline_layer_cache_bytes = ", inline_layer_cache_bytes, " must be >= 0 (0 = off)"));
  }
  if (max_concurrent_streams < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_concurrent_streams = ", max_concurrent_streams, " must be >= 1"));
  }
  if (keepalive_min_ping_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keepalive_min_ping_interval = ", absl::FormatDuration(keepalive_min_ping_interval),
        " must be > 0"));
  }
  for (auto [name, value] : {std::pair<const char*, absl::Duration>{"max_connection_age",
                                                                    max_connection_age},
                             {"max_connection_age_grace", max_connection_age_grace}}) {
    if (value < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " = ", absl::FormatDuration(value), " must be >= 0"));
    }
  }
  if (max_metadata_bytes < 1024 || max_metadata_bytes > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_metadata_bytes = ", max_metadata_bytes, " must be in [1 KiB, 2 GiB)"));
  }
  if (session_sweep_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session_sweep_interval = ", absl::FormatDuration(session_sweep_interval), " must be > 0"));
  }
  if (drain_delay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("drain_delay = ", absl::FormatDuration(drain_delay), " must be >= 0"));
  }
  // Found at start-up, not when a drain writes to it and its sessions are lost.
  if (!session_snapshot_dir.empty() && ::access(session_snapshot_dir.c_str(), W_OK | X_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_snapshot_dir = \"", session_snapshot_dir.substr(0, 256),
                     "\" is not a directory this server may write: ", std::strerror(errno)));
  }
  const bool sessions_on = sessions.kv_cache_bytes != 0;
  if ((!session_handoff_peer.empty() || accept_session_handoff) &&
      (sessions.replica.empty() || !sessions_on)) {
    return absl::InvalidArgumentError(
        "session_handoff_peer and accept_session_handoff need sessions (kv_cache_bytes > 0) "
        "and a replica_name: a peer holds another replica's sessions under their ids");
  }
  if (!session_handoff_peer.empty() && !tls.cert_file.empty()) {
    return absl::InvalidArgumentError(
        "session_handoff_peer sends over plaintext gRPC; it is not supported with TLS yet");
  }
  if (session_handoff_linger < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("session_handoff_linger = ", absl::FormatDuration(session_handoff_linger),
                     " must be >= 0"));
  }
  RETURN_IF_ERROR(RequestBudgetWithMessageLimit().Validate());
  RETURN_IF_ERROR(tls.Validate());
  if (access.session_identity_from_client_certificate && tls.client_ca_file.empty()) {
    return absl::InvalidArgumentError(
        "session_identity_from_client_certificate needs mutual TLS (tls_client_ca_file)");
  }
  RETURN_IF_ERROR(registry.Validate());
  RETURN_IF_ERROR(request_log.Validate());
  if (sessions.kv_cache_bytes != 0) RETURN_IF_ERROR(sessions.Validate());
  return batcher.Validate();
}

RequestBudget ServerOptions::RequestBudgetWithMessageLimit() const {
  RequestBudget budget = request_budget;
  budget.max_response_bytes = max_message_bytes;
  return budget;
}

AttentionServer::AttentionServer(const ServerOptions& options,
                                 std::unique_ptr<core::Devices> devices,
                                 std::shared_ptr<const core::Backend> default_backend,
                                 std::unique_ptr<SessionTable> sessions)
    : devices_(std::move(devices)),
      default_backend_(std::move(default_backend)),
      metrics_(default_backend_->name(), core::CpuBackend::BlasCore()),
      request_log_(options.request_log),
      drain_delay_(options.drain_delay),
      batcher_(options.batcher, &metrics_),
      loader_({options.max_concurrent_loads, options.max_queued_loads}, &batcher_, &metrics_),
      sessions_(std::move(sessions)),
      session_snapshot_path_(SnapshotPath(options)),
      session_handoff_peer_(options.session_handoff_peer),
      session_spool_dir_(SpoolDir(options)),
      admin_token_(options.access.admin_token),
      session_handoff_linger_(options.session_handoff_linger),
      service_(registry_, batcher_, metrics_, request_log_, options.RequestBudgetWithMessageLimit(),
               *devices_, default_backend_, options.access, loader_,
               options.inline_layer_cache_bytes, sessions_.get()),
      kserve_service_(service_, registry_, metrics_, loader_, ready_,
                      options.kserve_system_shared_memory, CudaMemoryOpener(options, *devices_),
                      static_cast<uint64_t>(options.max_message_bytes)) {}

absl::StatusOr<std::unique_ptr<AttentionServer>> AttentionServer::Start(
    const ServerOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  auto devices =
      std::make_unique<core::Devices>(ComputeThreads(options.compute_threads), options.cpu_kernels);
  absl::StatusOr<std::shared_ptr<const core::Backend>> default_backend =
      devices->Get(options.device);
  if (!default_backend.ok()) {
    return absl::Status(default_backend.status().code(),
                        absl::StrCat("--device: ", default_backend.status().message()));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SessionTable> sessions, MakeSessionTable(options, *devices));
  std::unique_ptr<AttentionServer> server(new AttentionServer(
      options, std::move(devices), *std::move(default_backend), std::move(sessions)));
  RETURN_IF_ERROR(server->registry_.Configure(options.registry));
  if (!options.metrics_address.empty()) {
    RETURN_IF_ERROR(server->metrics_.Expose(options.metrics_address));
  }
  grpc::EnableDefaultHealthCheckService(true);
  // gRPC's built-in health service carries no descriptor; naming the generated one links
  // it in, so reflection can describe grpc.health.v1.Health (grpcurl, Postman).
  grpc::health::v1::HealthCheckRequest::descriptor();
  grpc::ServerBuilder builder;
  builder.SetOption(std::make_unique<ReflectionOption>(options.reflection));
  builder.AddListeningPort(options.listen_address, ServerCredentials(options.tls),
                           &server->port_);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             MillisecondsArgument(options.keepalive_min_ping_interval));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  if (options.max_connection_age > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               MillisecondsArgument(options.max_connection_age));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                               MillisecondsArgument(options.max_connection_age_grace));
  }
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE,
                             static_cast<int>(options.max_metadata_bytes));
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(&server->service_);
  builder.RegisterService(&server->kserve_service_);
  if (options.accept_session_handoff) {
    server->handoff_service_ = std::make_unique<SessionHandoffService>(
        *server->sessions_, server->registry_, options.access, server->session_spool_dir_);
    builder.RegisterService(server->handoff_service_.get());
  }
  // Calls that arrive once the port opens find the sessions a snapshot holds restored, or
  // are told to retry (SESSION_RESTORING), never that their session is unknown.
  const bool restores = !server->session_snapshot_path_.empty() &&
                        access(server->session_snapshot_path_.c_str(), F_OK) == 0;
  if (restores) server->sessions_->SetRestoring(true);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("could not listen on ", options.listen_address, " (address in use?)"));
  }
  if (!options.replica_address.empty()) {
    server->service_.SetReplicaAddress(WithPort(options.replica_address, server->port_));
    if (server->handoff_service_ != nullptr) {
      server->handoff_service_->SetReplicaAddress(WithPort(options.replica_address, server->port_));
    }
  }
  // The port is open, but health says NOT_SERVING until every layer is loaded, so probes
  // and load balancers can tell "starting" from "down" during a long repository load.
  grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService();
  health->SetServingStatus(false);
  health->SetServingStatus(kServiceName, false);
  // Persisted layers load before the demo layer, so one persisted under its name wins.
  server->startup_problems_ = server->registry_.LoadPersisted(*server->devices_, server->default_backend_);
  if (options.demo_layer && !server->registry_.Get(kDemoLayerName).ok()) {
    core::MhaConfig config;
    config.embed_dim = kDemoEmbedDim;
    config.num_heads = kDemoNumHeads;
    ASSIGN_OR_RETURN(const core::MhaConfig resolved, core::MhaConfig::Resolve(config));
    ASSIGN_OR_RETURN(auto layer,
                     core::MhaLayer::Create(resolved, core::MhaWeights::Random(resolved, kDemoSeed),
                                            server->default_backend_));
    auto published = server->registry_.Publish(kDemoLayerName, std::move(layer));
    if (!published.ok()) {
      server->startup_problems_.push_back(absl::StrCat(
          "demo layer \"", kDemoLayerName, "\": ", published.status().message(), "; skipped"));
    }
  }
  for (const std::string& problem : server->startup_problems_) {
    std::cerr << "attention-service: " << problem << std::endl;
  }
  // After the layers, which restored sessions over served layers find by name.
  server->RestoreSessions();
  if (restores) server->sessions_->SetRestoring(false);
  server->service_.RefreshLayerMetrics();
  server->service_.RefreshSessionMetrics();
  health->SetServingStatus(true);
  health->SetServingStatus(kServiceName, true);
  server->ready_ = true;
  if (server->sessions_ != nullptr) {
    server->sweeper_ =
        std::thread(&AttentionServer::SweepSessions, server.get(), options.session_sweep_interval);
  }
  return server;
}

void AttentionServer::SweepSessions(absl::Duration interval) {
  core::MutexLock lock(sweep_mu_);
  while (!stop_sweeping_) {
    const auto next = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(interval);
    while (!stop_sweeping_ && std::chrono::steady_clock::now() < next) {
      sweep_stop_.wait_until(lock, next);
    }
    if (stop_sweeping_) break;
    sessions_->ExpireIdle(absl::Now());
    service_.RefreshSessionMetrics();
    // A session that ended may have let go of the last reference to a replaced layer.
    service_.RefreshLayerMetrics();
  }
}

AttentionServer::~AttentionServer() { Shutdown(absl::ZeroDuration()); }

void AttentionServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  if (sweeper_.joinable()) {
    {
      core::MutexLock lock(sweep_mu_);
      stop_sweeping_ = true;
    }
    sweep_stop_.notify_all();
    sweeper_.join();
  }
  if (server_ != nullptr) {
    server_->GetHealthCheckService()->SetServingStatus(false);
    ready_ = false;
    // Health Check and Watch answer NOT_SERVING while calls are still accepted.
    absl::SleepFor(drain_delay_);
    // The port stays open meanwhile, so moved sessions' callers learn where they went.
    if (!session_handoff_peer_.empty()) HandOffSessions(grace);
    // In-flight calls finish on batcher workers, which keep running until after this.
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
  }
  loader_.Shutdown();  // builds taken before the drain finish; their calls are answered
  batcher_.Shutdown();
  // Every step has ended: the snapshot holds what callers were answered.
  SnapshotSessions();
}

void AttentionServer::RestoreSessions() {
  if (session_snapshot_path_.empty()) return;
  // From here the table is what the file held, or all that is left of it.
  snapshot_on_shutdown_ = true;
  const std::string& path = session_snapshot_path_;
  if (access(path.c_str(), F_OK) != 0) {
    std::cerr << "attention-service: no session snapshot at " << path << "; starting empty"
              << std::endl;
    return;
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<SnapshotReport> restored = sessions_->RestoreSnapshot(
      path,
      [this](const std::string& name) -> absl::StatusOr<std::shared_ptr<const core::MhaLayer>> {
        ASSIGN_OR_RETURN(std::shared_ptr<const LayerSnapshot> loaded, registry_.Get(name));
        return loaded->layer;
      },
      absl::Now());
  if (!restored.ok()) {
    // Kept for a post-mortem, never read again: the next drain writes a new snapshot.
    const std::string refused = path + ".refused";
    std::rename(path.c_str(), refused.c_str());
    std::cerr << "attention-service: session snapshot " << path << " refused ("
              << absl::StatusCodeToString(restored.status().code()) << ": "
              << restored.status().message() << "); its sessions are lost, the file is kept as "
              << refused << std::endl;
    return;
  }
  // Restored once: a later start (after a SIGKILL) must not bring back older state.
  std::remove(path.c_str());
  std::cerr << "attention-service: restored " << restored->sessions << " sessions ("
            << restored->blocks << " KV blocks, " << restored->bytes << " bytes) from " << path
            << " in " << absl::FormatDuration(absl::Now() - start) << "; "
            << restored->refused_sessions << " left out" << std::endl;
  for (const std::string& refusal : restored->refused) {
    std::cerr << "attention-service: session " << refusal << "; left out" << std::endl;
  }
}

void AttentionServer::HandOffSessions(absl::Duration grace) {
  if (sessions_ == nullptr || sessions_->Counters().sessions == 0) return;
  const absl::Time start = absl::Now();
  absl::StatusOr<HandoffReport> handed = server::HandOffSessions(
      *sessions_, session_handoff_peer_,
      absl::StrCat(session_spool_dir_, "/", sessions_->replica(), ".handoff.kvsnap"), admin_token_,
      start + grace);
  if (!handed.ok()) {
    std::cerr << "attention-service: could not hand the sessions to " << session_handoff_peer_
              << " (" << absl::StatusCodeToString(handed.status().code()) << ": "
              << handed.status().message() << "); they stay for the snapshot" << std::endl;
    return;
  }
  std::cerr << "attention-service: handed " << handed->adopted << " of " << handed->sessions
            << " sessions (" << handed->bytes << " bytes) to replica \"" << handed->holder
            << "\" at " << handed->address << " in " << absl::FormatDuration(absl::Now() - start)
            << "; " << handed->refused_sessions << " refused stay for the snapshot" << std::endl;
  for (const std::string& refusal : handed->refused) {
    std::cerr << "attention-service: session " << refusal << "; stays" << std::endl;
  }
  // Callers in the middle of a decode learn the holder from their next call.
  absl::SleepFor(session_handoff_linger_);
}

void AttentionServer::SnapshotSessions() {
  if (!snapshot_on_shutdown_) return;
  const absl::Time start = absl::Now();
  absl::StatusOr<SnapshotReport> written =
      sessions_->WriteSnapshot(session_snapshot_path_, absl::Now());
  if (!written.ok()) {
    std::cerr << "attention-service: could not write the session snapshot "
              << session_snapshot_path_ << ": " << written.status().message()
              << "; its sessions are lost" << std::endl;
    return;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::cerr << "attention-service: wrote " << written->sessions << " sessions (" << written->blocks
            << " KV blocks, " << written->bytes << " bytes) to " << session_snapshot_path_ << " in "
            << absl::StrFormat("%.3f", seconds) << " s ("
            << absl::StrFormat("%.2f", seconds / (static_cast<double>(written->bytes) / (1 << 30)))
            << " s/GiB)" << std::endl;
}

}  // namespace attention::server

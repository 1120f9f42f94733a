// attention-service: the gRPC server binary. The only file with flags.
#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "attention_version.h"
#include "core/kv_cache/block_pool.h"
#include "core/status_macros.h"
#include "server/app/malloc_tuning.h"
#include "server/app/server.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051", "host:port to serve gRPC on; port 0 picks one");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "host:port for Prometheus /metrics; port 0 picks one; empty disables");
ABSL_FLAG(int, compute_threads, 0, "CPU compute threads; 0 = one per hardware thread");
ABSL_FLAG(std::string, device, "auto",
          "default device of layers and of scaled dot-product attention: auto (the first GPU "
          "if one is visible, else the CPU), cpu, cuda or cuda:N");
ABSL_FLAG(int, batch_workers, 2,
          "threads taking batches off the queue; two overlap one batch's encoding with "
          "another's compute");
// The batch and queue limits below (to --queue_timeout) are defaults; a layer may set its
// own at LoadLayer.
ABSL_FLAG(int64_t, max_batch_requests, 64, "most requests packed into one forward pass");
ABSL_FLAG(int64_t, max_batch_tokens, 16384, "most query tokens packed into one forward pass");
ABSL_FLAG(absl::Duration, max_queue_delay, absl::ZeroDuration(),
          "longest a request waits for a fuller batch, e.g. 2ms; 0 = run as soon as a worker "
          "is free");
ABSL_FLAG(int64_t, max_queue_requests, 1024,
          "queued requests of one layer beyond which new ones for it get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_queue_tokens, int64_t{1} << 20,
          "queued query tokens of one layer beyond which new requests for it get "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_queued_bytes, int64_t{256} << 20,
          "bytes all queued requests may hold together (inputs, buffers, answers); past it "
          "new requests get RESOURCE_EXHAUSTED, so a burst stays inside the memory limit");
ABSL_FLAG(absl::Duration, queue_timeout, absl::ZeroDuration(),
          "a request still queued this long is answered DEADLINE_EXCEEDED without being "
          "computed, e.g. 500ms; 0 = no limit beyond the caller's deadline");
ABSL_FLAG(absl::Duration, starvation_limit, absl::Milliseconds(100),
          "a request queued longer than this runs before younger ones of any priority");
ABSL_FLAG(bool, reject_non_finite, true,
          "refuse query, key, value and attn_mask tensors holding NaN or infinities (an "
          "additive mask may hold -inf) with INVALID_ARGUMENT naming the index");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate chain for TLS on the gRPC port (with --tls_key_file); empty = "
          "plaintext; re-read when it changes");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: clients must present a certificate it signed (mutual TLS)");
ABSL_FLAG(absl::Duration, tls_reload_interval, absl::Seconds(10),
          "how often the TLS files are checked for a rotated certificate");
ABSL_FLAG(std::string, admin_token_file, "",
          "file holding a bearer token, sent as 'authorization: Bearer <token>' metadata, that "
          "LoadLayer, UnloadLayer, InspectCheckpoint, ListSessions, AdoptSessions and KServe's "
          "RepositoryModelLoad and RepositoryModelUnload require, and that acts on any "
          "session; empty = those calls are open to every caller (ListSessions only with "
          "--allow_list_sessions)");
ABSL_FLAG(bool, allow_list_sessions, false,
          "answer ListSessions on a server without --admin_token_file (it hands out every "
          "live session id, the only key to a session)");
ABSL_FLAG(std::string, session_tokens_file, "",
          "file of 'IDENTITY TOKEN' lines: every session call must then send one of the tokens "
          "as 'authorization: Bearer <token>' metadata, and a session is its creator's "
          "identity's alone; empty = any caller with a session's id may use it");
ABSL_FLAG(bool, session_identity_from_client_certificate, false,
          "under mutual TLS (--tls_client_ca_file), a session call's identity is its client "
          "certificate's (first subject alternative name, else common name), as with "
          "--session_tokens_file");
ABSL_FLAG(int64_t, max_sessions_per_identity, 0,
          "live sessions one identity (--session_tokens_file, "
          "--session_identity_from_client_certificate) may hold, forks included; 0 = no limit");
ABSL_FLAG(int64_t, max_session_tokens_per_identity, 0,
          "tokens one identity's sessions may reserve in all; 0 = no limit");
ABSL_FLAG(bool, allow_inline_layers, true,
          "accept MultiHeadAttention requests carrying an inline_layer (built per request)");
ABSL_FLAG(bool, reflection, true, "offer the gRPC server reflection service");
ABSL_FLAG(bool, demo_layer, false,
          "load the seeded BERT-base-shaped layer 'demo-bert-base' at start-up (scripts/run-demo "
          "does); off by default, so a server serves only the layers its operator loads");
ABSL_FLAG(std::string, model_repository, "",
          "directory of safetensors checkpoints for LoadLayer and of persisted layers "
          "(persisted/<name>.safetensors, loaded at start-up); empty = none");
ABSL_FLAG(int64_t, max_weight_bytes, 0,
          "budget for the host memory of all loaded layers' weights, bytes (a CPU layer also "
          "holds a packed copy of its weights, about as large, which counts); a layer unloaded "
          "or replaced while sessions hold it still counts until the last of them ends; loads "
          "past it get RESOURCE_EXHAUSTED; 0 = unlimited");
ABSL_FLAG(int64_t, max_device_weight_bytes, 0,
          "budget for the weights held on each GPU, bytes; loads past it get "
          "RESOURCE_EXHAUSTED; 0 = the device's memory");
ABSL_FLAG(int64_t, max_message_bytes, attention::wire::kDefaultMaxMessageBytes,
          "largest gRPC message, bytes (also the most one KServe call reads from shared memory)");
ABSL_FLAG(bool, kserve_system_shared_memory, false,
          "let KServe callers on this host register POSIX shared memory regions (Triton's "
          "system shared memory extension) and pass tensors through them; such a caller can "
          "read and write any shared memory object this server can open");
ABSL_FLAG(bool, kserve_cuda_shared_memory, false,
          "let KServe callers on this host register GPU buffers they exported with "
          "cudaIpcGetMemHandle (Triton's CUDA shared memory extension) and pass tensors "
          "through them; such a caller can have this server read and write that memory");
ABSL_FLAG(int64_t, max_request_flops, attention::server::RequestBudget{}.max_request_flops,
          "most floating-point operations one request may ask for (projections plus "
          "attention); larger ones get RESOURCE_EXHAUSTED before they are queued");
ABSL_FLAG(int64_t, max_request_memory_bytes,
          attention::server::RequestBudget{}.max_request_memory_bytes,
          "most working memory one request's forward pass (or inline layer) may take, bytes; "
          "larger ones get RESOURCE_EXHAUSTED before anything is allocated");
ABSL_FLAG(int, max_concurrent_loads, 2,
          "layer builds (LoadLayer, inline layers) running at once on the loader threads; "
          "more wait in a FIFO queue (--max_queued_loads), each within its deadline");
ABSL_FLAG(int, max_queued_loads, 256,
          "layer builds that may wait for a loader thread; past it, or past "
          "--max_queued_bytes (their request messages count), they get RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, inline_layer_cache_bytes, attention::server::kDefaultInlineLayerCacheBytes,
          "host bytes of recently built inline layers kept, keyed by a SHA-256 of their "
          "config and weights, so the same inline layer is not built again; they count "
          "against --max_weight_bytes; 0 = no cache");
ABSL_FLAG(int64_t, kv_cache_bytes, int64_t{256} << 20,
          "bytes of the KV-cache pool of sessions (CreateSession), reserved at start-up in "
          "blocks of --kv_block_bytes and committed as sessions fill them; 0 turns sessions "
          "off");
ABSL_FLAG(int64_t, kv_block_bytes, attention::core::kv_cache::kDefaultBlockBytes,
          "bytes of one KV-cache block, which holds one layer's tokens of one session (a "
          "multiple of 64): a session holds at least one per layer, so small heads waste less "
          "with smaller blocks (16 forks of a 4096-token prefix of 2 KV heads of 64 dims in "
          "bf16 hold 1.5x their tokens at 256 KiB, 1.0x at 64 KiB)");
ABSL_FLAG(std::string, kv_cache_device, "cpu",
          "where the KV-cache pool lives and sessions' attention runs: cpu (host memory) or "
          "cuda:N (that GPU's memory, attended by the CUDA paged decode kernel)");
ABSL_FLAG(int64_t, max_sessions, 1024, "live KV-cache sessions at once");
ABSL_FLAG(int64_t, max_session_tokens, int64_t{128} << 10,
          "tokens one session may reserve (CreateSessionRequest.reserved_tokens)");
ABSL_FLAG(absl::Duration, session_ttl, absl::Minutes(10),
          "idle time after which a session expires, unless it asks for another ttl");
ABSL_FLAG(absl::Duration, max_session_ttl, absl::Hours(24), "longest ttl a session may ask for");
ABSL_FLAG(absl::Duration, session_sweep_interval, absl::Seconds(1),
          "how often idle sessions past their ttl are ended and the session gauges refreshed, "
          "whether or not a call comes");
ABSL_FLAG(std::string, bf16_kernels, "auto",
          "how BFLOAT16 layers multiply their projections on the CPU: auto (the fastest of this "
          "host's kernels, measured at start-up and logged), onednn (oneDNN's matmul: AMX "
          "tiles where the CPU has them), amx (this project's AMX tiles), avx512_bf16, or "
          "float32 (the bf16 values widened)");
ABSL_FLAG(std::string, bf16_attention_kernels, "auto",
          "how BFLOAT16 layers multiply attention's scores and values on the CPU: auto (the "
          "fastest of this host's kernels, measured at start-up and logged), amx (AMX tiles), "
          "avx512_bf16, or float32 (the bf16 values widened)");
ABSL_FLAG(std::string, float32_kernels, "auto",
          "how float32 layers project on the CPU, at every row count: auto (the faster of the "
          "two, measured at start-up and logged), own (this project's microkernel) or onednn "
          "(oneDNN's matmul in fixed blocks of 256 rows); pin one so that replicas agree bit "
          "for bit");
ABSL_FLAG(bool, shared_prefix_products, false,
          "forks of one prefix that step together attend the keys they share as two matrix "
          "products once they bring 64 query rows (2.3x faster over bf16 KV on an AMX Xeon, "
          "about even in float32), within the fidelity rule; a fork's answer then depends on "
          "which forks share its step. Off: every answer has the same bits alone or in any "
          "batch");
ABSL_FLAG(int64_t, prefill_chunk_tokens, 256,
          "a session step's attention runs in turns of at most this many query tokens per "
          "entry, so that other sessions' decode steps run between a long prefill's chunks");
ABSL_FLAG(std::string, replica_name, "",
          "prefix of session ids naming this replica (e.g. the pod name from the Downward "
          "API), so that callers pin a session's calls to the replica that holds it");
ABSL_FLAG(std::string, session_snapshot_dir, "",
          "where sessions survive a restart: on SIGTERM, once calls have drained, every live "
          "session is written to <dir>/<replica_name>.kvsnap, and the next server with this "
          "replica name restores it at start-up (a persistent volume; see the statefulset "
          "overlay). Empty: sessions end with the process");
ABSL_FLAG(std::string, session_handoff_peer, "",
          "on SIGTERM, after --drain_delay, hand every live session to the replica at this "
          "address (host:port, plaintext; it runs with --accept_session_handoff), then keep "
          "answering for --session_handoff_linger so callers learn where their sessions went; "
          "sessions it refuses stay for the snapshot. Empty: no handoff");
ABSL_FLAG(absl::Duration, session_handoff_linger, absl::Seconds(5),
          "after a handoff, how long the draining server still answers the moved sessions' "
          "calls (WRONG_REPLICA naming the peer and its address) before its port closes");
ABSL_FLAG(bool, accept_session_handoff, false,
          "adopt the sessions of draining peers (the SessionHandoff service). Off by default: "
          "whoever reaches the port may then add sessions (with --admin_token_file, only "
          "holders of the admin token)");
ABSL_FLAG(std::string, replica_address, "",
          "where callers reach this replica, told in every session's answer so that clients "
          "pin its calls here: host or host:port (without a port, the listening port), e.g. "
          "$(POD_IP) from the Downward API");
ABSL_FLAG(int, max_concurrent_streams, 1024, "concurrent calls (HTTP/2 streams) per connection");
ABSL_FLAG(absl::Duration, keepalive_min_ping_interval, absl::Seconds(10),
          "clients sending keepalive pings more often than this get GOAWAY");
ABSL_FLAG(absl::Duration, max_connection_age, absl::Minutes(10),
          "connections older than this are asked to reconnect (GOAWAY), so clients "
          "rebalance across replicas; 0 = never");
ABSL_FLAG(absl::Duration, max_connection_age_grace, absl::Seconds(30),
          "after max_connection_age, how long calls in flight may take");
ABSL_FLAG(int64_t, max_metadata_bytes, 16 << 10, "largest request metadata (headers), bytes");
ABSL_FLAG(double, shutdown_grace_seconds, 10.0,
          "on SIGTERM/SIGINT, how long calls in flight may take to finish");
ABSL_FLAG(absl::Duration, drain_delay, absl::ZeroDuration(),
          "on SIGTERM/SIGINT, how long health answers NOT_SERVING while calls are still "
          "accepted, before the listener closes (e.g. 5s behind a load balancer)");
ABSL_FLAG(bool, log_errors, true, "one stderr line for every call that fails");
ABSL_FLAG(double, access_log_sample, 0.0,
          "fraction of successful calls logged on stderr, in [0, 1]");
ABSL_FLAG(bool, log_json, false, "request log lines as JSON objects");

namespace {

pthread_t main_thread;

// Threads started before main() (OpenBLAS's pool, from a library constructor) do not block
// SIGINT/SIGTERM, and the kernel hands a process-directed signal to such a thread whenever
// the main thread is not inside sigwait(): during start-up, or a second signal while
// draining. Without a handler the default action then kills the process (exit 143); this
// one passes the signal on to the main thread, where it waits for sigwait() (or is ignored
// once the drain has begun). pthread_kill is async-signal-safe.
void ForwardToMainThread(int signal_number) { pthread_kill(main_thread, signal_number); }

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream contents;
  contents << file.rdbuf();
  return contents.str();
}

// The admin token: the file's contents without surrounding whitespace (a Kubernetes Secret
// or `echo` adds a newline), long enough that it cannot be guessed.
absl::StatusOr<std::string> ReadAdminToken(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string contents, ReadFile(path));
  const std::string token(absl::StripAsciiWhitespace(contents));
  if (token.size() < attention::server::kMinTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, " holds a token of ", token.size(),
                                                   " bytes; use at least ",
                                                   attention::server::kMinTokenBytes));
  }
  return token;
}

absl::StatusOr<std::vector<attention::server::SessionToken>> ReadSessionTokens(
    const std::string& path) {
  ASSIGN_OR_RETURN(const std::string contents, ReadFile(path));
  return attention::server::ParseSessionTokens(contents);
}

}  // namespace

int main(int argc, char** argv) {
  attention::server::KeepLargeBuffersInHeap(size_t{256} << 20);
  absl::SetProgramUsageMessage("Serves multi-head attention over gRPC (attention.v1).");
  attention::SetVersionFlagOutput("attention-server");
  absl::ParseCommandLine(argc, argv);
  // Start-up configuration, one line on stderr: every flag defined in this file, sorted.
  // (Filename() is __FILE__ with its leading slashes stripped.)
  std::vector<std::string> settings;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    const std::string file = flag->Filename();
    if (!file.empty() && absl::EndsWith(__FILE__, file)) {
      settings.push_back("--" + std::string(name) + "=" + flag->CurrentValue());
    }
  }
  std::sort(settings.begin(), settings.end());
  std::string config_line = "attention-service: starting with";
  for (const std::string& setting : settings) config_line += " " + setting;
  std::cerr << config_line << std::endl;

  // Block the stop signals in every thread; the main thread waits for them below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  main_thread = pthread_self();
  struct sigaction forward = {};
  forward.sa_handler = ForwardToMainThread;
  sigemptyset(&forward.sa_mask);
  sigaction(SIGINT, &forward, nullptr);
  sigaction(SIGTERM, &forward, nullptr);

  attention::server::ServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.metrics_address = absl::GetFlag(FLAGS_metrics_listen);
  options.compute_threads = absl::GetFlag(FLAGS_compute_threads);
  options.device = absl::GetFlag(FLAGS_device);
  options.batcher.num_workers = absl::GetFlag(FLAGS_batch_workers);
  options.batcher.limits.max_batch_requests = absl::GetFlag(FLAGS_max_batch_requests);
  options.batcher.limits.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.batcher.limits.max_queue_requests = absl::GetFlag(FLAGS_max_queue_requests);
  options.batcher.limits.max_queue_delay = absl::GetFlag(FLAGS_max_queue_delay);
  options.batcher.limits.max_queue_tokens = absl::GetFlag(FLAGS_max_queue_tokens);
  options.batcher.limits.queue_timeout = absl::GetFlag(FLAGS_queue_timeout);
  options.batcher.max_queued_bytes = absl::GetFlag(FLAGS_max_queued_bytes);
  options.batcher.starvation_limit = absl::GetFlag(FLAGS_starvation_limit);
  options.demo_layer = absl::GetFlag(FLAGS_demo_layer);
  options.registry.model_repository = absl::GetFlag(FLAGS_model_repository);
  options.registry.max_weight_bytes = absl::GetFlag(FLAGS_max_weight_bytes);
  options.registry.max_device_weight_bytes = absl::GetFlag(FLAGS_max_device_weight_bytes);
  options.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.kserve_system_shared_memory = absl::GetFlag(FLAGS_kserve_system_shared_memory);
  options.kserve_cuda_shared_memory = absl::GetFlag(FLAGS_kserve_cuda_shared_memory);
  options.request_budget.max_request_flops = absl::GetFlag(FLAGS_max_request_flops);
  options.request_budget.max_request_memory_bytes = absl::GetFlag(FLAGS_max_request_memory_bytes);
  options.request_budget.reject_non_finite = absl::GetFlag(FLAGS_reject_non_finite);
  options.drain_delay = absl::GetFlag(FLAGS_drain_delay);
  options.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  options.max_concurrent_loads = absl::GetFlag(FLAGS_max_concurrent_loads);
  options.max_queued_loads = absl::GetFlag(FLAGS_max_queued_loads);
  options.inline_layer_cache_bytes = absl::GetFlag(FLAGS_inline_layer_cache_bytes);
  options.sessions.kv_cache_bytes = absl::GetFlag(FLAGS_kv_cache_bytes);
  options.sessions.block_bytes = absl::GetFlag(FLAGS_kv_block_bytes);
  options.kv_cache_device = absl::GetFlag(FLAGS_kv_cache_device);
  options.sessions.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  options.sessions.max_session_tokens = absl::GetFlag(FLAGS_max_session_tokens);
  options.sessions.max_sessions_per_owner = absl::GetFlag(FLAGS_max_sessions_per_identity);
  options.sessions.max_reserved_tokens_per_owner =
      absl::GetFlag(FLAGS_max_session_tokens_per_identity);
  options.sessions.default_ttl = absl::GetFlag(FLAGS_session_ttl);
  options.sessions.max_ttl = absl::GetFlag(FLAGS_max_session_ttl);
  options.session_sweep_interval = absl::GetFlag(FLAGS_session_sweep_interval);
  options.sessions.prefill_chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk_tokens);
  if (const std::string kernels = absl::GetFlag(FLAGS_bf16_kernels); kernels != "auto") {
    const absl::StatusOr<attention::core::Bf16Projection> projection =
        attention::core::ParseBf16Projection(kernels);
    if (!projection.ok() || !attention::core::CpuSupports(*projection)) {
      std::cerr << "attention-service: --bf16_kernels: "
                << (projection.ok() ? "this CPU has no " + kernels + " instructions"
                                    : std::string(projection.status().message()))
                << std::endl;
      return 1;
    }
    options.cpu_kernels.bf16_projection = *projection;
  }
  if (const std::string kernels = absl::GetFlag(FLAGS_bf16_attention_kernels); kernels != "auto") {
    const absl::StatusOr<attention::core::Bf16Kernel> products =
        attention::core::ParseBf16Products(kernels);
    if (!products.ok() || !attention::core::CpuSupportsBf16Products(*products)) {
      std::cerr << "attention-service: --bf16_attention_kernels: "
                << (products.ok() ? "this CPU cannot run " + kernels
                                  : std::string(products.status().message()))
                << std::endl;
      return 1;
    }
    options.cpu_kernels.bf16_products = *products;
  }
  if (const std::string kernels = absl::GetFlag(FLAGS_float32_kernels); kernels != "auto") {
    const absl::StatusOr<attention::core::Float32Projection> projection =
        attention::core::ParseFloat32Projection(kernels);
    if (!projection.ok()) {
      std::cerr << "attention-service: --float32_kernels: " << projection.status().message()
                << std::endl;
      return 1;
    }
    options.cpu_kernels.float32_projection = *projection;
  }
  if (absl::GetFlag(FLAGS_shared_prefix_products)) {
    options.cpu_kernels.shared_prefixes = attention::core::SharedPrefixes::kAsProducts;
  }
  options.sessions.replica = absl::GetFlag(FLAGS_replica_name);
  options.session_snapshot_dir = absl::GetFlag(FLAGS_session_snapshot_dir);
  options.replica_address = absl::GetFlag(FLAGS_replica_address);
  options.session_handoff_peer = absl::GetFlag(FLAGS_session_handoff_peer);
  options.session_handoff_linger = absl::GetFlag(FLAGS_session_handoff_linger);
  options.accept_session_handoff = absl::GetFlag(FLAGS_accept_session_handoff);
  options.keepalive_min_ping_interval = absl::GetFlag(FLAGS_keepalive_min_ping_interval);
  options.max_connection_age = absl::GetFlag(FLAGS_max_connection_age);
  options.max_connection_age_grace = absl::GetFlag(FLAGS_max_connection_age_grace);
  options.max_metadata_bytes = absl::GetFlag(FLAGS_max_metadata_bytes);
  options.request_log.errors = absl::GetFlag(FLAGS_log_errors);
  options.request_log.access_sample = absl::GetFlag(FLAGS_access_log_sample);
  options.request_log.json = absl::GetFlag(FLAGS_log_json);

  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls.client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  options.tls.reload_interval = absl::GetFlag(FLAGS_tls_reload_interval);
  options.access.allow_inline_layers = absl::GetFlag(FLAGS_allow_inline_layers);
  options.access.allow_list_sessions = absl::GetFlag(FLAGS_allow_list_sessions);
  options.reflection = absl::GetFlag(FLAGS_reflection);
  if (const std::string path = absl::GetFlag(FLAGS_admin_token_file); !path.empty()) {
    auto token = ReadAdminToken(path);
    if (!token.ok()) {
      std::cerr << "attention-service: --admin_token_file: " << token.status() << std::endl;
      return 1;
    }
    options.access.admin_token = *std::move(token);
  }
  if (const std::string path = absl::GetFlag(FLAGS_session_tokens_file); !path.empty()) {
    auto tokens = ReadSessionTokens(path);
    if (!tokens.ok()) {
      std::cerr << "attention-service: --session_tokens_file " << path << ": " << tokens.status()
                << std::endl;
      return 1;
    }
    options.access.session_tokens = *std::move(tokens);
  }
  options.access.session_identity_from_client_certificate =
      absl::GetFlag(FLAGS_session_identity_from_client_certificate);
  auto server = attention::server::AttentionServer::Start(options);
  if (!server.ok()) {
    std::cerr << "attention-service: " << server.status() << std::endl;
    return 1;
  }
  std::cerr << "attention-service: default device " << (*server)->default_backend().name()
            << ", OpenBLAS core " << attention::core::CpuBackend::BlasCore()
            << ", float32 layers: " << (*server)->cpu_backend().Float32Path()
            << ", bfloat16 layers: " << (*server)->cpu_backend().Bf16Path() << std::endl;
  if (const attention::server::SessionTable* sessions = (*server)->sessions()) {
    const attention::core::kv_cache::KvPoolCounters pool = sessions->Counters().pool;
    // In tokens of a Llama-3-8B layer (8 KV heads of 128 dims, float32 K and V: 8 KiB).
    std::cerr << "attention-service: KV cache on " << sessions->device() << ", "
              << pool.blocks_total << " blocks of " << (sessions->block_bytes() >> 10) << " KiB, "
              << pool.blocks_total * sessions->block_bytes() / 8192
              << " tokens x layers at 8 KiB a token (8 KV heads x 128 dims, float32)" << std::endl;
  }
  // Scripts and tests read the port from this line.
  std::cout << "attention-service listening on port " << (*server)->port() << std::endl;
  if ((*server)->metrics_port() != 0) {
    std::cout << "attention-service metrics on port " << (*server)->metrics_port() << std::endl;
  }

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  std::cerr << "attention-service: signal " << signal_number << ", draining" << std::endl;
  (*server)->Shutdown(absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_seconds)));
  std::cerr << "attention-service: stopped" << std::endl;
  return 0;
}

// Prometheus metrics of the service: one registry, owned here, exposed on its own port.
// Naming follows Prometheus practice: attention_ prefix, base units (seconds), _total on
// counters, small fixed label sets (method, code, layer: a loaded layer's name, "(inline)"
// for one-off layers, or "(scaled_dot_product_attention)" for the queue of that RPC).
#ifndef ATTENTION_SERVER_OBSERVABILITY_METRICS_H_
#define ATTENTION_SERVER_OBSERVABILITY_METRICS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/mutex.h"

namespace attention::server {

// Thread-safe (prometheus-cpp metrics are atomic; families are created under its lock).
class Metrics {
 public:
  // attention_build_info names the server's default backend (`default_device`) and the
  // OpenBLAS kernel set (`blas_core`) its CPU backend runs.
  explicit Metrics(absl::string_view default_device = "cpu", absl::string_view blas_core = "");

  // Serves /metrics on `address` (host:port; port 0 picks one, see port()).
  absl::Status Expose(const std::string& address);
  int port() const { return port_; }
  prometheus::Registry& registry() { return *registry_; }

  // A call started / finished; code is the final gRPC status.
  void CallStarted();
  void CallFinished(absl::string_view method, absl::StatusCode code, absl::Duration elapsed);
  // A request left the queue after waiting `waited`.
  void Dequeued(absl::Duration waited);
  // One forward pass of `layer`'s queue (see WorkItem::queue_name in batcher.h) on `device` over
  // `requests` requests and `tokens` query tokens; by layer, so each layer's batching can
  // be tuned, and compute time also by device.
  void BatchComputed(absl::string_view layer, absl::string_view device, int64_t requests,
                     int64_t tokens, absl::Duration compute);
  void TokensProcessed(absl::string_view layer, int64_t tokens);
  // Requests waiting in one layer's queue (see WorkItem::queue_name in batcher.h).
  void SetQueueDepth(absl::string_view layer, int64_t requests);
  // The bound of one layer's queue (its max_queue_requests), so alerts can compare the
  // depth with it.
  void SetQueueCapacity(absl::string_view layer, int64_t requests);
  void SetLayers(int64_t count, int64_t weight_bytes);
  // A request's inline layer was found in the cache or built by a concurrent caller (`hit`),
  // or was built for it.
  void InlineLayerCacheLookup(bool hit);
  void SetInlineLayerCacheBytes(int64_t bytes);
  // Jobs waiting for a layer-build thread (the loader pool's queue).
  void SetLoaderQueueDepth(int64_t jobs);
  // KV-cache sessions now (gauges) and since start (the counters follow these totals).
  struct KvCacheSnapshot {
    int64_t sessions = 0;
    // The pool's bytes by state: "total", "held" (by sessions), "promised" (free, reserved
    // for sessions' growth), "shared" (held by more than one session: forks).
    int64_t total_bytes = 0, held_bytes = 0, promised_bytes = 0, shared_bytes = 0;
    int64_t written_tokens = 0, reserved_tokens = 0;  // of live sessions
    int64_t created = 0, forked = 0, dropped = 0, expired = 0;
    int64_t restored = 0;            // from a snapshot at start-up
    int64_t adopted = 0;             // from a draining peer
    int64_t handed_off = 0;          // to a peer while draining
    int64_t kv_bytes_read = 0;       // by the steps' kernels, a shared prefix once a step
    int64_t shared_blocks_read = 0;  // blocks of prefixes read once for a step's forks
    double step_compute_seconds = 0;
  };
  void SetKvCache(const KvCacheSnapshot& snapshot);
  // A session call refused with a machine-readable reason (server/common/status_util.h).
  void CountSessionRefusal(absl::string_view reason);
  // Memory of an accelerator: bytes in use (by this process and others) and in total.
  void SetDeviceMemory(absl::string_view device, int64_t used_bytes, int64_t total_bytes);
  // Attention calls on `device` since start that ran on `path` (Backend::AttentionCallsByPath).
  void SetAttentionCalls(absl::string_view device, absl::string_view path, int64_t total);

  // Cumulative counts and times of one layer's computed batches, for the Open Inference
  // Protocol's ModelStatistics (the Prometheus histograms hold the same by bucket).
  struct LayerStatistics {
    int64_t batches = 0;
    int64_t requests = 0;
    int64_t failed_requests = 0;
    absl::Duration queued;    // summed over requests: enqueue to the batch's start
    absl::Duration computed;  // summed over requests: the batch's compute time
    absl::Time last_batch = absl::InfinitePast();
  };
  // One batch of `requests` requests of `layer` that waited `queued` in all and computed for
  // `compute`; `ok` when the forward pass succeeded.
  void LayerBatchFinished(absl::string_view layer, int64_t requests, absl::Duration queued,
                          absl::Duration compute, bool ok);
  // By layer name.
  std::map<std::string, LayerStatistics> LayerStatisticsByName() const;

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& request_duration_;
  prometheus::Histogram& queue_duration_;
  prometheus::Family<prometheus::Histogram>& compute_duration_;
  prometheus::Family<prometheus::Histogram>& batch_requests_;
  prometheus::Family<prometheus::Histogram>& batch_tokens_;
  prometheus::Family<prometheus::Counter>& tokens_;
  prometheus::Family<prometheus::Gauge>& queue_depth_;
  prometheus::Family<prometheus::Gauge>& queue_capacity_;
  prometheus::Gauge& in_flight_;
  prometheus::Gauge& layers_loaded_;
  prometheus::Gauge& weight_bytes_;
  prometheus::Counter& inline_cache_hits_;
  prometheus::Counter& inline_cache_misses_;
  prometheus::Gauge& inline_cache_bytes_;
  prometheus::Gauge& loader_queue_depth_;
  prometheus::Gauge& kv_sessions_;
  prometheus::Family<prometheus::Gauge>& kv_cache_bytes_;
  prometheus::Family<prometheus::Gauge>& kv_session_tokens_;
  prometheus::Family<prometheus::Counter>& kv_session_events_;
  prometheus::Family<prometheus::Counter>& kv_session_refusals_;
  prometheus::Counter& kv_read_bytes_;
  prometheus::Counter& kv_shared_blocks_read_;
  prometheus::Counter& kv_step_compute_seconds_;
  core::Mutex totals_mutex_;  // counters follow their sources' totals one refresh at a time
  prometheus::Family<prometheus::Gauge>& device_memory_used_;
  prometheus::Family<prometheus::Gauge>& device_memory_total_;
  prometheus::Family<prometheus::Counter>& device_attention_calls_;
  mutable core::Mutex layer_statistics_mutex_;
  std::map<std::string, LayerStatistics> layer_statistics_
      ABSL_GUARDED_BY(layer_statistics_mutex_);
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_OBSERVABILITY_METRICS_H_

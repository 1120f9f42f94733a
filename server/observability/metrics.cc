#include "server/observability/metrics.h"

#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

// 100 us to ~26 s in factors of 2: resolves sub-millisecond calls and multi-second ones.
prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  prometheus::Histogram::BucketBoundaries buckets;
  for (double bound = 1e-4; bound < 30; bound *= 2) buckets.push_back(bound);
  return buckets;
}

prometheus::Histogram::BucketBoundaries PowersOfTwo(double largest) {
  prometheus::Histogram::BucketBoundaries buckets;
  for (double bound = 1; bound <= largest; bound *= 2) buckets.push_back(bound);
  return buckets;
}

// A counter that follows a source's running total: only ever raised to it, never set.
void FollowTotal(prometheus::Counter& counter, double total) {
  if (total > counter.Value()) counter.Increment(total - counter.Value());
}

}  // namespace

Metrics::Metrics(absl::string_view default_device, absl::string_view blas_core)
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(prometheus::BuildCounter()
                    .Name("attention_requests_total")
                    .Help("RPCs finished, by method and gRPC status code")
                    .Register(*registry_)),
      request_duration_(prometheus::BuildHistogram()
                            .Name("attention_request_duration_seconds")
                            .Help("Time from receiving an RPC to finishing it")
                            .Register(*registry_)),
      queue_duration_(prometheus::BuildHistogram()
                          .Name("attention_queue_duration_seconds")
                          .Help("Time requests wait in the batcher queue")
                          .Register(*registry_)
                          .Add({}, SecondsBuckets())),
      compute_duration_(prometheus::BuildHistogram()
                            .Name("attention_compute_duration_seconds")
                            .Help("Time of one batched forward pass, by layer and device")
                            .Register(*registry_)),
      batch_requests_(prometheus::BuildHistogram()
                          .Name("attention_batch_size_requests")
                          .Help("Requests packed into one forward pass, by layer")
                          .Register(*registry_)),
      batch_tokens_(prometheus::BuildHistogram()
                        .Name("attention_batch_size_tokens")
                        .Help("Query tokens packed into one forward pass, by layer")
                        .Register(*registry_)),
      tokens_(prometheus::BuildCounter()
                  .Name("attention_tokens_processed_total")
                  .Help("Query tokens computed, by loaded layer ((inline) for one-off layers)")
                  .Register(*registry_)),
      queue_depth_(prometheus::BuildGauge()
                       .Name("attention_queue_depth_requests")
                       .Help("Requests waiting in the batcher queue, by layer ((inline) for "
                             "one-off layers, (scaled_dot_product_attention) for that RPC)")
                       .Register(*registry_)),
      queue_capacity_(prometheus::BuildGauge()
                          .Name("attention_queue_capacity_requests")
                          .Help("Requests a layer's batcher queue holds before rejecting (its "
                                "max_queue_requests), by layer as the queue depth")
                          .Register(*registry_)),
      in_flight_(prometheus::BuildGauge()
                     .Name("attention_in_flight_requests")
                     .Help("RPCs received and not yet finished")
                     .Register(*registry_)
                     .Add({})),
      layers_loaded_(prometheus::BuildGauge()
                         .Name("attention_layers_loaded")
                         .Help("Layers in the registry")
                         .Register(*registry_)
                         .Add({})),
      weight_bytes_(prometheus::BuildGauge()
                        .Name("attention_layer_weight_bytes")
                        .Help("Bytes of weights held by loaded layers, and by unloaded or "
                              "replaced layers that sessions still hold")
                        .Register(*registry_)
                        .Add({})),
      inline_cache_hits_(prometheus::BuildCounter()
                             .Name("attention_inline_layer_cache_hits_total")
                             .Help("Requests whose inline layer was cached or built by a "
                                   "concurrent request of the same layer")
                             .Register(*registry_)
                             .Add({})),
      inline_cache_misses_(prometheus::BuildCounter()
                               .Name("attention_inline_layer_cache_misses_total")
                               .Help("Inline layers built (not found in the cache)")
                               .Register(*registry_)
                               .Add({})),
      inline_cache_bytes_(prometheus::BuildGauge()
                              .Name("attention_inline_layer_cache_bytes")
                              .Help("Host bytes of cached inline layers (they count against "
                                    "--max_weight_bytes)")
                              .Register(*registry_)
                              .Add({})),
      loader_queue_depth_(prometheus::BuildGauge()
                              .Name("attention_loader_queue_depth_jobs")
                              .Help("Layer builds (LoadLayer, inline layers) waiting for a "
                                    "loader thread")
                              .Register(*registry_)
                              .Add({})),
      kv_sessions_(prometheus::BuildGauge()
                       .Name("attention_kv_sessions")
                       .Help("Live KV-cache sessions")
                       .Register(*registry_)
                       .Add({})),
      kv_cache_bytes_(prometheus::BuildGauge()
                          .Name("attention_kv_cache_bytes")
                          .Help("KV-cache pool bytes by state: total, held by sessions, "
                                "promised to sessions' reservations, shared by forks")
                          .Register(*registry_)),
      kv_session_tokens_(prometheus::BuildGauge()
                             .Name("attention_kv_session_tokens")
                             .Help("Tokens of live KV-cache sessions by state: written (in "
                                   "every layer), reserved")
                             .Register(*registry_)),
      kv_session_events_(prometheus::BuildCounter()
                             .Name("attention_kv_session_events_total")
                             .Help("KV-cache sessions created, forked, dropped, expired, "
                                   "restored from a snapshot at start-up, adopted from a "
                                   "draining peer and handed off to one")
                             .Register(*registry_)),
      kv_session_refusals_(prometheus::BuildCounter()
                               .Name("attention_kv_session_refusals_total")
                               .Help("Session calls refused, by reason (as in the status "
                                     "details' google.rpc.ErrorInfo)")
                               .Register(*registry_)),
      kv_read_bytes_(prometheus::BuildCounter()
                         .Name("attention_kv_read_bytes_total")
                         .Help("Bytes of keys and values read by session steps, a prefix "
                               "that batched forks share once a step; over "
                               "attention_kv_step_compute_seconds_total, the achieved KV "
                               "read bandwidth")
                         .Register(*registry_)
                         .Add({})),
      kv_shared_blocks_read_(prometheus::BuildCounter()
                                 .Name("attention_kv_shared_blocks_read_total")
                                 .Help("KV blocks of prefixes that forks share, read once "
                                       "for all the forks a session step batched")
                                 .Register(*registry_)
                                 .Add({})),
      kv_step_compute_seconds_(prometheus::BuildCounter()
                                   .Name("attention_kv_step_compute_seconds_total")
                                   .Help("Time session steps spent in the decode kernel")
                                   .Register(*registry_)
                                   .Add({})),
      device_memory_used_(prometheus::BuildGauge()
                              .Name("attention_device_memory_used_bytes")
                              .Help("Memory in use on an accelerator (all processes), by device")
                              .Register(*registry_)),
      device_memory_total_(prometheus::BuildGauge()
                               .Name("attention_device_memory_total_bytes")
                               .Help("Memory of an accelerator, by device")
                               .Register(*registry_)),
      device_attention_calls_(
          prometheus::BuildCounter()
              .Name("attention_device_attention_calls_total")
              .Help("Attention calls on an accelerator by the path that ran them: cudnn "
                    "(cuDNN's fused SDPA) or kernels (this project's); session steps as "
                    "session_cudnn (cuDNN's paged SDPA) or session_kernels")
              .Register(*registry_)) {
  prometheus::BuildGauge()
      .Name("attention_build_info")
      .Help("Build information; the value is always 1")
      .Register(*registry_)
      .Add({{"version", ATTENTION_VERSION},
            {"backend", std::string(default_device)},
            {"blas_core", std::string(blas_core)}})
      .Set(1);
}

absl::Status Metrics::Expose(const std::string& address) {
  try {  // prometheus-cpp reports bind failures by exception; none escapes this function
    exposer_ = std::make_unique<prometheus::Exposer>(address);
  } catch (const std::exception& error) {
    return absl::UnavailableError(
        absl::StrCat("metrics: cannot listen on ", address, ": ", error.what()));
  }
  exposer_->RegisterCollectable(registry_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  port_ = ports.empty() ? 0 : ports.front();
  return absl::OkStatus();
}

void Metrics::CallStarted() { in_flight_.Increment(); }

void Metrics::CallFinished(absl::string_view method, absl::StatusCode code,
                           absl::Duration elapsed) {
  in_flight_.Decrement();
  const std::string method_name(method);
  requests_.Add({{"method", method_name}, {"code", absl::StatusCodeToString(code)}}).Increment();
  request_duration_.Add({{"method", method_name}}, SecondsBuckets())
      .Observe(absl::ToDoubleSeconds(elapsed));
}

void Metrics::Dequeued(absl::Duration waited) {
  queue_duration_.Observe(absl::ToDoubleSeconds(waited));
}

void Metrics::BatchComputed(absl::string_view layer, absl::string_view device, int64_t requests,
                            int64_t tokens, absl::Duration compute) {
  const prometheus::Labels labels = {{"layer", std::string(layer)}};
  batch_requests_.Add(labels, PowersOfTwo(1024)).Observe(static_cast<double>(requests));
  batch_tokens_.Add(labels, PowersOfTwo(1 << 20)).Observe(static_cast<double>(tokens));
  compute_duration_
      .Add({{"layer", std::string(layer)}, {"device", std::string(device)}}, SecondsBuckets())
      .Observe(absl::ToDoubleSeconds(compute));
}

void Metrics::TokensProcessed(absl::string_view layer, int64_t tokens) {
  tokens_.Add({{"layer", std::string(layer)}}).Increment(static_cast<double>(tokens));
}

void Metrics::SetQueueDepth(absl::string_view layer, int64_t requests) {
  queue_depth_.Add({{"layer", std::string(layer)}}).Set(static_cast<double>(requests));
}

void Metrics::SetQueueCapacity(absl::string_view layer, int64_t requests) {
  queue_capacity_.Add({{"layer", std::string(layer)}}).Set(static_cast<double>(requests));
}

void Metrics::SetLayers(int64_t count, int64_t weight_bytes) {
  layers_loaded_.Set(static_cast<double>(count));
  weight_bytes_.Set(static_cast<double>(weight_bytes));
}

void Metrics::InlineLayerCacheLookup(bool hit) {
  (hit ? inline_cache_hits_ : inline_cache_misses_).Increment();
}

void Metrics::SetInlineLayerCacheBytes(int64_t bytes) {
  inline_cache_bytes_.Set(static_cast<double>(bytes));
}

void Metrics::SetKvCache(const KvCacheSnapshot& s) {
  kv_sessions_.Set(static_cast<double>(s.sessions));
  kv_cache_bytes_.Add({{"state", "total"}}).Set(static_cast<double>(s.total_bytes));
  kv_cache_bytes_.Add({{"state", "held"}}).Set(static_cast<double>(s.held_bytes));
  kv_cache_bytes_.Add({{"state", "promised"}}).Set(static_cast<double>(s.promised_bytes));
  kv_cache_bytes_.Add({{"state", "shared"}}).Set(static_cast<double>(s.shared_bytes));
  kv_session_tokens_.Add({{"state", "written"}}).Set(static_cast<double>(s.written_tokens));
  kv_session_tokens_.Add({{"state", "reserved"}}).Set(static_cast<double>(s.reserved_tokens));
  core::MutexLock lock(totals_mutex_);
  FollowTotal(kv_session_events_.Add({{"event", "created"}}), static_cast<double>(s.created));
  FollowTotal(kv_session_events_.Add({{"event", "forked"}}), static_cast<double>(s.forked));
  FollowTotal(kv_session_events_.Add({{"event", "dropped"}}), static_cast<double>(s.dropped));
  FollowTotal(kv_session_events_.Add({{"event", "expired"}}), static_cast<double>(s.expired));
  FollowTotal(kv_session_events_.Add({{"event", "restored"}}), static_cast<double>(s.restored));
  FollowTotal(kv_session_events_.Add({{"event", "adopted"}}), static_cast<double>(s.adopted));
  FollowTotal(kv_session_events_.Add({{"event", "handed_off"}}), static_cast<double>(s.handed_off));
  FollowTotal(kv_read_bytes_, static_cast<double>(s.kv_bytes_read));
  FollowTotal(kv_shared_blocks_read_, static_cast<double>(s.shared_blocks_read));
  FollowTotal(kv_step_compute_seconds_, s.step_compute_seconds);
}

void Metrics::CountSessionRefusal(absl::string_view reason) {
  kv_session_refusals_.Add({{"reason", std::string(reason)}}).Increment();
}

void Metrics::SetLoaderQueueDepth(int64_t jobs) {
  loader_queue_depth_.Set(static_cast<double>(jobs));
}

void Metrics::SetDeviceMemory(absl::string_view device, int64_t used_bytes, int64_t total_bytes) {
  const prometheus::Labels labels = {{"device", std::string(device)}};
  device_memory_used_.Add(labels).Set(static_cast<double>(used_bytes));
  device_memory_total_.Add(labels).Set(static_cast<double>(total_bytes));
}

void Metrics::SetAttentionCalls(absl::string_view device, absl::string_view path, int64_t total) {
  core::MutexLock lock(totals_mutex_);
  FollowTotal(
      device_attention_calls_.Add({{"device", std::string(device)}, {"path", std::string(path)}}),
      static_cast<double>(total));
}

void Metrics::LayerBatchFinished(absl::string_view layer, int64_t requests, absl::Duration queued,
                                 absl::Duration compute, bool ok) {
  core::MutexLock lock(layer_statistics_mutex_);
  LayerStatistics& statistics = layer_statistics_[std::string(layer)];
  ++statistics.batches;
  statistics.requests += requests;
  if (!ok) statistics.failed_requests += requests;
  statistics.queued += queued;
  statistics.computed += compute * requests;
  statistics.last_batch = absl::Now();
}

std::map<std::string, Metrics::LayerStatistics> Metrics::LayerStatisticsByName() const {
  core::MutexLock lock(layer_statistics_mutex_);
  return layer_statistics_;
}

}  // namespace attention::server

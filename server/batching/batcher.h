// Dynamic batching: requests queue up and are packed, without padding, into one forward
// pass per layer. BatchQueue is the policy (no threads, time passed in, so tests drive it
// with a fake clock); Batcher runs it with worker threads and the real clock.
#ifndef ATTENTION_SERVER_BATCHING_BATCHER_H_
#define ATTENTION_SERVER_BATCHING_BATCHER_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/mha_layer.h"
#include "core/mutex.h"
#include "server/models/batch_limits.h"
#include "server/models/layer_registry.h"
#include "server/observability/metrics.h"

namespace attention::server {

struct BatcherOptions {
  // Every layer's batch and queue limits, except those a layer sets for itself
  // (LayerSnapshot::batching).
  BatchLimits limits;
  // Higher priorities run first, except that a request which has waited longer than this
  // goes ahead of every younger one whatever its priority, so low priorities never starve.
  // > 0; default 100 ms.
  absl::Duration starvation_limit = absl::Milliseconds(100);
  // Threads taking batches off the queue. Each batch uses the whole compute pool; a second
  // worker keeps the pool busy while the first gathers its inputs and encodes its answers
  // (measured back to back: +4-13% tokens/s with batching, +4-12% without; idle latency
  // unchanged), at the cost of up to two batches' scratch memory at once. >= 1; default 2.
  int num_workers = 2;
  // Bytes all queued requests of the server may hold together (their inputs and answers,
  // WorkItem::bytes); past it Submit answers RESOURCE_EXHAUSTED, whatever layer. The bound
  // that keeps a burst inside the pod's memory: the per-layer request and token bounds
  // alone would let 1024 long requests hold gigabytes. A request into an empty queue is
  // admitted whatever its size (RequestBudget bounds each one). >= 1; default 256 MiB.
  int64_t max_queued_bytes = int64_t{256} << 20;

  absl::Status Validate() const;
};

// The queues of work without a layer (see WorkItem::queue_name).
inline constexpr char kScaledDotProductAttentionQueue[] = "(scaled_dot_product_attention)";
inline constexpr char kSessionStepQueue[] = "(session_step)";

// One request waiting for compute, in the manner of TF Serving's BatchTask: the queue sees
// only what every kind of work shares (size, priority, deadline, answer); each kind says
// what it may share a batch with and how a batch of its kind runs. Multi-head attention
// through a layer is a LayerWorkItem; work that runs alone is a SoloWorkItem.
class WorkItem {
 public:
  virtual ~WorkItem() = default;

  // The layer whose limits the item counts against; null for work without a layer (the
  // server's limits).
  virtual const LayerSnapshot* layer() const = 0;
  // The queue the item counts against for the queue limits and metrics: its layer's name
  // ("(inline)" for inline layers), or its kind's for work without a layer.
  virtual std::string queue_name() const = 0;
  // Items with the same key may share a batch; null runs alone.
  virtual const void* batch_key() const = 0;
  // The device a batch of this item computes on, for the compute metrics.
  virtual std::string device() const = 0;
  // Computes `batch`: this item first, then others of its batch_key(). One result per
  // item, in order, or one error for the whole batch.
  virtual absl::StatusOr<std::vector<core::AttentionResult>> Compute(
      absl::Span<WorkItem* const> batch) = 0;

  // Query tokens, for the batch and queue token limits.
  int64_t tokens = 0;
  // Memory the item holds while queued and computing (inputs, the answer), for
  // BatcherOptions::max_queued_bytes.
  int64_t bytes = 0;
  // Higher runs first; equal priorities run in arrival order.
  int priority = 0;
  // Past this time the item is answered DEADLINE_EXCEEDED instead of computed.
  absl::Time deadline = absl::InfiniteFuture();
  // Polled before compute; true answers CANCELLED. May be empty.
  std::function<bool()> is_cancelled;
  // Set by the queue when the item arrives.
  absl::Time enqueued;
  // Called exactly once, on a worker thread, with the result or the reason there is none.
  std::function<void(absl::StatusOr<core::AttentionResult>)> done;
};

// Multi-head attention through a layer snapshot: packs with the other items of the same
// snapshot into one forward pass.
class LayerWorkItem final : public WorkItem {
 public:
  const LayerSnapshot* layer() const override { return snapshot.get(); }
  std::string queue_name() const override { return snapshot->name; }
  const void* batch_key() const override { return snapshot.get(); }
  std::string device() const override { return snapshot->layer->device(); }
  absl::StatusOr<std::vector<core::AttentionResult>> Compute(
      absl::Span<WorkItem* const> batch) override;

  std::shared_ptr<const LayerSnapshot> snapshot;
  // The input's spans point into `storage`, which the item owns.
  core::MhaInput input;
  std::vector<std::vector<float>> storage;
  std::vector<std::vector<uint16_t>> half_storage;  // 16-bit inputs kept for the device
};

// Work that runs alone, e.g. scaled dot-product attention, on `device_name`.
class SoloWorkItem final : public WorkItem {
 public:
  const LayerSnapshot* layer() const override { return nullptr; }
  std::string queue_name() const override { return kScaledDotProductAttentionQueue; }
  const void* batch_key() const override { return nullptr; }
  std::string device() const override { return device_name; }
  absl::StatusOr<std::vector<core::AttentionResult>> Compute(
      absl::Span<WorkItem* const> batch) override;

  std::function<absl::StatusOr<core::AttentionResult>()> run;
  std::string device_name;
};

// The batching policy: one queue per layer. Each layer has its own queue limits (the
// server's, or the layer's own: LayerSnapshot::batching), so a flood
// of calls to one layer never makes another layer's calls RESOURCE_EXHAUSTED, and its own
// batch timing, so a layer still waiting out max_queue_delay never holds back another
// layer's batch that is due. Requests pack only with requests of the same batch_key();
// work without one runs alone. Thread-compatible.
class BatchQueue {
 public:
  explicit BatchQueue(const BatcherOptions& options) : options_(options) {}

  // Queues `item` arriving at `now` (its deadline shortened to the layer's queue_timeout),
  // or returns RESOURCE_EXHAUSTED when its layer's queue is full (the item is then left
  // untouched).
  absl::Status Push(std::unique_ptr<WorkItem>& item, absl::Time now);

  // The batch due at `now`, removed from the queue, or an empty vector with *due set to
  // when the next batch will be due (InfiniteFuture when the queue is empty). Of several
  // due batches, the one led by the highest-ranked request runs: a starving request first,
  // then higher priority, then earlier arrival. `flush` closes batches regardless of the
  // delay (used when shutting down).
  std::vector<std::unique_ptr<WorkItem>> PopDue(absl::Time now, bool flush, absl::Time* due);

  // Counts `bytes` of a request waiting elsewhere (the loader pool's queue) against
  // max_queued_bytes, or returns RESOURCE_EXHAUSTED as Push would, naming `what` waits.
  // Admitted whatever its size when nothing else is held.
  absl::Status Reserve(int64_t bytes, absl::string_view what);
  void Release(int64_t bytes) { reserved_bytes_ -= bytes; }

  // Requests and query tokens waiting, in all queues.
  int64_t size() const { return static_cast<int64_t>(items_.size()); }
  int64_t tokens() const { return tokens_; }
  int64_t bytes() const { return bytes_; }
  int64_t reserved_bytes() const { return reserved_bytes_; }
  // Requests waiting in one layer's queue (see WorkItem::queue_name).
  int64_t size(const std::string& queue_name) const;
  // The limits a layer's requests are batched and queued under: the layer's own, else the
  // server's (also for work without a layer, `layer` null).
  BatchLimits LimitsFor(const LayerSnapshot* layer) const;

 private:
  using Iterator = std::list<std::unique_ptr<WorkItem>>::iterator;
  // How a request ranks for leading a batch, highest first; `arrival` breaks ties.
  struct Rank {
    bool starving;
    int priority;
    int64_t arrival;
    bool operator>(const Rank& other) const;
  };
  struct Usage {
    int64_t requests = 0;
    int64_t tokens = 0;
  };

  const BatcherOptions options_;
  std::list<std::unique_ptr<WorkItem>> items_;  // arrival order
  int64_t tokens_ = 0;
  int64_t bytes_ = 0;  // of all queues
  int64_t reserved_bytes_ = 0;  // of requests waiting outside the queues (Reserve)
  absl::flat_hash_map<std::string, Usage> usage_;  // by queue name; no zero entries
};

// Thread-safe.
class Batcher {
 public:
  // `options` must be valid; `metrics` (may be null) must outlive the batcher. Batches
  // compute through their items' Compute.
  explicit Batcher(const BatcherOptions& options, Metrics* metrics = nullptr);
  ~Batcher();  // Shutdown()

  // Queues the item, or returns RESOURCE_EXHAUSTED when the queue is full and UNAVAILABLE
  // after Shutdown(). On error `done` is not called.
  absl::Status Submit(std::unique_ptr<WorkItem> item);

  // Stops accepting work, finishes everything queued, joins the workers. Idempotent.
  void Shutdown();

  int64_t QueueDepth() const;
  // BatchQueue::Reserve and Release, for requests waiting outside the batcher, so that
  // every queue of the server shares one max_queued_bytes.
  absl::Status ReserveQueuedBytes(int64_t bytes, absl::string_view what);
  void ReleaseQueuedBytes(int64_t bytes);
  // The limits of layers that do not set their own.
  const BatchLimits& server_limits() const { return server_limits_; }

 private:
  void WorkerLoop();
  void Run(std::vector<std::unique_ptr<WorkItem>> batch);

  const BatchLimits server_limits_;
  Metrics* const metrics_;
  mutable core::Mutex mu_;  // see core/mutex.h
  std::condition_variable_any changed_;  // an arrival, or stopping
  BatchQueue queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_BATCHING_BATCHER_H_

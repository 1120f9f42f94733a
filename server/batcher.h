// Queues attention work and packs requests for the same layer into one forward pass.
#ifndef ATTENTION_SERVER_BATCHER_H_
#define ATTENTION_SERVER_BATCHER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/mha_layer.h"
#include "core/thread_pool.h"
#include "server/layer_registry.h"
#include "server/metrics.h"

namespace attention::server {

struct BatcherOptions {
  // Most requests packed into one forward pass. >= 1; default 64.
  int64_t max_batch_requests = 64;
  // Most query tokens (sum of B * Nq) packed into one forward pass; a larger request runs
  // alone. >= 1; default 16384.
  int64_t max_batch_tokens = 16384;
  // Queued requests beyond which Submit answers RESOURCE_EXHAUSTED. >= 1; default 1024.
  int64_t max_queue_requests = 1024;
  // Threads taking batches off the queue; each batch uses the whole compute pool, so more
  // than one only helps to overlap encoding with compute. >= 1; default 1.
  int num_workers = 1;

  absl::Status Validate() const;
};

// One request waiting for compute.
struct WorkItem {
  // For multi-head attention: the layer snapshot and the input, packable with other items
  // of the same snapshot. The input's spans point into `storage`, which the item owns.
  std::shared_ptr<const LayerSnapshot> layer;
  core::MhaInput input;
  std::vector<std::vector<float>> storage;
  // For work that runs alone (layer is null), e.g. scaled dot-product attention.
  std::function<core::AttentionResult(core::ThreadPool&)> run_alone;
  // Query tokens, for max_batch_tokens.
  int64_t tokens = 0;
  // Higher runs first; equal priorities run in arrival order.
  int priority = 0;
  // Past this time the item is answered DEADLINE_EXCEEDED instead of computed.
  absl::Time deadline = absl::InfiniteFuture();
  // Polled before compute; true answers CANCELLED. May be empty.
  std::function<bool()> is_cancelled;
  // Set by Submit.
  absl::Time enqueued;
  // Called exactly once, on a worker thread, with the result or the reason there is none.
  std::function<void(absl::StatusOr<core::AttentionResult>)> done;
};

// Thread-safe.
class Batcher {
 public:
  // `options` must be valid; `pool` and `metrics` (may be null) must outlive the batcher.
  Batcher(const BatcherOptions& options, core::ThreadPool& pool, Metrics* metrics = nullptr);
  ~Batcher();  // Shutdown()

  // Queues the item, or returns RESOURCE_EXHAUSTED when the queue is full and UNAVAILABLE
  // after Shutdown(). On error `done` is not called.
  absl::Status Submit(std::unique_ptr<WorkItem> item);

  // Stops accepting work, finishes everything queued, joins the workers. Idempotent.
  void Shutdown();

  int64_t QueueDepth() const;

 private:
  void WorkerLoop();
  // Removes and returns the next batch: the highest-priority item plus queued items of the
  // same layer snapshot up to the batch limits.
  std::vector<std::unique_ptr<WorkItem>> TakeBatchLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run(std::vector<std::unique_ptr<WorkItem>> batch);

  const BatcherOptions options_;
  core::ThreadPool& pool_;
  Metrics* const metrics_;
  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<WorkItem>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_BATCHER_H_

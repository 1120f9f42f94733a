// A few threads for work too slow for gRPC's callback threads: building layers (file I/O, up to
// gigabytes of initialisation). A bounded number of jobs run at once; past that, jobs wait their
// turn in a bounded FIFO queue, each until its caller's deadline. Only a full queue (its length, or
// the server's --max_queued_bytes) refuses a job at once.
#ifndef ATTENTION_SERVER_BATCHING_LOADER_POOL_H_
#define ATTENTION_SERVER_BATCHING_LOADER_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/mutex.h"
#include "server/batching/batcher.h"
#include "server/observability/metrics.h"

namespace attention::server {

struct LoaderPoolOptions {
  // Jobs running at once, one thread each (--max_concurrent_loads). >= 1; default 2.
  int max_jobs = 2;
  // Jobs waiting for a thread (--max_queued_loads); past it Submit answers
  // RESOURCE_EXHAUSTED. >= 0; default 256 (8 streams' worth of requests in flight).
  int max_queued_jobs = 256;
};

// One job: `work` runs on a pool thread, then `done` gets its result.
struct LoaderJob {
  std::function<absl::Status()> work;
  std::function<void(const absl::Status&)> done;
  // Memory the job holds while it waits (its request), counted against the batcher's
  // max_queued_bytes until it starts.
  int64_t bytes = 0;
  // A job still waiting at this time gets DEADLINE_EXCEEDED instead of running.
  absl::Time deadline = absl::InfiniteFuture();
  // Polled while the job waits; true drops it with CANCELLED. May be empty.
  std::function<bool()> is_cancelled;
};

// Thread-safe.
class LoaderPool {
 public:
  // `queued_bytes` (may be null: bytes not counted) and `metrics` (may be null) must outlive the
  // pool.
  explicit LoaderPool(const LoaderPoolOptions& options, Batcher* queued_bytes = nullptr,
                      Metrics* metrics = nullptr);
  explicit LoaderPool(int max_jobs) : LoaderPool(LoaderPoolOptions{max_jobs}) {}
  ~LoaderPool();  // Shutdown()

  // Queues `job`. OK: `done` is called exactly once, on a pool thread (or the thread of a later
  // Submit that finds the job expired): with work's result after its slot is freed, so a caller
  // told the result can submit again at once; DEADLINE_EXCEEDED or CANCELLED when it expired or was
  // cancelled while waiting (`work` then never runs). Otherwise `done` is never called:
  // RESOURCE_EXHAUSTED naming the bound when the queue is full (its length, or max_queued_bytes),
  // UNAVAILABLE after Shutdown.
  absl::Status Submit(LoaderJob job);

  // The RESOURCE_EXHAUSTED of a queue full by length.
  absl::Status QueueFull() const;

  // Finishes the jobs taken, then joins the threads. Idempotent.
  void Shutdown();

  int max_jobs() const { return options_.max_jobs; }
  int max_queued_jobs() const { return options_.max_queued_jobs; }
  // Jobs waiting for a thread.
  int queued() const;

 private:
  void WorkerLoop();
  // Moves the waiting jobs that are past their deadline or cancelled out of the queue (their bytes
  // released), for the caller to answer once mu_ is released.
  std::vector<LoaderJob> TakeExpiredLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers jobs taken by TakeExpiredLocked; called without mu_.
  static void AnswerExpired(const std::vector<LoaderJob>& expired, absl::Time now);

  const LoaderPoolOptions options_;
  Batcher* const queued_bytes_;
  Metrics* const metrics_;
  mutable core::Mutex mu_;  // see core/mutex.h
  std::condition_variable_any job_added_;
  std::deque<LoaderJob> jobs_ ABSL_GUARDED_BY(mu_);  // FIFO
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_BATCHING_LOADER_POOL_H_

// A fixed set of compute threads shared by every kernel of the process.
#ifndef ATTENTION_CORE_THREAD_POOL_H_
#define ATTENTION_CORE_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"

namespace attention::core {

// Thread-safe. Several callers may run ParallelFor at once; their items share the threads,
// so the process never runs more compute threads than `num_threads`.
//
// Thread budget: OpenBLAS is pinned to one thread per call (see Create) and every GEMM is
// split across this pool instead, so BLAS threads and pool threads never oversubscribe the
// cores. Callers block while the pool works and do no compute themselves.
class ThreadPool {
 public:
  // num_threads >= 1. Also sets OpenBLAS to single-threaded calls.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(threads_.size()); }

  // Runs fn(i) for every i in [0, n) on the pool and returns when all have finished.
  // Not from inside fn: a pool thread waiting on the pool would deadlock it.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  struct Job;
  void WorkerLoop();

  // std::mutex rather than absl::Mutex so ThreadSanitizer sees the locking: Debian's
  // prebuilt Abseil is not instrumented.
  std::mutex mu_;
  std::condition_variable work_available_;  // a job was queued, or stopping
  std::condition_variable job_finished_;    // some job's last item finished
  std::deque<std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace attention::core

#endif  // ATTENTION_CORE_THREAD_POOL_H_

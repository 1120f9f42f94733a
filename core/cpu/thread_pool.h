// A fixed set of compute threads shared by every kernel of the process.
#ifndef ATTENTION_CORE_CPU_THREAD_POOL_H_
#define ATTENTION_CORE_CPU_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "core/mutex.h"

namespace attention::core {

// Thread-safe. Several callers may run ParallelFor at once; the pool's threads help with
// the oldest job first.
//
// Thread budget: OpenBLAS is pinned to one thread per call (see the constructor) and every
// GEMM is split across this pool instead, so BLAS threads never add to the count. The pool
// owns `num_threads - 1` threads and the caller of ParallelFor computes too, so one caller
// runs exactly `num_threads` compute threads; two callers at once (two batch workers) run
// one more, for the moments their jobs overlap.
class ThreadPool {
 public:
  // num_threads >= 1 (1 = everything runs on the caller). Also sets OpenBLAS to
  // single-threaded calls.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads that compute one job: the pool's and the caller.
  int size() const { return size_; }

  // Runs fn(i) for every i in [0, n) on the pool and the calling thread, and returns when
  // all have finished. Not from inside fn: a pool thread waiting on the pool would deadlock.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  struct Job;
  void WorkerLoop();
  // Claims and runs items of `job` until none is left, then records them as finished.
  void RunItems(const std::shared_ptr<Job>& job);

  Mutex mu_;  // see core/mutex.h
  std::condition_variable_any work_available_;  // a job was queued, or stopping
  std::condition_variable_any job_finished_;    // some job's last item finished
  std::deque<std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  const int size_;
  std::vector<std::thread> threads_;
};

// memcpy(to, from, bytes) split into pieces of at least 1 MiB run across `pool`: one thread
// copies well below a host's memory bandwidth (a GPU's staging copies are this).
void ParallelCopy(ThreadPool& pool, void* to, const void* from, size_t bytes);

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_THREAD_POOL_H_

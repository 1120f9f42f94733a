// A few threads for work too slow for gRPC's callback threads: building layers (file I/O,
// up to gigabytes of initialisation). A bounded number of jobs run at once; past that,
// TrySubmit refuses at once, so a burst of loads is answered RESOURCE_EXHAUSTED instead
// of queueing memory.
#ifndef ATTENTION_SERVER_LOADER_POOL_H_
#define ATTENTION_SERVER_LOADER_POOL_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "core/mutex.h"

namespace attention::server {

// Thread-safe.
class LoaderPool {
 public:
  // `max_jobs` >= 1 threads; each runs one job at a time.
  explicit LoaderPool(int max_jobs);
  ~LoaderPool();  // Shutdown()

  // Runs `work` on a pool thread, frees its slot, then calls `done` with work's result, so
  // that a caller told the result can submit again at once. Returns false (running
  // neither) when `max_jobs` jobs are already running or waiting, or after Shutdown.
  bool TrySubmit(std::function<absl::Status()> work,
                 std::function<void(const absl::Status&)> done);

  // Finishes the jobs taken, then joins the threads. Idempotent.
  void Shutdown();

  int max_jobs() const { return max_jobs_; }

 private:
  void WorkerLoop();

  const int max_jobs_;
  core::Mutex mu_;  // see core/mutex.h
  std::condition_variable_any job_added_;
  struct Job {
    std::function<absl::Status()> work;
    std::function<void(const absl::Status&)> done;
  };
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_LOADER_POOL_H_

#include "core/thread_pool.h"

#include <atomic>

#include <cblas.h>

namespace attention::core {

struct ThreadPool::Job {
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t size = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

ThreadPool::ThreadPool(int num_threads) {
  openblas_set_num_threads(1);
  if (num_threads < 1) num_threads = 1;
  threads_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->size = n;
  absl::MutexLock lock(&mu_);
  jobs_.push_back(job);
  auto all_finished = [&job] { return job->finished.load() == job->size; };
  mu_.Await(absl::Condition(&all_finished));
}

void ThreadPool::WorkerLoop() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !jobs_.empty();
      };
      mu_.Await(absl::Condition(&has_work));
      if (jobs_.empty()) return;  // stopping
      job = jobs_.front();
    }
    int64_t done_here = 0;
    for (int64_t i = job->next.fetch_add(1); i < job->size; i = job->next.fetch_add(1)) {
      (*job->fn)(i);
      ++done_here;
    }
    absl::MutexLock lock(&mu_);
    // Every item is claimed: the job leaves the queue so workers move on to the next one.
    if (!jobs_.empty() && jobs_.front() == job) jobs_.pop_front();
    job->finished.fetch_add(done_here);
  }
}

}  // namespace attention::core

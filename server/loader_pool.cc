#include "server/loader_pool.h"

namespace attention::server {

LoaderPool::LoaderPool(int max_jobs) : max_jobs_(max_jobs < 1 ? 1 : max_jobs) {
  for (int i = 0; i < max_jobs_; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

LoaderPool::~LoaderPool() { Shutdown(); }

bool LoaderPool::TrySubmit(std::function<absl::Status()> work,
                           std::function<void(const absl::Status&)> done) {
  {
    core::MutexLock lock(mu_);
    if (stopping_ || running_ + static_cast<int>(jobs_.size()) >= max_jobs_) return false;
    jobs_.push_back({std::move(work), std::move(done)});
  }
  job_added_.notify_one();
  return true;
}

void LoaderPool::Shutdown() {
  {
    core::MutexLock lock(mu_);
    stopping_ = true;
  }
  job_added_.notify_all();
  for (std::thread& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
}

void LoaderPool::WorkerLoop() {
  while (true) {
    Job job;
    {
      core::MutexLock lock(mu_);
      while (!stopping_ && jobs_.empty()) job_added_.wait(lock);
      if (jobs_.empty()) return;  // stopping, and every job taken has run
      job = std::move(jobs_.front());
      jobs_.pop_front();
      ++running_;
    }
    const absl::Status status = job.work();
    {
      core::MutexLock lock(mu_);
      --running_;
    }
    job.done(status);
  }
}

}  // namespace attention::server

#include "server/batching/loader_pool.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/common/status_util.h"

namespace attention::server {
namespace {

bool Expired(const LoaderJob& job, absl::Time now) {
  return now > job.deadline || (job.is_cancelled && job.is_cancelled());
}

}  // namespace

LoaderPool::LoaderPool(const LoaderPoolOptions& options, Batcher* queued_bytes, Metrics* metrics)
    : options_{options.max_jobs < 1 ? 1 : options.max_jobs,
               options.max_queued_jobs < 0 ? 0 : options.max_queued_jobs},
      queued_bytes_(queued_bytes),
      metrics_(metrics) {
  for (int i = 0; i < options_.max_jobs; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

LoaderPool::~LoaderPool() { Shutdown(); }

absl::Status LoaderPool::QueueFull() const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "the layer-build queue is full: ", options_.max_jobs,
      " builds (LoadLayer and inline layers) are running "
      "(--max_concurrent_loads = ",
      options_.max_jobs, ") and ", options_.max_queued_jobs,
      " are waiting (--max_queued_loads = ", options_.max_queued_jobs, "); retry later"));
}

absl::Status LoaderPool::Submit(LoaderJob job) {
  const absl::Time now = absl::Now();
  std::vector<LoaderJob> expired;
  absl::Status status;
  {
    core::MutexLock lock(mu_);
    // Jobs whose callers gave up make room before this one is judged.
    expired = TakeExpiredLocked(now);
    if (stopping_) {
      status = absl::UnavailableError("the server is shutting down");
    } else if (static_cast<int>(jobs_.size()) >= options_.max_queued_jobs) {
      status = QueueFull();
    } else if (queued_bytes_ != nullptr && job.bytes > 0) {
      status = queued_bytes_->ReserveQueuedBytes(job.bytes, "for a layer build");
    }
    if (status.ok()) jobs_.push_back(std::move(job));
    if (metrics_ != nullptr) metrics_->SetLoaderQueueDepth(static_cast<int64_t>(jobs_.size()));
  }
  AnswerExpired(expired, now);
  if (status.ok()) job_added_.notify_one();
  return status;
}

int LoaderPool::queued() const {
  core::MutexLock lock(mu_);
  return static_cast<int>(jobs_.size());
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

std::vector<LoaderJob> LoaderPool::TakeExpiredLocked(absl::Time now) {
  std::vector<LoaderJob> expired;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (!Expired(*it, now)) {
      ++it;
      continue;
    }
    if (queued_bytes_ != nullptr && it->bytes > 0) queued_bytes_->ReleaseQueuedBytes(it->bytes);
    expired.push_back(std::move(*it));
    it = jobs_.erase(it);
  }
  return expired;
}

void LoaderPool::AnswerExpired(const std::vector<LoaderJob>& expired, absl::Time now) {
  for (const LoaderJob& job : expired) {
    if (now > job.deadline) {
      job.done(absl::DeadlineExceededError(
          "the deadline passed while the request waited for a layer-build slot "
          "(--max_concurrent_loads); nothing was built"));
    } else {
      job.done(
          absl::CancelledError("the request was cancelled while it waited for a "
                               "layer-build slot"));
    }
  }
}

void LoaderPool::WorkerLoop() {
  while (true) {
    LoaderJob job;
    std::vector<LoaderJob> expired;
    absl::Time now;
    {
      core::MutexLock lock(mu_);
      while (!stopping_ && jobs_.empty()) job_added_.wait(lock);
      if (jobs_.empty()) return;  // stopping, and every job taken has run
      now = absl::Now();
      expired = TakeExpiredLocked(now);
      if (!jobs_.empty()) {
        job = std::move(jobs_.front());
        jobs_.pop_front();
        if (queued_bytes_ != nullptr && job.bytes > 0) {
          queued_bytes_->ReleaseQueuedBytes(job.bytes);
        }
      }
      if (metrics_ != nullptr) metrics_->SetLoaderQueueDepth(static_cast<int64_t>(jobs_.size()));
    }
    AnswerExpired(expired, now);
    if (!job.work) continue;  // every waiting job had expired
    const absl::Status status = CatchExceptions("a loader job", job.work);
    job.done(status);
  }
}

}  // namespace attention::server

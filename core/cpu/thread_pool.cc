#include "core/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include <cblas.h>

namespace attention::core {

struct ThreadPool::Job {
  const std::function<void(int64_t)>* fn = nullptr;
  int64_t size = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
};

ThreadPool::ThreadPool(int num_threads) : size_(num_threads < 1 ? 1 : num_threads) {
  openblas_set_num_threads(1);
  // The caller of ParallelFor is the last of the `size_` compute threads.
  threads_.reserve(size_ - 1);
  for (int i = 0; i < size_ - 1; ++i) threads_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  work_available_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || threads_.empty()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->size = n;
  {
    MutexLock lock(mu_);
    jobs_.push_back(job);
  }
  work_available_.notify_all();
  // The caller works on its own job rather than sleeping until a pool thread has woken up
  // and finished it: on a VM each such wake-up costs tens of microseconds.
  RunItems(job);
  MutexLock lock(mu_);
  while (job->finished.load() != job->size) job_finished_.wait(lock);
}

void ThreadPool::RunItems(const std::shared_ptr<Job>& job) {
  int64_t done_here = 0;
  for (int64_t i = job->next.fetch_add(1); i < job->size; i = job->next.fetch_add(1)) {
    (*job->fn)(i);
    ++done_here;
  }
  MutexLock lock(mu_);
  // Every item is claimed: the job leaves the queue so workers move on to the next one.
  if (!jobs_.empty() && jobs_.front() == job) jobs_.pop_front();
  if (job->finished.fetch_add(done_here) + done_here == job->size) job_finished_.notify_all();
}

void ThreadPool::WorkerLoop() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      MutexLock lock(mu_);
      while (!stopping_ && jobs_.empty()) work_available_.wait(lock);
      if (jobs_.empty()) return;  // stopping
      job = jobs_.front();
    }
    RunItems(job);
  }
}

void ParallelCopy(ThreadPool& pool, void* to, const void* from, size_t bytes) {
  if (bytes == 0) return;  // `from` may then be null, which memcpy must not be given
  constexpr size_t kMinPiece = size_t{1} << 20;
  const size_t pieces = std::clamp<size_t>(bytes / kMinPiece, 1, pool.size());
  const size_t piece = (bytes / pieces + 63) / 64 * 64;  // whole cache lines
  pool.ParallelFor(static_cast<int64_t>(pieces), [&](int64_t p) {
    const size_t begin = std::min(bytes, static_cast<size_t>(p) * piece);
    const size_t end =
        p + 1 == static_cast<int64_t>(pieces) ? bytes : std::min(bytes, begin + piece);
    std::memcpy(static_cast<char*>(to) + begin, static_cast<const char*>(from) + begin,
                end - begin);
  });
}

}  // namespace attention::core

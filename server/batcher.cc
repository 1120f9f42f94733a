#include "server/batcher.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace attention::server {

absl::Status BatcherOptions::Validate() const {
  for (auto [name, value] : {std::pair<const char*, int64_t>{"max_batch_requests",
                                                             max_batch_requests},
                             {"max_batch_tokens", max_batch_tokens},
                             {"max_queue_requests", max_queue_requests},
                             {"num_workers", num_workers}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat(name, " = ", value, " must be >= 1"));
    }
  }
  return absl::OkStatus();
}

Batcher::Batcher(const BatcherOptions& options, core::ThreadPool& pool, Metrics* metrics)
    : options_(options), pool_(pool), metrics_(metrics) {
  for (int i = 0; i < options_.num_workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

Batcher::~Batcher() { Shutdown(); }

absl::Status Batcher::Submit(std::unique_ptr<WorkItem> item) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("the server is shutting down");
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queue_requests) {
    return absl::ResourceExhaustedError(absl::StrCat("the compute queue is full (",
                                                     options_.max_queue_requests,
                                                     " requests waiting); retry later"));
  }
  item->enqueued = absl::Now();
  queue_.push_back(std::move(item));
  if (metrics_ != nullptr) metrics_->SetQueueDepth(static_cast<int64_t>(queue_.size()));
  return absl::OkStatus();
}

void Batcher::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

int64_t Batcher::QueueDepth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

void Batcher::WorkerLoop() {
  while (true) {
    std::vector<std::unique_ptr<WorkItem>> batch;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping, and everything queued is done
      batch = TakeBatchLocked();
      if (metrics_ != nullptr) metrics_->SetQueueDepth(static_cast<int64_t>(queue_.size()));
    }
    Run(std::move(batch));
  }
}

std::vector<std::unique_ptr<WorkItem>> Batcher::TakeBatchLocked() {
  auto first = std::max_element(queue_.begin(), queue_.end(), [](const auto& a, const auto& b) {
    return a->priority < b->priority;  // max_element keeps the earliest of equals
  });
  std::vector<std::unique_ptr<WorkItem>> batch;
  batch.push_back(std::move(*first));
  queue_.erase(first);
  const LayerSnapshot* layer = batch.front()->layer.get();
  if (layer == nullptr) return batch;
  int64_t tokens = batch.front()->tokens;
  for (auto it = queue_.begin(); it != queue_.end() &&
                                 static_cast<int64_t>(batch.size()) < options_.max_batch_requests;) {
    if ((*it)->layer.get() == layer && tokens + (*it)->tokens <= options_.max_batch_tokens) {
      tokens += (*it)->tokens;
      batch.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
  return batch;
}

void Batcher::Run(std::vector<std::unique_ptr<WorkItem>> batch) {
  const absl::Time now = absl::Now();
  std::vector<std::unique_ptr<WorkItem>> live;
  for (auto& item : batch) {
    if (metrics_ != nullptr) metrics_->Dequeued(now - item->enqueued);
    if (now > item->deadline) {
      item->done(absl::DeadlineExceededError("the deadline passed while the request was queued"));
    } else if (item->is_cancelled && item->is_cancelled()) {
      item->done(absl::CancelledError("the request was cancelled before compute"));
    } else {
      live.push_back(std::move(item));
    }
  }
  if (live.empty()) return;
  int64_t tokens = 0;
  for (const auto& item : live) tokens += item->tokens;
  const absl::Time start = absl::Now();
  if (live.front()->layer == nullptr) {
    core::AttentionResult result = live.front()->run_alone(pool_);
    if (metrics_ != nullptr) metrics_->BatchComputed(1, tokens, absl::Now() - start);
    live.front()->done(std::move(result));
    return;
  }
  std::vector<const core::MhaInput*> inputs;
  for (const auto& item : live) inputs.push_back(&item->input);
  const LayerSnapshot& snapshot = *live.front()->layer;
  std::vector<core::AttentionResult> results = snapshot.layer->ForwardBatch(inputs, pool_);
  if (metrics_ != nullptr) {
    metrics_->BatchComputed(static_cast<int64_t>(live.size()), tokens, absl::Now() - start);
    metrics_->TokensProcessed(snapshot.name, tokens);
  }
  for (size_t n = 0; n < live.size(); ++n) live[n]->done(std::move(results[n]));
}

}  // namespace attention::server

#include "server/batcher.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace attention::server {

absl::Status BatcherOptions::Validate() const {
  for (auto [name, value] : {std::pair<const char*, int64_t>{"max_batch_requests",
                                                             max_batch_requests},
                             {"max_batch_tokens", max_batch_tokens},
                             {"max_queue_requests", max_queue_requests},
                             {"max_queue_tokens", max_queue_tokens},
                             {"num_workers", num_workers}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat(name, " = ", value, " must be >= 1"));
    }
  }
  if (max_queue_delay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queue_delay = ", absl::FormatDuration(max_queue_delay),
                     " must be >= 0"));
  }
  if (starvation_limit <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("starvation_limit = ", absl::FormatDuration(starvation_limit),
                     " must be > 0"));
  }
  return absl::OkStatus();
}

absl::Status BatchQueue::Push(std::unique_ptr<WorkItem>& item, absl::Time now) {
  if (size() >= options_.max_queue_requests) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the compute queue is full (", options_.max_queue_requests, " requests waiting); retry later"));
  }
  if (tokens_ + item->tokens > options_.max_queue_tokens && !items_.empty()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the compute queue is full (", tokens_, " tokens waiting, limit ",
                     options_.max_queue_tokens, "); retry later"));
  }
  item->enqueued = now;
  tokens_ += item->tokens;
  items_.push_back(std::move(item));
  return absl::OkStatus();
}

BatchQueue::Iterator BatchQueue::Head(absl::Time now) {
  Iterator head = items_.begin();
  if (now - (*head)->enqueued > options_.starvation_limit) return head;  // oldest is starving
  for (Iterator it = items_.begin(); it != items_.end(); ++it) {
    if ((*it)->priority > (*head)->priority) head = it;
  }
  return head;
}

BatchQueue::Batch BatchQueue::Members(Iterator head, absl::Time now) {
  Batch batch;
  batch.members = {head};
  const LayerSnapshot* layer = (*head)->layer.get();
  if (layer == nullptr) {  // runs alone
    batch.full = true;
    return batch;
  }
  // Candidates in the order they would lead: starving first, then by priority and age.
  std::vector<Iterator> candidates;
  for (Iterator it = items_.begin(); it != items_.end(); ++it) {
    if (it != head && (*it)->layer.get() == layer) candidates.push_back(it);
  }
  auto rank = [&](Iterator it) {
    return std::pair<bool, int>(now - (*it)->enqueued > options_.starvation_limit,
                                (*it)->priority);
  };
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](Iterator a, Iterator b) { return rank(a) > rank(b); });
  int64_t tokens = (*head)->tokens;
  for (Iterator it : candidates) {
    if (static_cast<int64_t>(batch.members.size()) >= options_.max_batch_requests ||
        tokens + (*it)->tokens > options_.max_batch_tokens) {
      batch.full = true;
      break;
    }
    tokens += (*it)->tokens;
    batch.members.push_back(it);
  }
  if (static_cast<int64_t>(batch.members.size()) >= options_.max_batch_requests) {
    batch.full = true;
  }
  return batch;
}

std::vector<std::unique_ptr<WorkItem>> BatchQueue::PopDue(absl::Time now, bool flush,
                                                          absl::Time* due) {
  *due = absl::InfiniteFuture();
  if (items_.empty()) return {};
  const Batch next = Members(Head(now), now);
  absl::Time oldest = absl::InfiniteFuture();
  for (Iterator it : next.members) oldest = std::min(oldest, (*it)->enqueued);
  if (!flush && !next.full && now - oldest < options_.max_queue_delay) {
    *due = oldest + options_.max_queue_delay;
    return {};
  }
  std::vector<std::unique_ptr<WorkItem>> batch;
  for (Iterator it : next.members) {
    tokens_ -= (*it)->tokens;
    batch.push_back(std::move(*it));
    items_.erase(it);
  }
  return batch;
}

Batcher::Batcher(const BatcherOptions& options, core::ThreadPool& pool, Metrics* metrics)
    : pool_(pool), metrics_(metrics), queue_(options) {
  for (int i = 0; i < options.num_workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

Batcher::~Batcher() { Shutdown(); }

absl::Status Batcher::Submit(std::unique_ptr<WorkItem> item) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    const absl::Status status = queue_.Push(item, absl::Now());
    if (!status.ok()) return status;
    if (metrics_ != nullptr) metrics_->SetQueueDepth(queue_.size());
  }
  changed_.notify_all();
  return absl::OkStatus();
}

void Batcher::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

int64_t Batcher::QueueDepth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void Batcher::WorkerLoop() {
  while (true) {
    std::vector<std::unique_ptr<WorkItem>> batch;
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (batch.empty()) {
        changed_.wait(lock, [this] { return stopping_ || queue_.size() > 0; });
        if (queue_.size() == 0) return;  // stopping, and everything queued is done
        absl::Time due;
        batch = queue_.PopDue(absl::Now(), stopping_, &due);
        // Not due yet: wait for the delay to pass, or for an arrival that may fill the
        // batch sooner (either way the loop asks the queue again).
        if (batch.empty()) changed_.wait_until(lock, absl::ToChronoTime(due));
      }
      if (metrics_ != nullptr) metrics_->SetQueueDepth(queue_.size());
    }
    Run(std::move(batch));
  }
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

#include "server/batching/batcher.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"

namespace attention::server {

absl::Status BatcherOptions::Validate() const {
  RETURN_IF_ERROR(limits.Validate());
  if (num_workers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_workers = ", num_workers,
                                                   " must be >= 1"));
  }
  if (max_queued_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_queued_bytes = ", max_queued_bytes, " must be >= 1"));
  }
  if (starvation_limit <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("starvation_limit = ", absl::FormatDuration(starvation_limit),
                     " must be > 0"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<core::AttentionResult>> LayerWorkItem::Compute(
    absl::Span<WorkItem* const> batch) {
  std::vector<const core::MhaInput*> inputs;
  // Items of one batch_key() share this snapshot, so they are all LayerWorkItems.
  for (WorkItem* item : batch) inputs.push_back(&static_cast<LayerWorkItem*>(item)->input);
  return snapshot->layer->ForwardBatch(inputs);
}

absl::StatusOr<std::vector<core::AttentionResult>> SoloWorkItem::Compute(
    absl::Span<WorkItem* const> /*batch*/) {
  ASSIGN_OR_RETURN(core::AttentionResult result, run());
  std::vector<core::AttentionResult> results;
  results.push_back(std::move(result));
  return results;
}

bool BatchQueue::Rank::operator>(const Rank& other) const {
  if (starving != other.starving) return starving;
  if (priority != other.priority) return priority > other.priority;
  return arrival < other.arrival;
}

BatchLimits BatchQueue::LimitsFor(const LayerSnapshot* layer) const {
  return layer == nullptr ? options_.limits : layer->batching.ApplyTo(options_.limits);
}

int64_t BatchQueue::size(const std::string& queue_name) const {
  const auto it = usage_.find(queue_name);
  return it == usage_.end() ? 0 : it->second.requests;
}

absl::Status BatchQueue::Push(std::unique_ptr<WorkItem>& item, absl::Time now) {
  const std::string name = item->queue_name();
  const BatchLimits limits = LimitsFor(item->layer());
  Usage& usage = usage_[name];
  absl::Status status;
  const int64_t held = bytes_ + reserved_bytes_;
  const bool holding = !items_.empty() || reserved_bytes_ > 0;
  if (held + item->bytes > options_.max_queued_bytes && holding) {
    status = absl::ResourceExhaustedError(absl::StrCat(
        "the server's queued requests hold ", held, " bytes and this one needs ",
        item->bytes, ", over the limit of ", options_.max_queued_bytes,
        " (--max_queued_bytes); retry later"));
  } else if (usage.requests >= limits.max_queue_requests) {
    status = absl::ResourceExhaustedError(
        absl::StrCat("the compute queue of layer \"", name, "\" is full (", usage.requests,
                     " requests waiting, limit ", limits.max_queue_requests, "); retry later"));
  } else if (item->tokens > limits.max_queue_tokens) {
    // Admitting it even to an empty queue would let one call hold the pool unbounded.
    status = absl::ResourceExhaustedError(absl::StrCat(
        "the request has ", item->tokens, " query tokens, more than the ",
        limits.max_queue_tokens, " that layer \"", name,
        "\" may queue (max_queue_tokens); split it into smaller requests"));
  } else if (usage.tokens + item->tokens > limits.max_queue_tokens) {
    status = absl::ResourceExhaustedError(
        absl::StrCat("the compute queue of layer \"", name, "\" is full (", usage.tokens,
                     " tokens waiting, limit ", limits.max_queue_tokens, "); retry later"));
  }
  if (!status.ok()) {
    if (usage.requests == 0) usage_.erase(name);
    return status;
  }
  ++usage.requests;
  usage.tokens += item->tokens;
  item->enqueued = now;
  if (limits.queue_timeout > absl::ZeroDuration()) {
    item->deadline = std::min(item->deadline, now + limits.queue_timeout);
  }
  tokens_ += item->tokens;
  bytes_ += item->bytes;
  items_.push_back(std::move(item));
  return absl::OkStatus();
}

absl::Status BatchQueue::Reserve(int64_t bytes, absl::string_view what) {
  const int64_t held = bytes_ + reserved_bytes_;
  if (held + bytes > options_.max_queued_bytes && (!items_.empty() || reserved_bytes_ > 0)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server's queued requests hold ", held, " bytes and this one needs ", bytes,
        " to wait ", what, ", over the limit of ", options_.max_queued_bytes,
        " (--max_queued_bytes); retry later"));
  }
  reserved_bytes_ += bytes;
  return absl::OkStatus();
}

std::vector<std::unique_ptr<WorkItem>> BatchQueue::PopDue(absl::Time now, bool flush,
                                                          absl::Time* due) {
  *due = absl::InfiniteFuture();
  // Group the queue by what can share a batch: one batch_key(), or a lone item.
  struct Entry {
    Rank rank;
    Iterator item;
  };
  absl::flat_hash_map<const void*, std::vector<Entry>> groups;
  int64_t arrival = 0;
  for (Iterator it = items_.begin(); it != items_.end(); ++it, ++arrival) {
    const WorkItem& item = **it;
    const void* group = item.batch_key() != nullptr ? item.batch_key() : &item;
    groups[group].push_back(
        {{now - item.enqueued > options_.starvation_limit, item.priority, arrival}, it});
  }
  // Each group's batch: its members in the order they would lead, within the batch limits.
  std::vector<Iterator> best;
  Rank best_rank{};
  for (auto& [group, entries] : groups) {
    std::sort(entries.begin(), entries.end(),
              [](const Entry& a, const Entry& b) { return a.rank > b.rank; });
    std::vector<Iterator> members;
    int64_t tokens = 0;
    absl::Time oldest = absl::InfiniteFuture();
    const BatchLimits limits = LimitsFor((*entries.front().item)->layer());  // one layer
    bool full = (*entries.front().item)->batch_key() == nullptr;             // runs alone
    for (const Entry& entry : entries) {
      const WorkItem& item = **entry.item;
      if (!members.empty() &&
          (static_cast<int64_t>(members.size()) >= limits.max_batch_requests ||
           tokens + item.tokens > limits.max_batch_tokens)) {
        full = true;
        break;
      }
      members.push_back(entry.item);
      tokens += item.tokens;
      oldest = std::min(oldest, item.enqueued);
    }
    full = full || static_cast<int64_t>(members.size()) >= limits.max_batch_requests;
    if (!flush && !full && now - oldest < limits.max_queue_delay) {
      *due = std::min(*due, oldest + limits.max_queue_delay);
      continue;
    }
    if (best.empty() || entries.front().rank > best_rank) {
      best = std::move(members);
      best_rank = entries.front().rank;
    }
  }
  std::vector<std::unique_ptr<WorkItem>> batch;
  if (best.empty()) return batch;
  // A batch is one batch_key() (or one item), so it leaves one layer's queue.
  const std::string name = (*best.front())->queue_name();
  Usage& usage = usage_[name];
  for (Iterator it : best) {
    --usage.requests;
    usage.tokens -= (*it)->tokens;
    tokens_ -= (*it)->tokens;
    bytes_ -= (*it)->bytes;
    batch.push_back(std::move(*it));
    items_.erase(it);
  }
  if (usage.requests == 0) usage_.erase(name);
  return batch;
}

Batcher::Batcher(const BatcherOptions& options, Metrics* metrics)
    : server_limits_(options.limits), metrics_(metrics), queue_(options) {
  for (int i = 0; i < options.num_workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

Batcher::~Batcher() { Shutdown(); }

absl::Status Batcher::Submit(std::unique_ptr<WorkItem> item) {
  {
    core::MutexLock lock(mu_);
    if (stopping_) return absl::UnavailableError("the server is shutting down");
    const std::string name = item->queue_name();
    // Push moves the item into the queue, which keeps its snapshot alive while mu_ is held.
    const LayerSnapshot* layer = item->layer();
    absl::Status status = queue_.Push(item, absl::Now());
    if (!status.ok()) return status;
    if (metrics_ != nullptr) {
      const int64_t depth = queue_.size(name);
      metrics_->SetQueueDepth(name, depth);
      // The bound can only change with a reload, so it is refreshed when a queue starts
      // filling rather than on every arrival.
      if (depth == 1) {
        metrics_->SetQueueCapacity(name, queue_.LimitsFor(layer).max_queue_requests);
      }
    }
  }
  // One worker is enough to look at the queue; waking every idle worker for each arrival
  // takes CPU from the compute threads (a worker that takes a batch wakes the next one).
  changed_.notify_one();
  return absl::OkStatus();
}

void Batcher::Shutdown() {
  {
    core::MutexLock lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  for (std::thread& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

int64_t Batcher::QueueDepth() const {
  core::MutexLock lock(mu_);
  return queue_.size();
}

absl::Status Batcher::ReserveQueuedBytes(int64_t bytes, absl::string_view what) {
  core::MutexLock lock(mu_);
  return queue_.Reserve(bytes, what);
}

void Batcher::ReleaseQueuedBytes(int64_t bytes) {
  core::MutexLock lock(mu_);
  queue_.Release(bytes);
}

void Batcher::WorkerLoop() {
  while (true) {
    std::vector<std::unique_ptr<WorkItem>> batch;
    bool more_queued = false;
    {
      core::MutexLock lock(mu_);
      while (batch.empty()) {
        while (!stopping_ && queue_.size() == 0) changed_.wait(lock);
        if (queue_.size() == 0) return;  // stopping, and everything queued is done
        absl::Time due;
        batch = queue_.PopDue(absl::Now(), stopping_, &due);
        // Not due yet: wait for the delay to pass, or for an arrival that may fill the
        // batch sooner (either way the loop asks the queue again).
        if (batch.empty()) changed_.wait_until(lock, absl::ToChronoTime(due));
      }
      if (metrics_ != nullptr) {
        const std::string name = batch.front()->queue_name();
        metrics_->SetQueueDepth(name, queue_.size(name));
      }
      more_queued = queue_.size() > 0;
    }
    if (more_queued) changed_.notify_one();  // the rest is another worker's to look at
    Run(std::move(batch));
  }
}

void Batcher::Run(std::vector<std::unique_ptr<WorkItem>> batch) {
  const absl::Time now = absl::Now();
  std::vector<std::unique_ptr<WorkItem>> live;
  for (auto& item : batch) {
    if (metrics_ != nullptr) metrics_->Dequeued(now - item->enqueued);
    if (now > item->deadline) {
      item->done(absl::DeadlineExceededError(
          "the deadline (the call's, options.queue_timeout_us, or the layer's queue_timeout) "
          "passed while the request was queued"));
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
  std::vector<WorkItem*> items;
  for (const auto& item : live) items.push_back(item.get());
  absl::StatusOr<std::vector<core::AttentionResult>> results;
  const absl::Status computed = CatchExceptions(
      absl::StrCat("a batch of ", live.front()->queue_name()), [&]() -> absl::Status {
        results = live.front()->Compute(items);
        return absl::OkStatus();
      });
  if (!computed.ok()) results = computed;
  if (metrics_ != nullptr) {
    const absl::Duration compute = absl::Now() - start;
    const std::string name = live.front()->queue_name();
    metrics_->BatchComputed(name, live.front()->device(), static_cast<int64_t>(live.size()), tokens,
                            compute);
    if (live.front()->layer() != nullptr) {
      if (results.ok()) metrics_->TokensProcessed(name, tokens);
      absl::Duration queued;
      for (const auto& item : live) queued += start - item->enqueued;
      metrics_->LayerBatchFinished(name, static_cast<int64_t>(live.size()), queued, compute,
                                   results.ok());
    }
  }
  for (size_t n = 0; n < live.size(); ++n) {
    // A backend error (e.g. the device ran out of memory) fails the whole batch.
    if (results.ok()) {
      live[n]->done(std::move((*results)[n]));
    } else {
      live[n]->done(results.status());
    }
  }
}

}  // namespace attention::server

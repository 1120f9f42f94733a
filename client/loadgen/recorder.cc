// attention-loadgen's bookkeeping and its summary: exact nearest-rank latency percentiles
// and errors by status code name.
#include "client/loadgen/recorder.h"

#include <algorithm>
#include <cmath>

namespace attention::loadgen {
namespace {

// google.rpc.Code names, indexed by code.
const char* StatusCodeName(int code) {
  static const char* const kNames[] = {
      "OK",
      "CANCELLED",
      "UNKNOWN",
      "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED",
      "NOT_FOUND",
      "ALREADY_EXISTS",
      "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED",
      "FAILED_PRECONDITION",
      "ABORTED",
      "OUT_OF_RANGE",
      "UNIMPLEMENTED",
      "INTERNAL",
      "UNAVAILABLE",
      "DATA_LOSS",
      "UNAUTHENTICATED",
  };
  if (code < 0 || code > 16) return "INVALID_CODE";
  return kNames[code];
}

// Exact nearest-rank percentile of sorted values: the value at rank ceil(p * n).
double Percentile(const std::vector<int64_t>& sorted_ns, double p) {
  const size_t n = sorted_ns.size();
  size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(n)));
  rank = std::min(std::max<size_t>(rank, 1), n);
  return static_cast<double>(sorted_ns[rank - 1]) / 1e6;
}

}  // namespace

void InFlight::Begin() {
  std::lock_guard<std::mutex> lock(mu_);
  ++count_;
}

void InFlight::End() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--count_ == 0) zero_.notify_all();
}

int64_t InFlight::Count() {
  std::lock_guard<std::mutex> lock(mu_);
  return count_;
}

bool InFlight::WaitZeroUntil(TimePoint deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  return zero_.wait_until(lock, deadline, [this] { return count_ == 0; });
}

void Recorder::Ok(TimePoint start, TimePoint finish, int64_t tokens) {
  if (!InWindow(start)) return;
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(finish - start).count();
  std::lock_guard<std::mutex> lock(mu_);
  latencies_ns_.push_back(ns);
  tokens_ += tokens;
}

void Recorder::Error(TimePoint start, int code) {
  if (!InWindow(start)) return;
  std::lock_guard<std::mutex> lock(mu_);
  ++errors_[code];
}

void Recorder::Unanswered(TimePoint start) {
  if (!InWindow(start)) return;
  std::lock_guard<std::mutex> lock(mu_);
  ++unanswered_;
}

void Recorder::NotSent(TimePoint start) {
  if (!InWindow(start)) return;
  std::lock_guard<std::mutex> lock(mu_);
  ++not_sent_;
}

void Recorder::SendLag(TimePoint scheduled, TimePoint sent) {
  if (!InWindow(scheduled)) return;
  const double ms = std::chrono::duration<double, std::milli>(sent - scheduled).count();
  std::lock_guard<std::mutex> lock(mu_);
  max_send_lag_ms_ = std::max(max_send_lag_ms_, ms);
}

Report Recorder::Summarize() {
  std::lock_guard<std::mutex> lock(mu_);
  Report r;
  r.window_seconds = std::chrono::duration<double>(end_ - begin_).count();
  r.requests = static_cast<int64_t>(latencies_ns_.size());
  r.tokens = tokens_;
  for (const auto& [code, count] : errors_) {
    r.errors += count;
    r.errors_by_code[StatusCodeName(code)] += count;
  }
  r.not_sent = not_sent_;
  r.unanswered = unanswered_;
  r.sent = r.requests + r.errors + r.unanswered;
  r.max_send_lag_ms = max_send_lag_ms_;
  std::sort(latencies_ns_.begin(), latencies_ns_.end());
  LatencySummary& l = r.latency;
  l.count = r.requests;
  if (l.count > 0) {
    long double sum = 0;
    for (int64_t ns : latencies_ns_) sum += ns;
    l.mean_ms = static_cast<double>(sum / l.count / 1e6L);
    l.min_ms = static_cast<double>(latencies_ns_.front()) / 1e6;
    l.max_ms = static_cast<double>(latencies_ns_.back()) / 1e6;
    l.p50_ms = Percentile(latencies_ns_, 0.50);
    l.p90_ms = Percentile(latencies_ns_, 0.90);
    l.p99_ms = Percentile(latencies_ns_, 0.99);
    l.p999_ms = Percentile(latencies_ns_, 0.999);
  }
  return r;
}

}  // namespace attention::loadgen

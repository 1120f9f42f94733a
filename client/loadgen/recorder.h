// attention-loadgen's bookkeeping: requests in flight, and the outcomes of the requests in
// the measurement window.
#ifndef ATTENTION_CLIENT_LOADGEN_RECORDER_H_
#define ATTENTION_CLIENT_LOADGEN_RECORDER_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "client/loadgen/clock.h"

namespace attention::loadgen {

// Counts requests issued and not yet finished; lets the main thread wait for zero.
// Thread-safe.
class InFlight {
 public:
  void Begin();
  void End();
  int64_t Count();
  // True when the count reached zero before `deadline`.
  bool WaitZeroUntil(TimePoint deadline);

 private:
  std::mutex mu_;
  std::condition_variable zero_;
  int64_t count_ = 0;
};

struct LatencySummary {
  int64_t count = 0;
  double mean_ms = 0, min_ms = 0, p50_ms = 0, p90_ms = 0, p99_ms = 0, p999_ms = 0, max_ms = 0;
};

struct Report {
  double window_seconds = 0;
  int64_t requests = 0;  // successful answers in the window
  int64_t tokens = 0;    // their query tokens
  int64_t sent = 0;      // window requests sent (answered, failed or unanswered)
  int64_t errors = 0;
  std::map<std::string, int64_t> errors_by_code;
  int64_t not_sent = 0;
  int64_t unanswered = 0;
  LatencySummary latency;
  double max_send_lag_ms = 0;  // open loop: worst delay of a send behind its schedule
};

// Outcomes of the requests that belong to the measurement window. Thread-safe.
class Recorder {
 public:
  Recorder(TimePoint window_begin, TimePoint window_end) : begin_(window_begin), end_(window_end) {}

  void Ok(TimePoint start, TimePoint finish, int64_t tokens);
  void Error(TimePoint start, int code);
  void Unanswered(TimePoint start);
  void NotSent(TimePoint start);
  void SendLag(TimePoint scheduled, TimePoint sent);

  Report Summarize();

 private:
  bool InWindow(TimePoint t) const { return t >= begin_ && t < end_; }

  const TimePoint begin_, end_;
  std::mutex mu_;
  std::vector<int64_t> latencies_ns_;
  int64_t tokens_ = 0;
  std::map<int, int64_t> errors_;
  int64_t unanswered_ = 0;
  int64_t not_sent_ = 0;
  double max_send_lag_ms_ = 0;
};

}  // namespace attention::loadgen

#endif  // ATTENTION_CLIENT_LOADGEN_RECORDER_H_

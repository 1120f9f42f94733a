// Request log lines on stderr: one per failed call, plus an optional sample of successful
// ones (an access log), as text or JSON lines.
#ifndef ATTENTION_SERVER_OBSERVABILITY_REQUEST_LOG_H_
#define ATTENTION_SERVER_OBSERVABILITY_REQUEST_LOG_H_

#include <atomic>
#include <cstdint>
#include <iostream>

#include "core/mutex.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attention::server {

struct RequestLogOptions {
  // One line for every call that ends with an error. Default true.
  bool errors = true;
  // Fraction of successful calls logged, in [0, 1]; exactly every 1/fraction-th. Default 0.
  double access_sample = 0.0;
  // One JSON object per line instead of key=value text.
  bool json = false;

  absl::Status Validate() const;
};

// Thread-safe; lines are written whole.
class RequestLog {
 public:
  explicit RequestLog(const RequestLogOptions& options, std::ostream& out = std::cerr)
      : options_(options), out_(out) {}

  void Record(absl::string_view method, const absl::Status& status, absl::Duration elapsed,
              absl::string_view request_id);

 private:
  bool SampleSuccess();

  const RequestLogOptions options_;
  std::ostream& out_;
  core::Mutex mu_;  // one line at a time
  std::atomic<uint64_t> successes_{0};
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_OBSERVABILITY_REQUEST_LOG_H_

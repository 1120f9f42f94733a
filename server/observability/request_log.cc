#include "server/observability/request_log.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/json_text.h"

namespace attention::server {

absl::Status RequestLogOptions::Validate() const {
  if (!(access_sample >= 0.0 && access_sample <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("access_log_sample = ", access_sample, " is outside [0, 1]"));
  }
  return absl::OkStatus();
}

bool RequestLog::SampleSuccess() {
  if (options_.access_sample <= 0.0) return false;
  // Call n is logged when floor(n * fraction) steps up: exactly the fraction, evenly spread.
  const uint64_t n = successes_.fetch_add(1);
  return std::floor((n + 1) * options_.access_sample) > std::floor(n * options_.access_sample);
}

void RequestLog::Record(absl::string_view method, const absl::Status& status,
                        absl::Duration elapsed, absl::string_view request_id) {
  if (status.ok() ? !SampleSuccess() : !options_.errors) return;
  const std::string time = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  const std::string code = absl::StatusCodeToString(status.code());
  const double seconds = absl::ToDoubleSeconds(elapsed);
  std::string line;
  if (options_.json) {
    line = absl::StrFormat(
        R"({"time":%s,"method":%s,"code":%s,"seconds":%.6f,"request_id":%s,"message":%s})",
        core::JsonQuoted(time), core::JsonQuoted(method), core::JsonQuoted(code), seconds,
        core::JsonQuoted(request_id), core::JsonQuoted(status.message()));
  } else {
    // Text values are quoted too: they may contain spaces and quotes.
    line = absl::StrFormat("%s method=%s code=%s seconds=%.6f request_id=%s message=%s", time,
                           method, code, seconds, core::JsonQuoted(request_id),
                           core::JsonQuoted(status.message()));
  }
  core::MutexLock lock(mu_);
  out_ << line << '\n' << std::flush;
}

}  // namespace attention::server

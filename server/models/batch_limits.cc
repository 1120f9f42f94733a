#include "server/models/batch_limits.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace attention::server {

absl::Status BatchLimits::Validate(absl::string_view field_prefix) const {
  for (auto [name, value] : {std::pair<const char*, int64_t>{"max_batch_requests",
                                                             max_batch_requests},
                             {"max_batch_tokens", max_batch_tokens},
                             {"max_queue_requests", max_queue_requests},
                             {"max_queue_tokens", max_queue_tokens}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(field_prefix, name, " = ", value, " must be >= 1"));
    }
  }
  for (auto [name, value] : {std::pair<const char*, absl::Duration>{"max_queue_delay",
                                                                    max_queue_delay},
                             {"queue_timeout", queue_timeout}}) {
    if (value < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          field_prefix, name, " = ", absl::FormatDuration(value), " must be >= 0"));
    }
  }
  return absl::OkStatus();
}

BatchLimits BatchLimitOverrides::ApplyTo(BatchLimits defaults) const {
  defaults.max_batch_requests = max_batch_requests.value_or(defaults.max_batch_requests);
  defaults.max_batch_tokens = max_batch_tokens.value_or(defaults.max_batch_tokens);
  defaults.max_queue_delay = max_queue_delay.value_or(defaults.max_queue_delay);
  defaults.max_queue_requests = max_queue_requests.value_or(defaults.max_queue_requests);
  defaults.max_queue_tokens = max_queue_tokens.value_or(defaults.max_queue_tokens);
  defaults.queue_timeout = queue_timeout.value_or(defaults.queue_timeout);
  return defaults;
}

}  // namespace attention::server

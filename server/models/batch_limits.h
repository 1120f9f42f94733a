// The limits that shape a layer's batches and bound its queue: the server's defaults (its
// flags) and a layer's own values for some of them, as Triton's per-model dynamic_batching.
#ifndef ATTENTION_SERVER_MODELS_BATCH_LIMITS_H_
#define ATTENTION_SERVER_MODELS_BATCH_LIMITS_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace attention::server {

struct BatchLimits {
  // A batch closes when it holds this many requests. >= 1; default 64.
  int64_t max_batch_requests = 64;
  // ... or when adding the next request would pass this many query tokens (sum of B * Nq);
  // a single larger request runs alone. >= 1; default 16384.
  int64_t max_batch_tokens = 16384;
  // ... or when its oldest request has waited this long. Zero (the default) closes a batch
  // as soon as a worker is free: under load, requests that arrive while a batch computes
  // form the next one, so batching costs no added latency. >= 0.
  absl::Duration max_queue_delay = absl::ZeroDuration();
  // Queued requests, and queued query tokens, of one layer beyond which Submit answers
  // RESOURCE_EXHAUSTED at once for that layer. >= 1; defaults 1024 and 1 << 20.
  int64_t max_queue_requests = 1024;
  int64_t max_queue_tokens = int64_t{1} << 20;
  // A request still queued this long after it arrived is answered DEADLINE_EXCEEDED
  // without being computed, as when its own deadline passes (load shedding: under
  // overload late answers are dropped instead of delaying every later request). Zero (the
  // default) means no limit. >= 0.
  absl::Duration queue_timeout = absl::ZeroDuration();

  // INVALID_ARGUMENT naming the first field out of range, prefixed with `field_prefix`.
  absl::Status Validate(absl::string_view field_prefix = "") const;
};

// A layer's own limits; an unset field follows the server's default, so a server restarted
// with other flags applies them to every layer that did not choose for itself.
struct BatchLimitOverrides {
  std::optional<int64_t> max_batch_requests;
  std::optional<int64_t> max_batch_tokens;
  std::optional<absl::Duration> max_queue_delay;
  std::optional<int64_t> max_queue_requests;
  std::optional<int64_t> max_queue_tokens;
  std::optional<absl::Duration> queue_timeout;

  // `defaults` with the fields this layer sets replaced.
  BatchLimits ApplyTo(BatchLimits defaults) const;
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_MODELS_BATCH_LIMITS_H_

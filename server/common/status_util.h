// The one place where absl::Status becomes a gRPC status, and the bounds on what error
// messages echo: a default gRPC client cannot read a status past 16 KiB of metadata, and
// messages must never grow with caller input or server state.
#ifndef ATTENTION_SERVER_COMMON_STATUS_UTIL_H_
#define ATTENTION_SERVER_COMMON_STATUS_UTIL_H_

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace attention::server {

// Longest message a caller receives, bytes; longer ones are cut with a note of the length.
inline constexpr size_t kMaxErrorMessageBytes = 2048;
// Longest caller string an error message quotes, bytes.
inline constexpr size_t kMaxQuotedBytes = 128;
// Most items of a list (e.g. loaded layers) an error message names.
inline constexpr size_t kMaxListedItems = 10;

// `text` in double quotes, cut to kMaxQuotedBytes with "..." and its length when longer.
std::string Quoted(absl::string_view text);

// The first kMaxListedItems of `items`, comma-separated, each cut as Quoted would, then
// "and N more" when there are more; "none" when empty.
std::string ListForMessage(const std::vector<std::string>& items);
// The same with each item Quoted (tensor names and prefixes, which end in dots).
std::string QuotedListForMessage(const std::vector<std::string>& items);

// `message` cut to kMaxErrorMessageBytes.
std::string BoundedMessage(absl::string_view message);

// A refusal's machine-readable reason (e.g. "SESSION_EXPIRED") rides on the absl::Status as
// a google.rpc.ErrorInfo payload of this domain; ToGrpcStatus puts it in the gRPC status
// details, where clients read it without parsing the message.
inline constexpr char kErrorDomain[] = "attention-service";
absl::Status WithReason(absl::Status status, absl::string_view reason);
// The reason `status` carries, or "" (tests and logs).
std::string ReasonOf(const absl::Status& status);
// `status` with its message prefixed by `context` and ": ", its code and reason kept.
absl::Status Prefixed(const absl::Status& status, absl::string_view context);

// `work`'s status; an exception it throws (std::bad_alloc, a vector's std::length_error)
// becomes INTERNAL naming `what` and the exception, logged on stderr. The last guard of
// every handler and worker thread: an exception leaving a gRPC handler is answered
// UNIMPLEMENTED with no message and leaks the call's in-flight count, and one leaving a
// worker thread ends the process.
absl::Status CatchExceptions(absl::string_view what, const std::function<absl::Status()>& work);

// absl and gRPC share the canonical code numbering, so the code carries over unchanged; a
// reason goes into the details as a google.rpc.Status holding the ErrorInfo.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_COMMON_STATUS_UTIL_H_

// Status helpers; Abseil 20220623 ships none.
#ifndef ATTENTION_CORE_STATUS_MACROS_H_
#define ATTENTION_CORE_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define ATTENTION_CONCAT_INNER(a, b) a##b
#define ATTENTION_CONCAT(a, b) ATTENTION_CONCAT_INNER(a, b)

// Returns from the current function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                       \
  do {                                              \
    ::absl::Status attention_status_ = (expr);      \
    if (!attention_status_.ok()) return attention_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, Foo());` unwraps a StatusOr or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(ATTENTION_CONCAT(attention_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                          \
  if (!statusor.ok()) return statusor.status();    \
  lhs = std::move(statusor).value()

namespace attention {

// INVALID_ARGUMENT with the pieces concatenated: the field, the values, the rule.
template <typename... Args>
absl::Status Invalid(const Args&... pieces) {
  return absl::InvalidArgumentError(absl::StrCat(pieces...));
}

}  // namespace attention

#endif  // ATTENTION_CORE_STATUS_MACROS_H_

#include "server/common/status_util.h"

#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

std::string Cut(absl::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return std::string(text);
  return absl::StrCat(text.substr(0, max_bytes), "... (", text.size(), " bytes)");
}

}  // namespace

std::string Quoted(absl::string_view text) {
  return absl::StrCat("\"", Cut(text, kMaxQuotedBytes), "\"");
}

namespace {

std::string List(const std::vector<std::string>& items, bool quoted) {
  if (items.empty()) return "none";
  std::string list;
  for (size_t i = 0; i < items.size() && i < kMaxListedItems; ++i) {
    absl::StrAppend(&list, i == 0 ? "" : ", ",
                    quoted ? Quoted(items[i]) : Cut(items[i], kMaxQuotedBytes));
  }
  if (items.size() > kMaxListedItems) {
    absl::StrAppend(&list, " and ", items.size() - kMaxListedItems, " more");
  }
  return list;
}

}  // namespace

std::string ListForMessage(const std::vector<std::string>& items) { return List(items, false); }

std::string QuotedListForMessage(const std::vector<std::string>& items) {
  return List(items, true);
}

std::string BoundedMessage(absl::string_view message) {
  return Cut(message, kMaxErrorMessageBytes);
}

}  // namespace attention::server

// JSON text helpers shared by the server's request log and the load generator's report.
#ifndef ATTENTION_CORE_JSON_TEXT_H_
#define ATTENTION_CORE_JSON_TEXT_H_

#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace attention::core {

// `text` as a JSON string literal, quotes included; control characters are escaped, other
// bytes are copied as they are.
inline std::string JsonQuoted(absl::string_view text) {
  std::string out = "\"";
  for (unsigned char ch : text) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (ch < 0x20) {
          out += absl::StrFormat("\\u%04x", ch);
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

}  // namespace attention::core

#endif  // ATTENTION_CORE_JSON_TEXT_H_

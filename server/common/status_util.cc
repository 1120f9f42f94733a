#include "server/common/status_util.h"

#include <exception>
#include <iostream>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"

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

namespace {

constexpr char kErrorInfoType[] = "type.googleapis.com/google.rpc.ErrorInfo";

}  // namespace

absl::Status WithReason(absl::Status status, absl::string_view reason) {
  google::rpc::ErrorInfo info;
  info.set_reason(std::string(reason));
  info.set_domain(kErrorDomain);
  status.SetPayload(kErrorInfoType, absl::Cord(info.SerializeAsString()));
  return status;
}

std::string ReasonOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kErrorInfoType);
  google::rpc::ErrorInfo info;
  if (!payload.has_value() || !info.ParseFromString(std::string(*payload))) return "";
  return info.reason();
}

absl::Status CatchExceptions(absl::string_view what, const std::function<absl::Status()>& work) {
  std::string exception;
  try {
    return work();
  } catch (const std::exception& error) {
    exception = error.what();
  } catch (...) {
    exception = "an exception of unknown type";
  }
  const std::string message = BoundedMessage(
      absl::StrCat(what, " failed on an internal error (", exception, "); the server goes on"));
  std::cerr << "attention-service: " << message << std::endl;
  return absl::InternalError(message);
}

absl::Status Prefixed(const absl::Status& status, absl::string_view context) {
  absl::Status prefixed(status.code(), absl::StrCat(context, ": ", status.message()));
  status.ForEachPayload([&prefixed](absl::string_view type, const absl::Cord& payload) {
    prefixed.SetPayload(type, payload);
  });
  return prefixed;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(status.code());
  std::string message = BoundedMessage(status.message());
  const auto reason = status.GetPayload(kErrorInfoType);
  if (!reason.has_value()) return grpc::Status(code, message);
  google::rpc::Status details;
  details.set_code(static_cast<int>(status.code()));
  details.set_message(message);
  google::protobuf::Any* any = details.add_details();
  any->set_type_url(kErrorInfoType);
  any->set_value(std::string(*reason));
  return grpc::Status(code, message, details.SerializeAsString());
}

}  // namespace attention::server

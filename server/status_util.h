// The one place where absl::Status becomes a gRPC status.
#ifndef ATTENTION_SERVER_STATUS_UTIL_H_
#define ATTENTION_SERVER_STATUS_UTIL_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace attention::server {

// absl and gRPC share the canonical code numbering, so the code carries over unchanged.
inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

}  // namespace attention::server

#endif  // ATTENTION_SERVER_STATUS_UTIL_H_

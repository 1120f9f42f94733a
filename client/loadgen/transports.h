// The transports of attention-loadgen: unary calls, or requests multiplexed over
// bidirectional streams; both spread over one or more HTTP/2 connections.
#ifndef ATTENTION_CLIENT_LOADGEN_TRANSPORTS_H_
#define ATTENTION_CLIENT_LOADGEN_TRANSPORTS_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <grpcpp/channel.h>
#include <grpcpp/support/status.h>

#include "client/loadgen/config.h"
#include "client/loadgen/requests.h"

namespace attention::loadgen {

// Called once per sent request with its gRPC status code (OK = answered).
using DoneFn = std::function<void(grpc::StatusCode)>;

// Thread-safe.
class Transport {
 public:
  virtual ~Transport() = default;
  // Sends `request` on lane `lane` (a caller index or an arrival counter). Returns false when
  // it cannot be sent (then `done` is never called); otherwise `done` runs exactly once, on
  // a gRPC thread, never inside Send.
  virtual bool Send(int64_t lane, std::unique_ptr<Request> request, DoneFn done) = 0;
  // Cancels everything outstanding; their `done` run with CANCELLED (or their real outcome).
  virtual void CancelAll() = 0;
  // No more Send; closes streams and waits until they are finished.
  virtual void CloseAndWait() = 0;
};

// --connections channels to --target, each its own TCP connection.
std::vector<std::shared_ptr<grpc::Channel>> MakeChannels(const Config& config);

// One callback-API unary call per request, with a deadline of `request_timeout` seconds;
// lane i uses channel i % channels.
std::unique_ptr<Transport> MakeUnaryTransport(
    const std::vector<std::shared_ptr<grpc::Channel>>& channels, double request_timeout);

// `streams` bidirectional streams with the given deadline, stream i on channel
// i % channels; lane i uses stream i % streams.
std::unique_ptr<Transport> MakeStreamTransport(
    const std::vector<std::shared_ptr<grpc::Channel>>& channels, int streams,
    std::chrono::system_clock::time_point deadline);

}  // namespace attention::loadgen

#endif  // ATTENTION_CLIENT_LOADGEN_TRANSPORTS_H_

// The plumbing every handler of both front-ends (native/, kserve/) shares, written once:
// a call's record in the metrics and the request log, a unary call's answer, and work
// queued on the loader pool on a call's behalf.
#ifndef ATTENTION_SERVER_RPC_CALL_H_
#define ATTENTION_SERVER_RPC_CALL_H_

#include <functional>

#include <google/protobuf/message.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "server/batching/loader_pool.h"
#include "server/observability/metrics.h"
#include "server/observability/request_log.h"

namespace attention::server {

// One call (a unary call, or one request of a stream) from its start to its answer:
// counted in flight from construction; Finished counts its code and latency in the metrics
// and writes the request log. Copyable; `method` must be a string literal.
class CallRecord {
 public:
  CallRecord(Metrics& metrics, RequestLog& log, absl::string_view method);
  // Call exactly once, when the call is answered.
  void Finished(const absl::Status& status, absl::string_view request_id = "") const;

 private:
  Metrics* metrics_;
  RequestLog* log_;
  absl::string_view method_;
  absl::Time start_;
};

// A unary call of gRPC's callback API: its reactor and its record. Copyable, so that
// whoever finishes the call (the handler, a loader job, a batch worker) holds it.
class UnaryCall {
 public:
  UnaryCall(grpc::CallbackServerContext* context, CallRecord record)
      : context_(context), reactor_(context->DefaultReactor()), record_(record) {}

  // Records the call and answers it; exactly once.
  void Answer(const absl::Status& status, absl::string_view request_id = "") const;
  grpc::ServerUnaryReactor* reactor() const { return reactor_; }
  // The caller's deadline (infinite when it set none), and whether it gave up.
  absl::Time deadline() const;
  std::function<bool()> cancelled() const;

 private:
  grpc::CallbackServerContext* context_;
  grpc::ServerUnaryReactor* reactor_;
  CallRecord record_;
};

// A loader job on a call's behalf: `request`'s bytes wait against --max_queued_bytes, and
// it waits no longer than `deadline` (and `options`' queue_timeout_us, when given).
LoaderJob CallJob(const google::protobuf::Message& request, absl::Time deadline,
                  const v1::AttentionOptions* options, std::function<bool()> is_cancelled);

// Runs `work` for `call` on the loader pool (files and weights are never read on a gRPC
// thread) and answers the call with its result, or at once when the pool refuses.
void AnswerFromLoader(LoaderPool& loader, const UnaryCall& call,
                      const google::protobuf::Message& request, std::function<absl::Status()> work);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_RPC_CALL_H_

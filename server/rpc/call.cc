#include "server/rpc/call.h"

#include "absl/time/clock.h"
#include "server/common/status_util.h"
#include "server/validation/wire_convert.h"

namespace attention::server {

CallRecord::CallRecord(Metrics& metrics, RequestLog& log, absl::string_view method)
    : metrics_(&metrics), log_(&log), method_(method), start_(absl::Now()) {
  metrics_->CallStarted();
}

void CallRecord::Finished(const absl::Status& status, absl::string_view request_id) const {
  const absl::Duration elapsed = absl::Now() - start_;
  metrics_->CallFinished(method_, status.code(), elapsed);
  log_->Record(method_, status, elapsed, request_id);
}

void UnaryCall::Answer(const absl::Status& status, absl::string_view request_id) const {
  record_.Finished(status, request_id);
  reactor_->Finish(ToGrpcStatus(status));
}

absl::Time UnaryCall::deadline() const { return absl::FromChrono(context_->deadline()); }

std::function<bool()> UnaryCall::cancelled() const {
  return [context = context_] { return context->IsCancelled(); };
}

LoaderJob CallJob(const google::protobuf::Message& request, absl::Time deadline,
                  const v1::AttentionOptions* options, std::function<bool()> is_cancelled) {
  LoaderJob job;
  job.bytes = static_cast<int64_t>(request.ByteSizeLong());
  job.deadline = deadline;
  if (options != nullptr) {
    // A bad queue_timeout_us is refused later, by the request's own validation.
    job.deadline = QueueDeadline(*options, deadline, absl::Now()).value_or(deadline);
  }
  job.is_cancelled = std::move(is_cancelled);
  return job;
}

void AnswerFromLoader(LoaderPool& loader, const UnaryCall& call,
                      const google::protobuf::Message& request,
                      std::function<absl::Status()> work) {
  LoaderJob job = CallJob(request, call.deadline(), nullptr, call.cancelled());
  job.work = std::move(work);
  job.done = [call](const absl::Status& result) { call.Answer(result); };
  const absl::Status submitted = loader.Submit(std::move(job));
  if (!submitted.ok()) call.Answer(submitted);
}

}  // namespace attention::server

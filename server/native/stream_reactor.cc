// The native API's bidirectional stream (MultiHeadAttentionStream): requests go through
// the same submission as unary calls; this file holds the stream's flow control.
#include <deque>
#include <memory>
#include <string>

#include "core/mutex.h"
#include "core/status_macros.h"
#include "server/native/attention_service.h"

namespace attention::server {

// One bidirectional stream. Requests are read one at a time and queued like unary calls;
// answers are written in completion order, one write in flight as gRPC requires. At most
// kMaxPendingPerStream requests may be read and not yet written: past that the reactor stops
// reading, so a caller that does not read its answers is held back by HTTP/2 flow control
// instead of growing server memory.
class MultiHeadAttentionStreamReactor final
    : public grpc::ServerBidiReactor<v1::MultiHeadAttentionRequest,
                                     v1::MultiHeadAttentionStreamResponse> {
 public:
  static constexpr int kMaxPendingPerStream = 32;

  MultiHeadAttentionStreamReactor(AttentionServiceImpl& service,
                                  grpc::CallbackServerContext* context)
      : service_(service), context_(context) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the caller closed its side, or the stream broke
      core::MutexLock lock(mu_);
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    const CallRecord record(service_.metrics_, service_.log_, "MultiHeadAttentionStream");
    auto* answer = new v1::MultiHeadAttentionStreamResponse();  // owned by write_queue_ later
    answer->set_request_id(request_.request_id());
    {
      core::MutexLock lock(mu_);
      ++pending_;
    }
    service_.SubmitWithInlineLayer(
        request_, Deadline(context_), [this] { return context_->IsCancelled(); },
        [this, answer, record](const v1::MultiHeadAttentionRequest& request,
                               std::shared_ptr<const LayerSnapshot> inline_layer) {
          return Submit(request, answer, record, std::move(inline_layer));
        },
        [this, answer, record](const absl::Status& status) { Answer(answer, record, status); },
        /*copy_to_build=*/true);  // request_ is reused by the next read
    core::MutexLock lock(mu_);
    if (pending_ < kMaxPendingPerStream) {
      StartRead(&request_);
    } else {
      reading_paused_ = true;
    }
  }

  void OnWriteDone(bool /*ok*/) override {
    // A failed write means the caller is gone; the remaining answers fail the same way.
    core::MutexLock lock(mu_);
    write_queue_.pop_front();
    --pending_;
    if (reading_paused_ && pending_ < kMaxPendingPerStream) {
      reading_paused_ = false;
      StartRead(&request_);
    }
    if (!write_queue_.empty()) {
      StartWrite(write_queue_.front().get());
    } else {
      writing_ = false;
      MaybeFinishLocked();
    }
  }

  void OnDone() override { delete this; }

 private:
  // Validates and queues one request; once queued, its answer comes back through Answer.
  // A refusal is returned for the caller to answer.
  absl::Status Submit(const v1::MultiHeadAttentionRequest& request,
                      v1::MultiHeadAttentionStreamResponse* answer, const CallRecord& record,
                      std::shared_ptr<const LayerSnapshot> inline_layer) {
    return service_.SubmitMultiHeadAttention(
        request, Deadline(context_), [this] { return context_->IsCancelled(); },
        answer->mutable_response(),
        [this, answer, record](const absl::Status& result) { Answer(answer, record, result); },
        /*borrow_inputs=*/false, std::move(inline_layer));
  }

  // Records the answer for one request (on a batch worker, or the reader on rejection).
  void Answer(v1::MultiHeadAttentionStreamResponse* answer, const CallRecord& record,
              const absl::Status& result) {
    record.Finished(result, answer->request_id());
    if (!result.ok()) {
      answer->clear_response();
      answer->set_error_code(static_cast<int>(result.code()));
      answer->set_error_message(std::string(result.message()));
    }
    core::MutexLock lock(mu_);
    write_queue_.emplace_back(answer);
    if (!writing_) {
      writing_ = true;
      StartWrite(write_queue_.front().get());
    }
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reads_done_ && pending_ == 0 && !writing_ && !finished_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  AttentionServiceImpl& service_;
  grpc::CallbackServerContext* const context_;
  v1::MultiHeadAttentionRequest request_;  // only touched by the read path
  core::Mutex mu_;  // see core/mutex.h
  std::deque<std::unique_ptr<v1::MultiHeadAttentionStreamResponse>> write_queue_
      ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;  // read, not yet written
  bool reading_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerBidiReactor<v1::MultiHeadAttentionRequest, v1::MultiHeadAttentionStreamResponse>*
AttentionServiceImpl::MultiHeadAttentionStream(grpc::CallbackServerContext* context) {
  return new MultiHeadAttentionStreamReactor(*this, context);
}

}  // namespace attention::server

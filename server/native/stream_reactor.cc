// The native API's bidirectional streams (MultiHeadAttentionStream, SessionStepStream):
// requests go through the same submission as unary calls; this file holds the streams'
// flow control, written once for both.
#include <deque>
#include <memory>
#include <string>

#include "core/mutex.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"
#include "server/native/attention_service.h"

namespace attention::server {

// One bidirectional stream. Requests are read one at a time and queued like unary calls;
// answers are written in completion order, one write in flight as gRPC requires. At most
// kMaxPendingPerStream requests may be read and not yet written: past that the reactor stops
// reading, so a caller that does not read its answers is held back by HTTP/2 flow control
// instead of growing server memory. A subclass submits each request (SubmitRead) and its
// answer comes back through Answer, with the error in the answer when it failed.
template <typename Request, typename StreamAnswer>
class StreamReactor : public grpc::ServerBidiReactor<Request, StreamAnswer> {
 public:
  static constexpr int kMaxPendingPerStream = 32;

  // Reads the first request; called once the object is fully built (reads complete on
  // gRPC's threads and call SubmitRead).
  void Start() { this->StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the caller closed its side, or the stream broke
      core::MutexLock lock(mu_);
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    const CallRecord record(service_.metrics_, service_.log_, method_);
    auto* answer = new StreamAnswer();  // owned by write_queue_ later
    answer->set_request_id(request_.request_id());
    {
      core::MutexLock lock(mu_);
      ++pending_;
    }
    SubmitRead(request_, answer, record);  // request_ is reused by the next read
    core::MutexLock lock(mu_);
    if (pending_ < kMaxPendingPerStream) {
      this->StartRead(&request_);
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
      this->StartRead(&request_);
    }
    if (!write_queue_.empty()) {
      this->StartWrite(write_queue_.front().get());
    } else {
      writing_ = false;
      MaybeFinishLocked();
    }
  }

  void OnDone() override { delete this; }

 protected:
  StreamReactor(AttentionServiceImpl& service, grpc::CallbackServerContext* context,
                const char* method)
      : service_(service), context_(context), method_(method) {}

  // Validates and queues one request, or answers its refusal; either way Answer is called
  // once for `answer`. `request` is only valid during the call.
  virtual void SubmitRead(const Request& request, StreamAnswer* answer,
                          const CallRecord& record) = 0;

  // Records the answer for one request (on a batch worker, or the reader on refusal).
  void Answer(StreamAnswer* answer, const CallRecord& record, const absl::Status& result) {
    record.Finished(result, answer->request_id());
    if (!result.ok()) {
      answer->clear_response();
      answer->set_error_code(static_cast<int>(result.code()));
      answer->set_error_message(BoundedMessage(result.message()));
      answer->set_error_reason(ReasonOf(result));
    }
    core::MutexLock lock(mu_);
    write_queue_.emplace_back(answer);
    if (!writing_) {
      writing_ = true;
      this->StartWrite(write_queue_.front().get());
    }
  }

  AttentionServiceImpl& service_;
  grpc::CallbackServerContext* const context_;

 private:
  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (reads_done_ && pending_ == 0 && !writing_ && !finished_) {
      finished_ = true;
      this->Finish(grpc::Status::OK);
    }
  }

  const char* const method_;
  Request request_;  // only touched by the read path
  core::Mutex mu_;   // see core/mutex.h
  std::deque<std::unique_ptr<StreamAnswer>> write_queue_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;  // read, not yet written
  bool reading_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

class MultiHeadAttentionStreamReactor final
    : public StreamReactor<v1::MultiHeadAttentionRequest, v1::MultiHeadAttentionStreamResponse> {
 public:
  MultiHeadAttentionStreamReactor(AttentionServiceImpl& service,
                                  grpc::CallbackServerContext* context)
      : StreamReactor(service, context, "MultiHeadAttentionStream") {}

 private:
  void SubmitRead(const v1::MultiHeadAttentionRequest& request,
                  v1::MultiHeadAttentionStreamResponse* answer, const CallRecord& record) override {
    service_.SubmitWithInlineLayer(
        request, Deadline(context_), [this] { return context_->IsCancelled(); },
        [this, answer, record](const v1::MultiHeadAttentionRequest& submitted,
                               std::shared_ptr<const LayerSnapshot> inline_layer) {
          return CatchExceptions("MultiHeadAttentionStream", [&] {
            return service_.SubmitMultiHeadAttention(
                submitted, Deadline(context_), [this] { return context_->IsCancelled(); },
                answer->mutable_response(),
                [this, answer, record](const absl::Status& result) {
                  Answer(answer, record, result);
                },
                /*borrow_inputs=*/false, std::move(inline_layer));
          });
        },
        [this, answer, record](const absl::Status& status) { Answer(answer, record, status); },
        /*copy_to_build=*/true);  // the request is reused by the next read
  }
};

class SessionStepStreamReactor final
    : public StreamReactor<v1::SessionStepRequest, v1::SessionStepStreamResponse> {
 public:
  SessionStepStreamReactor(AttentionServiceImpl& service, grpc::CallbackServerContext* context)
      : StreamReactor(service, context, "SessionStepStream") {}

 private:
  void SubmitRead(const v1::SessionStepRequest& request, v1::SessionStepStreamResponse* answer,
                  const CallRecord& record) override {
    // The step decodes what it keeps, so the request may be reused once this returns.
    auto finish = [this, answer, record](const absl::Status& result) {
      service_.CountSessionRefusal(result);
      Answer(answer, record, result);
    };
    const absl::Status status = CatchExceptions("SessionStepStream", [&]() -> absl::Status {
      ASSIGN_OR_RETURN(const SessionCaller caller,
                       IdentifySessionCaller(*context_, service_.access_, "SessionStepStream"));
      return service_.SubmitSessionStep(
          request, caller, Deadline(context_), [this] { return context_->IsCancelled(); },
          answer->mutable_response(), finish);
    });
    if (!status.ok()) finish(status);
  }
};

grpc::ServerBidiReactor<v1::MultiHeadAttentionRequest, v1::MultiHeadAttentionStreamResponse>*
AttentionServiceImpl::MultiHeadAttentionStream(grpc::CallbackServerContext* context) {
  auto* reactor = new MultiHeadAttentionStreamReactor(*this, context);
  reactor->Start();
  return reactor;
}

grpc::ServerBidiReactor<v1::SessionStepRequest, v1::SessionStepStreamResponse>*
AttentionServiceImpl::SessionStepStream(grpc::CallbackServerContext* context) {
  auto* reactor = new SessionStepStreamReactor(*this, context);
  reactor->Start();
  return reactor;
}

}  // namespace attention::server

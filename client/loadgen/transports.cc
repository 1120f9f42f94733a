// attention-loadgen's transports: callback-API unary calls and ClientBidiReactor streams.
#include "client/loadgen/transports.h"

#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/support/client_callback.h>

#include "absl/strings/numbers.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/loadgen/clock.h"

namespace attention::loadgen {
namespace {

using StreamResponse = v1::MultiHeadAttentionStreamResponse;

// One callback-API unary call per request.
class UnaryTransport final : public Transport {
 public:
  UnaryTransport(const std::vector<std::shared_ptr<grpc::Channel>>& channels,
                 double request_timeout)
      : request_timeout_(request_timeout) {
    for (const auto& channel : channels) stubs_.push_back(v1::AttentionService::NewStub(channel));
  }

  bool Send(int64_t lane, std::unique_ptr<Request> request, DoneFn done) override {
    auto* call = new Call;
    call->request = std::move(request);
    call->done = std::move(done);
    call->context.set_deadline(SystemDeadline(request_timeout_));
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) {
        delete call;
        return false;
      }
      live_.insert(call);
    }
    v1::AttentionService::Stub* stub = stubs_[lane % stubs_.size()].get();
    stub->async()->MultiHeadAttention(&call->context, call->request.get(), &call->response,
                                      [this, call](const grpc::Status& status) {
                                        {
                                          std::lock_guard<std::mutex> lock(mu_);
                                          live_.erase(call);
                                        }
                                        // The call goes before `done` ends it: its
                                        // ClientContext holds a channel reference that must
                                        // not be the last one, released on a gRPC thread
                                        // after main() has moved on to tear down.
                                        DoneFn done = std::move(call->done);
                                        delete call;
                                        done(status.error_code());
                                      });
    return true;
  }

  void CancelAll() override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    for (Call* call : live_) call->context.TryCancel();
  }

  void CloseAndWait() override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }

 private:
  struct Call {
    grpc::ClientContext context;
    std::unique_ptr<Request> request;
    v1::MultiHeadAttentionResponse response;
    DoneFn done;
  };

  const double request_timeout_;
  std::vector<std::unique_ptr<v1::AttentionService::Stub>> stubs_;
  std::mutex mu_;
  std::unordered_set<Call*> live_;  // guarded by mu_; a call is alive while in here
  bool closed_ = false;             // guarded by mu_
};

// One bidirectional stream. Writes go through a queue (gRPC allows one write in flight);
// one read is always outstanding; answers are matched by request_id. A hold keeps the
// stream alive for writes started outside reactions; it is released by Close() or when the
// stream ends from the server's side. Thread-safe.
class StreamConnection final : public grpc::ClientBidiReactor<Request, StreamResponse> {
 public:
  StreamConnection(v1::AttentionService::Stub* stub,
                   std::chrono::system_clock::time_point deadline) {
    context_.set_deadline(deadline);
    stub->async()->MultiHeadAttentionStream(&context_, this);
    AddHold();
    StartRead(&response_);
    StartCall();
  }

  bool Send(std::unique_ptr<Request> request, DoneFn done) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_ || broken_) return false;
    const uint64_t id = next_id_++;
    request->set_request_id(std::to_string(id));
    pending_.emplace(id, std::move(done));
    write_queue_.push_back(std::move(request));
    if (!writing_) {
      writing_ = true;
      StartWrite(write_queue_.front().get());
    }
    return true;
  }

  void Close() {
    bool remove_hold = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closing_) return;
      closing_ = true;
      if (!writing_) remove_hold = FinishWritesLocked();
    }
    if (remove_hold) RemoveHold();
  }

  void Cancel() { context_.TryCancel(); }

  void WaitDone() {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return done_; });
  }

  void OnWriteDone(bool ok) override {
    bool remove_hold = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      write_queue_.pop_front();
      if (!ok) broken_ = true;  // the stream is gone; OnDone fails what is pending
      if (!broken_ && !write_queue_.empty()) {
        StartWrite(write_queue_.front().get());
      } else {
        writing_ = false;
        if (closing_) remove_hold = FinishWritesLocked();
      }
    }
    if (remove_hold) RemoveHold();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the server finished the stream, or it broke: nothing more will come
      bool remove_hold = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        broken_ = true;
        if (!hold_removed_) {
          hold_removed_ = true;
          remove_hold = true;
        }
      }
      if (remove_hold) RemoveHold();
      return;
    }
    DoneFn done;
    uint64_t id = 0;
    if (absl::SimpleAtoi(response_.request_id(), &id)) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(id);
      if (it != pending_.end()) {
        done = std::move(it->second);
        pending_.erase(it);
      }
    }
    const int code = response_.error_code();
    response_.Clear();
    StartRead(&response_);
    if (done) done(static_cast<grpc::StatusCode>(code));
  }

  void OnDone(const grpc::Status& status) override {
    std::unordered_map<uint64_t, DoneFn> unanswered;
    {
      std::lock_guard<std::mutex> lock(mu_);
      unanswered.swap(pending_);
    }
    // A stream that ended with OK but left requests unanswered is a server bug: UNKNOWN.
    const grpc::StatusCode code = status.ok() ? grpc::StatusCode::UNKNOWN : status.error_code();
    for (auto& [id, done] : unanswered) done(code);
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    done_cv_.notify_all();
  }

 private:
  // After the last write: half-closes the stream (unless it broke) and says whether the
  // caller must release the hold (outside the lock).
  bool FinishWritesLocked() {
    if (!broken_) StartWritesDone();
    if (hold_removed_) return false;
    hold_removed_ = true;
    return true;
  }

  grpc::ClientContext context_;
  StreamResponse response_;  // only touched by the read path
  std::mutex mu_;
  std::condition_variable done_cv_;
  std::deque<std::unique_ptr<Request>> write_queue_;  // guarded by mu_; front is in flight
  std::unordered_map<uint64_t, DoneFn> pending_;      // guarded by mu_; sent, not answered
  uint64_t next_id_ = 0;                              // guarded by mu_
  bool writing_ = false;                              // guarded by mu_
  bool closing_ = false;                              // guarded by mu_
  bool broken_ = false;                               // guarded by mu_
  bool hold_removed_ = false;                         // guarded by mu_
  bool done_ = false;                                 // guarded by mu_
};

class StreamTransport final : public Transport {
 public:
  StreamTransport(const std::vector<std::shared_ptr<grpc::Channel>>& channels, int streams,
                  std::chrono::system_clock::time_point deadline) {
    for (const auto& channel : channels) stubs_.push_back(v1::AttentionService::NewStub(channel));
    for (int i = 0; i < streams; ++i) {
      streams_.push_back(
          std::make_unique<StreamConnection>(stubs_[i % stubs_.size()].get(), deadline));
    }
  }

  bool Send(int64_t lane, std::unique_ptr<Request> request, DoneFn done) override {
    return streams_[lane % streams_.size()]->Send(std::move(request), std::move(done));
  }

  void CancelAll() override {
    for (auto& stream : streams_) stream->Cancel();
    for (auto& stream : streams_) stream->Close();
  }

  void CloseAndWait() override {
    for (auto& stream : streams_) stream->Close();
    for (auto& stream : streams_) stream->WaitDone();
  }

 private:
  std::vector<std::unique_ptr<v1::AttentionService::Stub>> stubs_;
  std::vector<std::unique_ptr<StreamConnection>> streams_;
};

}  // namespace

std::vector<std::shared_ptr<grpc::Channel>> MakeChannels(const Config& config) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < config.connections; ++i) {
    // Message limits (wire::kDefaultMaxMessageBytes), TLS name and --lb_policy.
    grpc::ChannelArguments arguments = client::ChannelArgumentsFor(config.connection);
    // A private subchannel pool per channel, so that each one is its own TCP connection.
    arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    arguments.SetInt("attention_loadgen.connection", i);
    channels.push_back(grpc::CreateCustomChannel(config.target, config.credentials, arguments));
  }
  return channels;
}

std::unique_ptr<Transport> MakeUnaryTransport(
    const std::vector<std::shared_ptr<grpc::Channel>>& channels, double request_timeout) {
  return std::make_unique<UnaryTransport>(channels, request_timeout);
}

std::unique_ptr<Transport> MakeStreamTransport(
    const std::vector<std::shared_ptr<grpc::Channel>>& channels, int streams,
    std::chrono::system_clock::time_point deadline) {
  return std::make_unique<StreamTransport>(channels, streams, deadline);
}

}  // namespace attention::loadgen

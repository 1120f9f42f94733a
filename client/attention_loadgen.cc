// attention-loadgen: a load generator for attention.v1.AttentionService.MultiHeadAttention,
// in the spirit of ghz and Triton's perf_analyzer.
//
// Loops
//   closed loop (--rate=0, the default): --concurrency callers; each sends its next request
//     when the answer to the previous one arrives. Latency runs from the send to the answer.
//   open loop (--rate=R > 0): requests arrive as a Poisson process of rate R requests/s
//     (exponential inter-arrival times from a generator seeded with --seed) and are sent
//     whatever happens to earlier ones, through the asynchronous callback API, so slow answers
//     never slow the arrival process. Latency runs from the scheduled arrival time to the
//     answer (so a client that falls behind its schedule shows up in the latency instead of
//     hiding it, i.e. no coordinated omission). An arrival that finds --max_outstanding
//     requests unanswered, or a broken stream, is not sent and is counted as "not sent".
//
// Transports
//   --mode=unary: one MultiHeadAttention call per request (stub->async() with a callback).
//   --mode=stream: bidirectional MultiHeadAttentionStream(s) driven by a ClientBidiReactor;
//     answers are matched to requests by request_id (they may come back out of order) and a
//     per-request error_code counts as that request's error. Stream count (--streams):
//     0 (default) means one stream per caller in closed loop (each caller owns its stream,
//     so callers never queue behind each other on the client) and 4 streams in open loop
//     (arrivals go round-robin; the server reads at most 32 unanswered requests per stream,
//     so the default allows 128 in flight before HTTP/2 flow control holds requests in the
//     client's write queue, where their wait counts as latency). --streams=S < concurrency
//     makes closed-loop caller i share stream i % S.
//   --connections=K spreads callers / streams round-robin over K separate HTTP/2 connections.
//
// Measurement window
//   The run lasts --warmup + --duration seconds. Only requests issued (closed loop) or
//   scheduled (open loop) inside the last --duration seconds are counted: requests/s and
//   tokens/s are the counted successful answers (and their query tokens, batch * sequence
//   length each) divided by --duration. Latency percentiles are exact nearest-rank values
//   over every counted successful request (the value at rank ceil(p * n) of the sorted
//   latencies), not histogram estimates. Failed requests are counted by gRPC status code name
//   and are not in the latency figures.
//
// Shutdown
//   At the end of the window no new request is issued; the tool waits up to
//   --drain_timeout seconds for outstanding answers, then cancels what is left and counts it
//   as "unanswered". Streams are closed with WritesDone and waited for.
//
// Exit status: 0 when the run completed (whatever the requests' outcome; read the report),
// 1 when the server cannot be reached or the layer looked up, 2 for bad flags.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/client_callback.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "attention_version.h"
#include "client/attention_client.h"
#include "client/connection_flags.h"
#include "core/dtype.h"
#include "core/json_text.h"

ABSL_FLAG(std::string, target, "localhost:50051", "server address");
ABSL_FLAG(std::string, layer, "demo-bert-base", "name of a layer loaded on the server");
ABSL_FLAG(std::string, mode, "unary", "transport: unary or stream");
ABSL_FLAG(int, concurrency, 1, "closed loop: number of callers, each with one request in flight");
ABSL_FLAG(double, rate, 0,
          "open loop: mean arrival rate in requests/s (Poisson arrivals); 0 = closed loop");
ABSL_FLAG(int, streams, 0,
          "stream mode: number of streams; 0 = one per caller (closed loop) or 4 (open loop)");
ABSL_FLAG(int, connections, 1, "number of separate HTTP/2 connections (channels)");
ABSL_FLAG(int64_t, batch, 1, "sequences per request (B of the query [B, N, E])");
ABSL_FLAG(std::string, tokens, "16",
          "sequence length N per request: a number, or LO:HI for a length drawn uniformly "
          "from [LO, HI] for each request");
ABSL_FLAG(int64_t, embed_dim, 0,
          "E of the query; 0 = ask the server (GetLayer); set it to skip the lookup");
ABSL_FLAG(int64_t, inline_layer_heads, 0,
          "when > 0, every request carries an inline layer instead of naming --layer: "
          "embed_dim --embed_dim (required), this many heads, random init seeded by "
          "--inline_layer_seed (the same layer in every request)");
ABSL_FLAG(uint64_t, inline_layer_seed, 1, "seed of the inline layer's random weights");
ABSL_FLAG(std::string, dtype, "float32", "wire dtype: float32, float16 or bfloat16");
ABSL_FLAG(bool, causal, false, "causal attention");
ABSL_FLAG(double, duration, 10, "measured seconds");
ABSL_FLAG(double, warmup, 1, "seconds of load before the measurement starts (not counted)");
ABSL_FLAG(uint64_t, seed, 1, "seed of arrivals, sequence lengths and payload values");
ABSL_FLAG(double, drain_timeout, 10,
          "seconds to wait for outstanding answers after the run before cancelling them");
ABSL_FLAG(double, request_timeout, 60, "unary mode: deadline of each call, seconds");
ABSL_FLAG(int64_t, max_outstanding, 10000,
          "open loop: an arrival finding this many requests unanswered is not sent");
ABSL_FLAG(std::string, json, "", "also write the report as JSON to this path");

namespace {

namespace v1 = attention::v1;
using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
using Request = v1::MultiHeadAttentionRequest;
using StreamResponse = v1::MultiHeadAttentionStreamResponse;

// google.rpc.Code names, indexed by code.
const char* StatusCodeName(int code) {
  static const char* const kNames[] = {
      "OK",        "CANCELLED",          "UNKNOWN",           "INVALID_ARGUMENT",
      "DEADLINE_EXCEEDED", "NOT_FOUND",   "ALREADY_EXISTS",    "PERMISSION_DENIED",
      "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL",        "UNAVAILABLE",       "DATA_LOSS",
      "UNAUTHENTICATED"};
  if (code < 0 || code > 16) return "INVALID_CODE";
  return kNames[code];
}

TimePoint After(TimePoint t, double seconds) {
  return t + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// gRPC deadlines take the system clock.
std::chrono::system_clock::time_point SystemDeadline(double seconds_from_now) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             std::chrono::duration<double>(seconds_from_now));
}

// ---------------------------------------------------------------------------------------
// Configuration.

struct Config {
  std::string target;
  attention::client::ClientOptions connection;  // TLS, from the shared connection flags
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string layer;
  bool stream = false;
  bool open_loop = false;
  int concurrency = 1;
  double rate = 0;
  int streams = 0;  // resolved: > 0 in stream mode
  int connections = 1;
  int64_t batch = 1;
  int64_t min_tokens = 16;
  int64_t max_tokens = 16;
  std::string tokens_flag;
  int64_t embed_dim = 0;
  int64_t inline_layer_heads = 0;  // > 0: requests carry an inline layer
  uint64_t inline_layer_seed = 1;
  std::string dtype_name;
  attention::core::DType dtype = attention::core::DType::kFloat32;
  bool causal = false;
  double duration = 10;
  double warmup = 1;
  uint64_t seed = 1;
  double drain_timeout = 10;
  double request_timeout = 60;
  int64_t max_outstanding = 10000;
  std::string json_path;
};

bool ParseTokens(const std::string& text, int64_t* lo, int64_t* hi) {
  const std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() == 1) {
    if (!absl::SimpleAtoi(parts[0], lo)) return false;
    *hi = *lo;
  } else if (parts.size() == 2) {
    if (!absl::SimpleAtoi(parts[0], lo) || !absl::SimpleAtoi(parts[1], hi)) return false;
  } else {
    return false;
  }
  return *lo >= 1 && *hi >= *lo;
}

// Reads and checks the flags; on error prints the reason and returns false.
bool ReadConfig(Config* c) {
  auto fail = [](const std::string& message) {
    std::cerr << "attention-loadgen: " << message << std::endl;
    return false;
  };
  c->target = absl::GetFlag(FLAGS_target);
  auto connection = attention::client::ClientOptionsFromFlags();
  if (!connection.ok()) return fail(std::string(connection.status().message()));
  c->connection = *std::move(connection);
  c->connection.max_message_bytes = attention::wire::kDefaultMaxMessageBytes;
  auto credentials = attention::client::ChannelCredentials(c->connection);
  if (!credentials.ok()) return fail(std::string(credentials.status().message()));
  c->credentials = *std::move(credentials);
  c->layer = absl::GetFlag(FLAGS_layer);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "unary" && mode != "stream") return fail("--mode must be unary or stream, not " + mode);
  c->stream = mode == "stream";
  c->rate = absl::GetFlag(FLAGS_rate);
  if (!(c->rate >= 0) || !std::isfinite(c->rate)) return fail("--rate must be >= 0");
  c->open_loop = c->rate > 0;
  c->concurrency = absl::GetFlag(FLAGS_concurrency);
  if (c->concurrency < 1) return fail(absl::StrCat("--concurrency must be >= 1, not ", c->concurrency));
  c->streams = absl::GetFlag(FLAGS_streams);
  if (c->streams < 0) return fail(absl::StrCat("--streams must be >= 0, not ", c->streams));
  if (c->streams == 0) c->streams = c->open_loop ? 4 : c->concurrency;
  c->connections = absl::GetFlag(FLAGS_connections);
  if (c->connections < 1) return fail(absl::StrCat("--connections must be >= 1, not ", c->connections));
  c->batch = absl::GetFlag(FLAGS_batch);
  if (c->batch < 1) return fail(absl::StrCat("--batch must be >= 1, not ", c->batch));
  c->tokens_flag = absl::GetFlag(FLAGS_tokens);
  if (!ParseTokens(c->tokens_flag, &c->min_tokens, &c->max_tokens)) {
    return fail("--tokens must be N or LO:HI with 1 <= LO <= HI, not '" + c->tokens_flag + "'");
  }
  c->embed_dim = absl::GetFlag(FLAGS_embed_dim);
  if (c->embed_dim < 0) return fail(absl::StrCat("--embed_dim must be >= 0, not ", c->embed_dim));
  c->inline_layer_heads = absl::GetFlag(FLAGS_inline_layer_heads);
  c->inline_layer_seed = absl::GetFlag(FLAGS_inline_layer_seed);
  if (c->inline_layer_heads < 0) {
    return fail(absl::StrCat("--inline_layer_heads must be >= 0, not ", c->inline_layer_heads));
  }
  if (c->inline_layer_heads > 0 && c->embed_dim == 0) {
    return fail("--inline_layer_heads needs --embed_dim (there is no layer to ask)");
  }
  c->dtype_name = absl::GetFlag(FLAGS_dtype);
  if (c->dtype_name == "float32") {
    c->dtype = attention::core::DType::kFloat32;
  } else if (c->dtype_name == "float16") {
    c->dtype = attention::core::DType::kFloat16;
  } else if (c->dtype_name == "bfloat16") {
    c->dtype = attention::core::DType::kBFloat16;
  } else {
    return fail("--dtype must be float32, float16 or bfloat16, not " + c->dtype_name);
  }
  c->causal = absl::GetFlag(FLAGS_causal);
  c->duration = absl::GetFlag(FLAGS_duration);
  if (!(c->duration > 0) || !std::isfinite(c->duration)) return fail("--duration must be > 0");
  c->warmup = absl::GetFlag(FLAGS_warmup);
  if (!(c->warmup >= 0) || !std::isfinite(c->warmup)) return fail("--warmup must be >= 0");
  c->seed = absl::GetFlag(FLAGS_seed);
  c->drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  if (!(c->drain_timeout >= 0) || !std::isfinite(c->drain_timeout)) {
    return fail("--drain_timeout must be >= 0");
  }
  c->request_timeout = absl::GetFlag(FLAGS_request_timeout);
  if (!(c->request_timeout > 0) || !std::isfinite(c->request_timeout)) {
    return fail("--request_timeout must be > 0");
  }
  c->max_outstanding = absl::GetFlag(FLAGS_max_outstanding);
  if (c->max_outstanding < 1) return fail("--max_outstanding must be >= 1");
  c->json_path = absl::GetFlag(FLAGS_json);
  return true;
}

// ---------------------------------------------------------------------------------------
// Requests.

// Builds requests from one pre-encoded payload of random N(0, 1) values (enough for the
// longest sequence); a request of N tokens carries its first B * N * E elements.
// Thread-safe (immutable after construction).
class RequestFactory {
 public:
  explicit RequestFactory(const Config& config) : config_(config) {
    const int64_t count = config.batch * config.max_tokens * config.embed_dim;
    std::mt19937_64 rng(config.seed ^ 0x9e3779b97f4a7c15ULL);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> values(count);
    for (float& v : values) v = normal(rng);
    payload_ = attention::core::EncodeFloats(values, config.dtype);
    element_size_ = attention::core::ElementSize(config.dtype);
    wire_dtype_ = attention::wire::WireDType(config.dtype);
  }

  std::unique_ptr<Request> Make(int64_t tokens) const {
    auto request = std::make_unique<Request>();
    if (config_.inline_layer_heads > 0) {
      v1::LayerSpec* spec = request->mutable_inline_layer();
      spec->mutable_config()->set_embed_dim(config_.embed_dim);
      spec->mutable_config()->set_num_heads(config_.inline_layer_heads);
      spec->mutable_random_init()->set_seed(config_.inline_layer_seed);
    } else {
      request->set_layer(config_.layer);
    }
    v1::Tensor* query = request->mutable_query();
    query->set_dtype(wire_dtype_);
    query->add_shape(config_.batch);
    query->add_shape(tokens);
    query->add_shape(config_.embed_dim);
    query->set_raw_data(payload_.data(),
                        static_cast<size_t>(config_.batch * tokens * config_.embed_dim *
                                            element_size_));
    if (config_.causal) request->mutable_options()->set_causal(true);
    return request;
  }

  // Query tokens answered by a request of sequence length `tokens`.
  int64_t QueryTokens(int64_t tokens) const { return config_.batch * tokens; }

  int64_t PickLength(std::mt19937_64& rng) const {
    if (config_.min_tokens == config_.max_tokens) return config_.min_tokens;
    return std::uniform_int_distribution<int64_t>(config_.min_tokens, config_.max_tokens)(rng);
  }

 private:
  const Config& config_;
  std::string payload_;
  int64_t element_size_ = 4;
  v1::DataType wire_dtype_ = v1::FLOAT32;
};

// ---------------------------------------------------------------------------------------
// Bookkeeping.

// Counts requests issued and not yet finished; lets the main thread wait for zero.
// Thread-safe.
class InFlight {
 public:
  void Begin() {
    std::lock_guard<std::mutex> lock(mu_);
    ++count_;
  }
  void End() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--count_ == 0) zero_.notify_all();
  }
  int64_t Count() {
    std::lock_guard<std::mutex> lock(mu_);
    return count_;
  }
  // True when the count reached zero before `deadline`.
  bool WaitZeroUntil(TimePoint deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    return zero_.wait_until(lock, deadline, [this] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable zero_;
  int64_t count_ = 0;
};

struct LatencySummary {
  int64_t count = 0;
  double mean_ms = 0, min_ms = 0, p50_ms = 0, p90_ms = 0, p99_ms = 0, p999_ms = 0, max_ms = 0;
};

struct Report {
  double window_seconds = 0;
  int64_t requests = 0;  // successful answers in the window
  int64_t tokens = 0;    // their query tokens
  int64_t sent = 0;      // window requests sent (answered, failed or unanswered)
  int64_t errors = 0;
  std::map<std::string, int64_t> errors_by_code;
  int64_t not_sent = 0;
  int64_t unanswered = 0;
  LatencySummary latency;
  double max_send_lag_ms = 0;  // open loop: worst delay of a send behind its schedule
};

// Exact nearest-rank percentile of sorted values: the value at rank ceil(p * n).
double Percentile(const std::vector<int64_t>& sorted_ns, double p) {
  const size_t n = sorted_ns.size();
  size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(n)));
  rank = std::min(std::max<size_t>(rank, 1), n);
  return static_cast<double>(sorted_ns[rank - 1]) / 1e6;
}

// Outcomes of the requests that belong to the measurement window. Thread-safe.
class Recorder {
 public:
  Recorder(TimePoint window_begin, TimePoint window_end)
      : begin_(window_begin), end_(window_end) {}

  void Ok(TimePoint start, TimePoint finish, int64_t tokens) {
    if (!InWindow(start)) return;
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(finish - start).count();
    std::lock_guard<std::mutex> lock(mu_);
    latencies_ns_.push_back(ns);
    tokens_ += tokens;
  }
  void Error(TimePoint start, int code) {
    if (!InWindow(start)) return;
    std::lock_guard<std::mutex> lock(mu_);
    ++errors_[code];
  }
  void Unanswered(TimePoint start) {
    if (!InWindow(start)) return;
    std::lock_guard<std::mutex> lock(mu_);
    ++unanswered_;
  }
  void NotSent(TimePoint start) {
    if (!InWindow(start)) return;
    std::lock_guard<std::mutex> lock(mu_);
    ++not_sent_;
  }
  void SendLag(TimePoint scheduled, TimePoint sent) {
    if (!InWindow(scheduled)) return;
    const double ms = std::chrono::duration<double, std::milli>(sent - scheduled).count();
    std::lock_guard<std::mutex> lock(mu_);
    max_send_lag_ms_ = std::max(max_send_lag_ms_, ms);
  }

  Report Summarize() {
    std::lock_guard<std::mutex> lock(mu_);
    Report r;
    r.window_seconds = std::chrono::duration<double>(end_ - begin_).count();
    r.requests = static_cast<int64_t>(latencies_ns_.size());
    r.tokens = tokens_;
    for (const auto& [code, count] : errors_) {
      r.errors += count;
      r.errors_by_code[StatusCodeName(code)] += count;
    }
    r.not_sent = not_sent_;
    r.unanswered = unanswered_;
    r.sent = r.requests + r.errors + r.unanswered;
    r.max_send_lag_ms = max_send_lag_ms_;
    std::sort(latencies_ns_.begin(), latencies_ns_.end());
    LatencySummary& l = r.latency;
    l.count = r.requests;
    if (l.count > 0) {
      long double sum = 0;
      for (int64_t ns : latencies_ns_) sum += ns;
      l.mean_ms = static_cast<double>(sum / l.count / 1e6L);
      l.min_ms = static_cast<double>(latencies_ns_.front()) / 1e6;
      l.max_ms = static_cast<double>(latencies_ns_.back()) / 1e6;
      l.p50_ms = Percentile(latencies_ns_, 0.50);
      l.p90_ms = Percentile(latencies_ns_, 0.90);
      l.p99_ms = Percentile(latencies_ns_, 0.99);
      l.p999_ms = Percentile(latencies_ns_, 0.999);
    }
    return r;
  }

 private:
  bool InWindow(TimePoint t) const { return t >= begin_ && t < end_; }

  const TimePoint begin_, end_;
  std::mutex mu_;
  std::vector<int64_t> latencies_ns_;
  int64_t tokens_ = 0;
  std::map<int, int64_t> errors_;
  int64_t unanswered_ = 0;
  int64_t not_sent_ = 0;
  double max_send_lag_ms_ = 0;
};

// ---------------------------------------------------------------------------------------
// Transports.

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

std::vector<std::shared_ptr<grpc::Channel>> MakeChannels(const Config& config) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < config.connections; ++i) {
    // Message limits (wire::kDefaultMaxMessageBytes), TLS name and --lb_policy.
    grpc::ChannelArguments arguments = attention::client::ChannelArgumentsFor(config.connection);
    // A private subchannel pool per channel, so that each one is its own TCP connection.
    arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    arguments.SetInt("attention_loadgen.connection", i);
    channels.push_back(grpc::CreateCustomChannel(config.target, config.credentials, arguments));
  }
  return channels;
}

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

// ---------------------------------------------------------------------------------------
// Load drivers.

// Shared state of one run: the window, the recorder and the flags that end it.
// Thread-safe.
class Run {
 public:
  Run(const Config& config, const RequestFactory& factory, Transport& transport,
      TimePoint start)
      : config_(config),
        factory_(factory),
        transport_(transport),
        start_(start),
        window_begin_(After(start, config.warmup)),
        end_(After(window_begin_, config.duration)),
        recorder_(window_begin_, end_) {}

  TimePoint start() const { return start_; }
  TimePoint end() const { return end_; }
  bool Stopped() const { return stopped_.load(std::memory_order_acquire); }
  InFlight& in_flight() { return in_flight_; }
  Recorder& recorder() { return recorder_; }

  // Issues one request of `tokens` tokens whose latency counts from `start`; `then` runs
  // after its outcome is recorded and before it stops counting as in flight (so a closed
  // loop caller can issue its next request without the count touching zero in between).
  // Returns false (and records "not sent") when it cannot be sent.
  bool Issue(int64_t lane, int64_t tokens, TimePoint start, std::function<void()> then) {
    in_flight_.Begin();
    const int64_t query_tokens = factory_.QueryTokens(tokens);
    const bool sent = transport_.Send(
        lane, factory_.Make(tokens),
        [this, start, query_tokens, then = std::move(then)](grpc::StatusCode code) {
          const TimePoint finish = Clock::now();
          if (code == grpc::StatusCode::OK) {
            recorder_.Ok(start, finish, query_tokens);
          } else if (drain_cancelled_.load(std::memory_order_acquire)) {
            recorder_.Unanswered(start);
          } else {
            recorder_.Error(start, code);
          }
          if (then) then();
          in_flight_.End();
        });
    if (!sent) {
      if (drain_cancelled_.load(std::memory_order_acquire)) {
        recorder_.Unanswered(start);
      } else {
        recorder_.NotSent(start);
      }
      in_flight_.End();
    }
    return sent;
  }

  // After the load: waits for outstanding answers until the drain deadline, cancels the
  // rest, closes the transport and waits for it.
  void Drain() {
    const TimePoint deadline = After(std::max(Clock::now(), end_), config_.drain_timeout);
    if (!in_flight_.WaitZeroUntil(deadline)) {
      std::fprintf(stderr,
                   "attention-loadgen: %" PRId64
                   " requests still unanswered after --drain_timeout=%g s; cancelling them\n",
                   in_flight_.Count(), config_.drain_timeout);
      drain_cancelled_.store(true, std::memory_order_release);
      stopped_.store(true, std::memory_order_release);
      transport_.CancelAll();
      if (!in_flight_.WaitZeroUntil(After(Clock::now(), 60))) {
        std::fprintf(stderr, "attention-loadgen: cancelled requests did not finish\n");
        std::abort();
      }
    }
    transport_.CloseAndWait();
  }

 private:
  const Config& config_;
  const RequestFactory& factory_;
  Transport& transport_;
  const TimePoint start_, window_begin_, end_;
  InFlight in_flight_;
  Recorder recorder_;
  std::atomic<bool> stopped_{false};
  std::atomic<bool> drain_cancelled_{false};
};

// Generator of closed-loop caller `index`: seeded with (seed, index).
std::mt19937_64 CallerRng(uint64_t seed, int index) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(index)};
  return std::mt19937_64(seq);
}

// Closed loop: one caller with one request in flight; the next one goes out from the
// answer's callback. Its generator is only touched by the one call chain, in sequence.
class Caller {
 public:
  Caller(Run& run, const RequestFactory& factory, int index, uint64_t seed)
      : run_(run), factory_(factory), index_(index), rng_(CallerRng(seed, index)) {}

  void Next() {
    const TimePoint now = Clock::now();
    if (run_.Stopped() || now >= run_.end()) return;
    run_.Issue(index_, factory_.PickLength(rng_), now, [this] { Next(); });
  }

 private:
  Run& run_;
  const RequestFactory& factory_;
  const int index_;
  std::mt19937_64 rng_;
};

void RunClosedLoop(const Config& config, Run& run, const RequestFactory& factory) {
  std::vector<std::unique_ptr<Caller>> callers;
  for (int i = 0; i < config.concurrency; ++i) {
    callers.push_back(std::make_unique<Caller>(run, factory, i, config.seed));
  }
  for (auto& caller : callers) caller->Next();
  std::this_thread::sleep_until(run.end());  // the callers run on gRPC's threads
  run.Drain();
}

// Open loop: this thread sleeps until each scheduled arrival and sends it.
void RunOpenLoop(const Config& config, Run& run, const RequestFactory& factory) {
  std::mt19937_64 rng(config.seed);
  std::exponential_distribution<double> gap(config.rate);
  TimePoint scheduled = run.start();
  for (int64_t lane = 0;; ++lane) {
    scheduled = After(scheduled, gap(rng));
    if (scheduled >= run.end()) break;
    const int64_t tokens = factory.PickLength(rng);
    std::this_thread::sleep_until(scheduled);
    if (run.in_flight().Count() >= config.max_outstanding) {
      run.recorder().NotSent(scheduled);
      continue;
    }
    run.recorder().SendLag(scheduled, Clock::now());
    run.Issue(lane, tokens, scheduled, nullptr);
  }
  run.Drain();
}

// ---------------------------------------------------------------------------------------
// Output.

using attention::core::JsonQuoted;

std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

std::string LoopDescription(const Config& c) {
  if (c.open_loop) return absl::StrCat("open loop, ", c.rate, " requests/s (Poisson)");
  return absl::StrCat("closed loop, ", c.concurrency, " callers");
}

std::string ToJson(const Config& c, const Report& r) {
  std::ostringstream o;
  const LatencySummary& l = r.latency;
  auto latency = [&](double v) { return l.count > 0 ? JsonNumber(v) : std::string("null"); };
  o << "{\n";
  o << "  \"config\": {\"target\": " << JsonQuoted(c.target) << ", \"layer\": "
    << JsonQuoted(c.layer) << ", \"mode\": \"" << (c.stream ? "stream" : "unary")
    << "\", \"loop\": \"" << (c.open_loop ? "open" : "closed") << "\", \"concurrency\": "
    << (c.open_loop ? 0 : c.concurrency) << ", \"rate\": " << JsonNumber(c.rate)
    << ", \"streams\": " << (c.stream ? c.streams : 0) << ", \"connections\": "
    << c.connections << ", \"batch\": " << c.batch << ", \"tokens\": "
    << JsonQuoted(c.tokens_flag) << ", \"min_tokens\": " << c.min_tokens
    << ", \"max_tokens\": " << c.max_tokens << ", \"embed_dim\": " << c.embed_dim
    << ", \"dtype\": " << JsonQuoted(c.dtype_name) << ", \"causal\": "
    << (c.causal ? "true" : "false") << ", \"duration_seconds\": " << JsonNumber(c.duration)
    << ", \"warmup_seconds\": " << JsonNumber(c.warmup) << ", \"seed\": " << c.seed << "},\n";
  o << "  \"window_seconds\": " << JsonNumber(r.window_seconds) << ",\n";
  o << "  \"requests\": " << r.requests << ",\n";
  o << "  \"tokens\": " << r.tokens << ",\n";
  o << "  \"requests_per_second\": " << JsonNumber(r.requests / r.window_seconds) << ",\n";
  o << "  \"tokens_per_second\": " << JsonNumber(r.tokens / r.window_seconds) << ",\n";
  o << "  \"sent\": " << r.sent << ",\n";
  o << "  \"errors\": " << r.errors << ",\n";
  o << "  \"errors_by_code\": {";
  bool first = true;
  for (const auto& [name, count] : r.errors_by_code) {
    o << (first ? "" : ", ") << JsonQuoted(name) << ": " << count;
    first = false;
  }
  o << "},\n";
  o << "  \"not_sent\": " << r.not_sent << ",\n";
  o << "  \"unanswered\": " << r.unanswered << ",\n";
  if (c.open_loop) o << "  \"max_send_lag_ms\": " << JsonNumber(r.max_send_lag_ms) << ",\n";
  o << "  \"latency_ms\": {\"count\": " << l.count << ", \"mean\": " << latency(l.mean_ms)
    << ", \"min\": " << latency(l.min_ms) << ", \"p50\": " << latency(l.p50_ms)
    << ", \"p90\": " << latency(l.p90_ms) << ", \"p99\": " << latency(l.p99_ms)
    << ", \"p99.9\": " << latency(l.p999_ms) << ", \"max\": " << latency(l.max_ms) << "}\n";
  o << "}\n";
  return o.str();
}

void PrintReport(const Config& c, const Report& r) {
  std::printf("attention-loadgen: %s, %s%s, layer %s, batch %" PRId64 " x %s tokens, %s%s\n",
              c.target.c_str(), LoopDescription(c).c_str(),
              c.stream ? absl::StrCat(", stream x", c.streams).c_str() : ", unary",
              c.layer.c_str(), c.batch, c.tokens_flag.c_str(), c.dtype_name.c_str(),
              c.causal ? ", causal" : "");
  std::printf("window %.1f s after %.1f s warmup, %d connection(s)\n\n", r.window_seconds,
              c.warmup, c.connections);
  std::printf("  %-22s %14" PRId64 "\n", "requests answered", r.requests);
  std::printf("  %-22s %14.1f\n", "requests/s", r.requests / r.window_seconds);
  std::printf("  %-22s %14.1f\n", "tokens/s", r.tokens / r.window_seconds);
  std::printf("  %-22s %14" PRId64 "\n", "errors", r.errors);
  std::printf("  %-22s %14" PRId64 "\n", "not sent", r.not_sent);
  std::printf("  %-22s %14" PRId64 "\n", "unanswered", r.unanswered);
  if (c.open_loop) std::printf("  %-22s %14.3f\n", "max send lag (ms)", r.max_send_lag_ms);
  const LatencySummary& l = r.latency;
  std::printf("\n  latency (ms)   %9s %9s %9s %9s %9s %9s %9s\n", "mean", "min", "p50", "p90",
              "p99", "p99.9", "max");
  if (l.count > 0) {
    std::printf("                 %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f\n", l.mean_ms,
                l.min_ms, l.p50_ms, l.p90_ms, l.p99_ms, l.p999_ms, l.max_ms);
  } else {
    std::printf("                 (no successful requests)\n");
  }
  if (!r.errors_by_code.empty()) {
    std::printf("\n  errors by code\n");
    for (const auto& [name, count] : r.errors_by_code) {
      std::printf("    %-20s %14" PRId64 "\n", name.c_str(), count);
    }
  }
  std::fflush(stdout);
}

int Main() {
  Config config;
  if (!ReadConfig(&config)) return 2;

  // Connect (and look up the layer's embed_dim) before the clock starts.
  attention::client::AttentionClient control(config.target, config.connection);
  if (config.embed_dim == 0) {
    auto layer = control.GetLayer(config.layer);
    if (!layer.ok()) {
      std::cerr << "attention-loadgen: GetLayer(" << config.layer << "): " << layer.status()
                << " (pass --embed_dim to skip the lookup)" << std::endl;
      return 1;
    }
    config.embed_dim = layer->config().embed_dim();
  }
  const auto channels = MakeChannels(config);
  for (const auto& channel : channels) {
    if (!channel->WaitForConnected(SystemDeadline(10))) {
      std::cerr << "attention-loadgen: cannot connect to " << config.target << std::endl;
      return 1;
    }
  }
  const RequestFactory factory(config);

  const TimePoint start = Clock::now();
  std::unique_ptr<Transport> transport;
  if (config.stream) {
    // The stream deadline is a backstop well past the drain; Drain() cancels before it.
    const auto deadline =
        SystemDeadline(config.warmup + config.duration + config.drain_timeout + 60);
    transport = std::make_unique<StreamTransport>(channels, config.streams, deadline);
  } else {
    transport = std::make_unique<UnaryTransport>(channels, config.request_timeout);
  }
  Run run(config, factory, *transport, start);
  if (config.open_loop) {
    RunOpenLoop(config, run, factory);
  } else {
    RunClosedLoop(config, run, factory);
  }
  const Report report = run.recorder().Summarize();
  PrintReport(config, report);
  if (!config.json_path.empty()) {
    std::ofstream out(config.json_path);
    out << ToJson(config, report);
    if (!out.good()) {
      std::cerr << "attention-loadgen: cannot write " << config.json_path << std::endl;
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Load generator for attention.v1 MultiHeadAttention: closed loop (--concurrency) or "
      "open loop (--rate, Poisson arrivals), unary or streaming; reports requests/s, "
      "tokens/s, exact latency percentiles and errors by status code.");
  attention::SetVersionFlagOutput("attention-loadgen");
  absl::ParseCommandLine(argc, argv);
  return Main();
}

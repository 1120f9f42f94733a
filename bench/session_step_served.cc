// Decode steps served over gRPC against the same steps in process (issue 25, section 7):
// 8 sessions x 1 layer per message at a 4k context, Llama-3-8B heads (32 query heads, 8 KV
// heads, head dim 128), float32 KV.
//
//   build/bench/session_step_served [--sessions=8] [--context=4096] [--rounds=9]
//                                   [--steps_per_round=40] [--in_flight=2]
//
// One session is prefilled to the context and forked (copy-on-write: the forks share its
// blocks); every step rewrites the last position with the K/V already there, which the API
// makes idempotent, so each step attends over the whole context without growing it and
// steps may be in flight in any order. Interleaved per round, medians printed:
//   in process  SessionTable::Step on a table of the server's kind (no gRPC);
//   unary       SessionStep through an in-process server, one call at a time;
//   stream      SessionStepStream with --in_flight messages outstanding.
// Reported as layer-steps (entries) per second and served / in process.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "attention/v1/attention.grpc.pb.h"
#include "server/app/server.h"
#include "server/sessions/session_table.h"
#include "tensor_codec.h"

ABSL_FLAG(int64_t, sessions, 8, "sessions per message (one entry each)");
ABSL_FLAG(int64_t, context, 4096, "tokens each session holds");
ABSL_FLAG(int, rounds, 9, "interleaved rounds");
ABSL_FLAG(int, steps_per_round, 40, "messages per measurement");
ABSL_FLAG(int, in_flight, 2, "stream messages outstanding");

namespace {

namespace v1 = attention::v1;
using attention::server::AttentionServer;
using attention::server::ServerOptions;

constexpr int64_t kHeads = 32, kKvHeads = 8, kHeadDim = 128, kPrefillChunk = 512;

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

std::vector<float> Random(std::mt19937_64& rng, int64_t count) {
  std::normal_distribution<float> normal;
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

// The tokens of the shared prefix: q, k, v as [context][heads][dim].
struct Tokens {
  std::vector<float> q, k, v;
};

v1::SessionStepEntry WireEntry(const std::string& id, const Tokens& t, int64_t position,
                               int64_t n) {
  v1::SessionStepEntry entry;
  entry.set_session_id(id);
  entry.set_position(position);
  const auto slice = [&](const std::vector<float>& all, int64_t heads) {
    return std::vector<float>(all.begin() + position * heads * kHeadDim,
                              all.begin() + (position + n) * heads * kHeadDim);
  };
  using attention::core::DType;
  attention::wire::EncodeTensor(slice(t.q, kHeads), {n, kHeads, kHeadDim}, DType::kFloat32,
                                entry.mutable_query());
  attention::wire::EncodeTensor(slice(t.k, kKvHeads), {n, kKvHeads, kHeadDim}, DType::kFloat32,
                                entry.mutable_key());
  attention::wire::EncodeTensor(slice(t.v, kKvHeads), {n, kKvHeads, kHeadDim}, DType::kFloat32,
                                entry.mutable_value());
  return entry;
}

void Check(const grpc::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.error_message().c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t sessions = absl::GetFlag(FLAGS_sessions), context = absl::GetFlag(FLAGS_context);
  const int steps = absl::GetFlag(FLAGS_steps_per_round);
  std::mt19937_64 rng(25);
  Tokens tokens{Random(rng, context * kHeads * kHeadDim),
                Random(rng, context * kKvHeads * kHeadDim),
                Random(rng, context * kKvHeads * kHeadDim)};
  const int64_t kv_bytes = context * kKvHeads * 2 * kHeadDim * 4 + (64 << 20);

  // The server, and a table of its kind for the in-process side.
  ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.demo_layer = false;
  options.sessions.kv_cache_bytes = kv_bytes;
  auto server = AttentionServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  attention::core::ThreadPool threads(std::thread::hardware_concurrency());
  attention::server::SessionTableOptions table_options;
  table_options.kv_cache_bytes = kv_bytes;
  auto table = *attention::server::SessionTable::Create(table_options, threads);

  auto stub = v1::AttentionService::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials(), [] {
        grpc::ChannelArguments arguments;
        arguments.SetMaxReceiveMessageSize(64 << 20);
        arguments.SetMaxSendMessageSize(64 << 20);
        return arguments;
      }()));

  // Prefill one session in each place, then fork it.
  v1::CreateSessionRequest create;
  create.mutable_config()->set_num_layers(1);
  create.mutable_config()->set_num_heads(kHeads);
  create.mutable_config()->set_num_kv_heads(kKvHeads);
  create.mutable_config()->set_head_dim(kHeadDim);
  create.set_reserved_tokens(context);
  v1::CreateSessionResponse created;
  {
    grpc::ClientContext c;
    Check(stub->CreateSession(&c, create, &created), "CreateSession");
  }
  const attention::server::SessionShape shape{
      1, kHeads, kKvHeads, kHeadDim, 0, attention::core::DType::kFloat32, 0};
  const std::string local_id = table->CreateSession(shape, context, {}, absl::Now())->id;
  std::vector<float> output(kPrefillChunk * kHeads * kHeadDim);
  for (int64_t position = 0; position < context; position += kPrefillChunk) {
    const int64_t n = std::min(kPrefillChunk, context - position);
    v1::SessionStepRequest request;
    *request.add_entries() = WireEntry(created.session().session_id(), tokens, position, n);
    v1::SessionStepResponse response;
    grpc::ClientContext c;
    Check(stub->SessionStep(&c, request, &response), "prefill");
    attention::server::StepEntry entry{local_id,
                                       0,
                                       position,
                                       n,
                                       tokens.q.data() + position * kHeads * kHeadDim,
                                       tokens.k.data() + position * kKvHeads * kHeadDim,
                                       tokens.v.data() + position * kKvHeads * kHeadDim,
                                       output.data(),
                                       nullptr};
    if (!table->Step({&entry, 1}, absl::Now())[0].ok()) return 1;
  }
  std::vector<std::string> served_ids, local_ids;
  for (int64_t s = 0; s < sessions; ++s) {
    v1::ForkSessionRequest fork;
    fork.set_session_id(created.session().session_id());
    fork.set_tokens(context);
    fork.set_reserved_tokens(context);
    v1::ForkSessionResponse forked;
    grpc::ClientContext c;
    Check(stub->ForkSession(&c, fork, &forked), "ForkSession");
    served_ids.push_back(forked.session().session_id());
    local_ids.push_back(table->Fork(local_id, context, context, {}, absl::Now())->id);
  }

  // One step: every session rewrites its last position.
  v1::SessionStepRequest step;
  for (const std::string& id : served_ids)
    *step.add_entries() = WireEntry(id, tokens, context - 1, 1);
  std::vector<std::vector<float>> outputs(sessions, std::vector<float>(kHeads * kHeadDim));
  std::vector<attention::server::StepEntry> local_step;
  for (int64_t s = 0; s < sessions; ++s) {
    local_step.push_back(
        {local_ids[s], 0, context - 1, 1, tokens.q.data() + (context - 1) * kHeads * kHeadDim,
         tokens.k.data() + (context - 1) * kKvHeads * kHeadDim,
         tokens.v.data() + (context - 1) * kKvHeads * kHeadDim, outputs[s].data(), nullptr});
  }

  const auto in_process = [&] {
    for (int i = 0; i < steps; ++i) {
      for (const absl::Status& status : table->Step(local_step, absl::Now())) {
        if (!status.ok()) std::exit(1);
      }
    }
  };
  const auto unary = [&] {
    for (int i = 0; i < steps; ++i) {
      v1::SessionStepResponse response;
      grpc::ClientContext c;
      Check(stub->SessionStep(&c, step, &response), "SessionStep");
    }
  };
  const auto stream = [&] {
    grpc::ClientContext c;
    auto s = stub->SessionStepStream(&c);
    const int depth = absl::GetFlag(FLAGS_in_flight);
    int written = 0, read = 0;
    v1::SessionStepStreamResponse answer;
    while (read < steps) {
      while (written < steps && written - read < depth) {
        if (!s->Write(step)) std::exit(1);
        ++written;
      }
      if (!s->Read(&answer) || answer.error_code() != 0) {
        std::fprintf(stderr, "stream: %s\n", answer.error_message().c_str());
        std::exit(1);
      }
      ++read;
    }
    s->WritesDone();
    Check(s->Finish(), "SessionStepStream");
  };

  std::vector<double> rates[3];
  const char* names[3] = {"in process", "unary", "stream"};
  const std::function<void()> runs[3] = {in_process, unary, stream};
  for (int round = -1; round < absl::GetFlag(FLAGS_rounds); ++round) {  // round -1 warms up
    for (int r = 0; r < 3; ++r) {
      const absl::Time start = absl::Now();
      runs[r]();
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
      if (round >= 0) rates[r].push_back(steps * sessions / seconds);
    }
  }
  const double kv_per_entry = context * kKvHeads * 2.0 * kHeadDim * 4;
  std::printf("%lld sessions x 1 layer per message, context %lld, Llama-3-8B heads, f32 KV\n",
              static_cast<long long>(sessions), static_cast<long long>(context));
  for (int r = 0; r < 3; ++r) {
    const double rate = Median(rates[r]);
    std::printf("%-10s %9.0f layer-steps/s  %6.1f GB/s of KV  %.2f of in process\n", names[r], rate,
                rate * kv_per_entry / 1e9, rate / Median(rates[0]));
  }
  return 0;
}

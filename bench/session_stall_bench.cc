// One long prefill must not stall the server (issue 38): while one caller prefills
// --prefill tokens into a session in one SessionStep, --decoders other sessions decode one
// token a step and a prober calls the gRPC health check. Each decoder's and the prober's
// latencies are recorded unloaded (no prefill) and loaded (a prefill always running), over
// an in-process server on a free loopback port.
//
//   build/bench/session_stall_bench [--prefill=8192] [--decoders=8] [--context=512]
//                                   [--steps=200] [--prefill_chunk_tokens=256]
//
// Heads: 8 query heads on 2 KV heads of 64 (GQA), float32 KV, so that the 8,192-token
// prefill is the 1.4e11 FLOPs issue 38 measured (1.9 s). The goal: decode p99 loaded within
// 3 x unloaded, health checks under 10 ms. --prefill_chunk_tokens=8192 runs the prefill's
// attention in one turn, as before chunking.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "attention/v1/attention.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "server/app/server.h"
#include "tensor_codec.h"

ABSL_FLAG(int64_t, prefill, 8192, "tokens of the long prefill");
ABSL_FLAG(int, decoders, 8, "sessions decoding one token a step meanwhile");
ABSL_FLAG(int64_t, context, 512, "tokens each decoding session holds before it decodes");
ABSL_FLAG(int, steps, 200, "decode steps per decoder in each phase");
ABSL_FLAG(int64_t, prefill_chunk_tokens, 256, "the server's --prefill_chunk_tokens");

namespace {

namespace v1 = attention::v1;

constexpr int64_t kHeads = 8, kKvHeads = 2, kHeadDim = 64;

std::vector<float> Random(std::mt19937_64& rng, int64_t count) {
  std::normal_distribution<float> normal;
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

// n random tokens for `session` at `position`.
v1::SessionStepEntry Entry(const std::string& session, int64_t position, int64_t n,
                           std::mt19937_64& rng) {
  v1::SessionStepEntry entry;
  entry.set_session_id(session);
  entry.set_position(position);
  using attention::core::DType;
  attention::wire::EncodeTensor(Random(rng, n * kHeads * kHeadDim), {n, kHeads, kHeadDim},
                                DType::kFloat32, entry.mutable_query());
  attention::wire::EncodeTensor(Random(rng, n * kKvHeads * kHeadDim), {n, kKvHeads, kHeadDim},
                                DType::kFloat32, entry.mutable_key());
  attention::wire::EncodeTensor(Random(rng, n * kKvHeads * kHeadDim), {n, kKvHeads, kHeadDim},
                                DType::kFloat32, entry.mutable_value());
  return entry;
}

void Check(const grpc::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, status.error_message().c_str());
    std::exit(1);
  }
}

std::string CreateSession(v1::AttentionService::Stub& stub, int64_t reserved_tokens) {
  v1::CreateSessionRequest create;
  create.mutable_config()->set_num_layers(1);
  create.mutable_config()->set_num_heads(kHeads);
  create.mutable_config()->set_num_kv_heads(kKvHeads);
  create.mutable_config()->set_head_dim(kHeadDim);
  create.set_reserved_tokens(reserved_tokens);
  v1::CreateSessionResponse created;
  grpc::ClientContext context;
  Check(stub.CreateSession(&context, create, &created), "CreateSession");
  return created.session().session_id();
}

double Percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  return values[std::min(values.size() - 1, static_cast<size_t>(p * values.size()))];
}

struct Latencies {
  std::vector<double> decode_ms, health_ms, prefill_s;
};

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t prefill = absl::GetFlag(FLAGS_prefill), context = absl::GetFlag(FLAGS_context);
  const int decoders = absl::GetFlag(FLAGS_decoders), steps = absl::GetFlag(FLAGS_steps);

  attention::server::ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.demo_layer = false;
  options.sessions.kv_cache_bytes = int64_t{1} << 30;
  options.sessions.prefill_chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk_tokens);
  auto server = attention::server::AttentionServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  // One channel per caller, as separate clients would have.
  const auto channel = [&] {
    grpc::ChannelArguments arguments;
    arguments.SetMaxSendMessageSize(64 << 20);
    arguments.SetMaxReceiveMessageSize(64 << 20);
    arguments.SetInt("grpc.use_local_subchannel_pool", 1);
    return grpc::CreateCustomChannel("127.0.0.1:" + std::to_string((*server)->port()),
                                     grpc::InsecureChannelCredentials(), arguments);
  };

  // The decoders' sessions, each prefilled to --context.
  std::vector<std::string> sessions;
  {
    auto stub = v1::AttentionService::NewStub(channel());
    std::mt19937_64 rng(38);
    for (int d = 0; d < decoders; ++d) {
      sessions.push_back(CreateSession(*stub, context + 2 * steps + 1));
      v1::SessionStepRequest request;
      *request.add_entries() = Entry(sessions.back(), 0, context, rng);
      v1::SessionStepResponse response;
      grpc::ClientContext c;
      Check(stub->SessionStep(&c, request, &response), "decoder prefill");
    }
  }
  std::vector<int64_t> positions(decoders, context);

  const auto phase = [&](bool loaded) {
    Latencies latencies;
    std::atomic<bool> decoding{true};
    std::thread prefiller;
    std::atomic<bool> prefill_started{false};
    if (loaded) {
      prefiller = std::thread([&] {
        auto stub = v1::AttentionService::NewStub(channel());
        std::mt19937_64 rng(8192);
        v1::SessionStepRequest request;
        *request.add_entries() = Entry("", 0, prefill, rng);
        while (decoding) {
          request.mutable_entries(0)->set_session_id(CreateSession(*stub, prefill));
          v1::SessionStepResponse response;
          grpc::ClientContext c;
          prefill_started = true;
          const absl::Time start = absl::Now();
          Check(stub->SessionStep(&c, request, &response), "long prefill");
          latencies.prefill_s.push_back(absl::ToDoubleSeconds(absl::Now() - start));
          v1::DropSessionRequest drop;
          drop.set_session_id(request.entries(0).session_id());
          v1::DropSessionResponse dropped;
          grpc::ClientContext d;
          Check(stub->DropSession(&d, drop, &dropped), "DropSession");
        }
      });
      while (!prefill_started) std::this_thread::yield();
    }
    std::vector<std::vector<double>> decode_ms(decoders);
    std::vector<std::thread> threads;
    for (int d = 0; d < decoders; ++d) {
      threads.emplace_back([&, d] {
        auto stub = v1::AttentionService::NewStub(channel());
        std::mt19937_64 rng(d);
        for (int s = 0; s < steps; ++s) {
          v1::SessionStepRequest request;
          *request.add_entries() = Entry(sessions[d], positions[d]++, 1, rng);
          v1::SessionStepResponse response;
          grpc::ClientContext c;
          const absl::Time start = absl::Now();
          Check(stub->SessionStep(&c, request, &response), "decode step");
          decode_ms[d].push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
        }
      });
    }
    std::thread prober([&] {
      auto health = grpc::health::v1::Health::NewStub(channel());
      while (decoding) {
        grpc::health::v1::HealthCheckRequest request;
        grpc::health::v1::HealthCheckResponse response;
        grpc::ClientContext c;
        const absl::Time start = absl::Now();
        Check(health->Check(&c, request, &response), "health");
        latencies.health_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
        std::this_thread::yield();
      }
    });
    for (std::thread& t : threads) t.join();
    decoding = false;
    prober.join();
    if (prefiller.joinable()) prefiller.join();
    for (const auto& ms : decode_ms) {
      latencies.decode_ms.insert(latencies.decode_ms.end(), ms.begin(), ms.end());
    }
    return latencies;
  };

  const Latencies unloaded = phase(false);
  const Latencies loaded = phase(true);
  const auto report = [](const char* name, const Latencies& l) {
    std::printf(
        "%-9s decode p50 %7.2f ms  p99 %7.2f ms  max %7.2f ms | health p50 %5.2f ms  p99 %5.2f "
        "ms  max %6.2f ms (%zu checks) | long prefills %zu, median %.2f s\n",
        name, Percentile(l.decode_ms, 0.5), Percentile(l.decode_ms, 0.99),
        Percentile(l.decode_ms, 1.0), Percentile(l.health_ms, 0.5), Percentile(l.health_ms, 0.99),
        Percentile(l.health_ms, 1.0), l.health_ms.size(), l.prefill_s.size(),
        l.prefill_s.empty() ? 0.0 : Percentile(l.prefill_s, 0.5));
  };
  std::printf(
      "prefill %lld tokens, %d decoders at %lld tokens, %d steps each, "
      "--prefill_chunk_tokens=%lld\n",
      static_cast<long long>(prefill), decoders, static_cast<long long>(context), steps,
      static_cast<long long>(absl::GetFlag(FLAGS_prefill_chunk_tokens)));
  report("unloaded", unloaded);
  report("loaded", loaded);
  std::printf(
      "decode p99 loaded / unloaded: %.2f (goal <= 3); health max loaded %.2f ms "
      "(goal < 10)\n",
      Percentile(loaded.decode_ms, 0.99) / Percentile(unloaded.decode_ms, 0.99),
      Percentile(loaded.health_ms, 1.0));
  (*server)->Shutdown(absl::ZeroDuration());
  return 0;
}

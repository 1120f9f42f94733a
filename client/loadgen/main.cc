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
//
// Parts (client/loadgen/): config (flags), requests, recorder (in flight, outcomes),
// transports (unary, stream), drivers (closed and open loop), report (table, JSON).
#include <fstream>
#include <iostream>
#include <memory>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "attention_version.h"
#include "client/attention_client.h"
#include "client/loadgen/clock.h"
#include "client/loadgen/config.h"
#include "client/loadgen/drivers.h"
#include "client/loadgen/recorder.h"
#include "client/loadgen/report.h"
#include "client/loadgen/requests.h"
#include "client/loadgen/transports.h"

namespace attention::loadgen {
namespace {

int Main() {
  Config config;
  if (!ReadConfig(&config)) return 2;

  // Connect (and look up the layer's embed_dim) before the clock starts.
  client::AttentionClient control(config.target, config.connection);
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
    transport = MakeStreamTransport(channels, config.streams, deadline);
  } else {
    transport = MakeUnaryTransport(channels, config.request_timeout);
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
}  // namespace attention::loadgen

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Load generator for attention.v1 MultiHeadAttention: closed loop (--concurrency) or "
      "open loop (--rate, Poisson arrivals), unary or streaming; reports requests/s, "
      "tokens/s, exact latency percentiles and errors by status code.");
  attention::SetVersionFlagOutput("attention-loadgen");
  absl::ParseCommandLine(argc, argv);
  return attention::loadgen::Main();
}

// Flags of attention-loadgen and their checks.
#include "client/loadgen/config.h"

#include <cmath>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/connection_flags.h"

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

namespace attention::loadgen {
namespace {

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

}  // namespace

bool ReadConfig(Config* c) {
  auto fail = [](const std::string& message) {
    std::cerr << "attention-loadgen: " << message << std::endl;
    return false;
  };
  c->target = absl::GetFlag(FLAGS_target);
  auto connection = client::ClientOptionsFromFlags();
  if (!connection.ok()) return fail(std::string(connection.status().message()));
  c->connection = *std::move(connection);
  c->connection.max_message_bytes = wire::kDefaultMaxMessageBytes;
  auto credentials = client::ChannelCredentials(c->connection);
  if (!credentials.ok()) return fail(std::string(credentials.status().message()));
  c->credentials = *std::move(credentials);
  c->layer = absl::GetFlag(FLAGS_layer);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "unary" && mode != "stream")
    return fail("--mode must be unary or stream, not " + mode);
  c->stream = mode == "stream";
  c->rate = absl::GetFlag(FLAGS_rate);
  if (!(c->rate >= 0) || !std::isfinite(c->rate)) return fail("--rate must be >= 0");
  c->open_loop = c->rate > 0;
  c->concurrency = absl::GetFlag(FLAGS_concurrency);
  if (c->concurrency < 1)
    return fail(absl::StrCat("--concurrency must be >= 1, not ", c->concurrency));
  c->streams = absl::GetFlag(FLAGS_streams);
  if (c->streams < 0) return fail(absl::StrCat("--streams must be >= 0, not ", c->streams));
  if (c->streams == 0) c->streams = c->open_loop ? 4 : c->concurrency;
  c->connections = absl::GetFlag(FLAGS_connections);
  if (c->connections < 1)
    return fail(absl::StrCat("--connections must be >= 1, not ", c->connections));
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
    c->dtype = core::DType::kFloat32;
  } else if (c->dtype_name == "float16") {
    c->dtype = core::DType::kFloat16;
  } else if (c->dtype_name == "bfloat16") {
    c->dtype = core::DType::kBFloat16;
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

}  // namespace attention::loadgen

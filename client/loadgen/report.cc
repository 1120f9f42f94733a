// attention-loadgen's report.
#include "client/loadgen/report.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "core/json_text.h"

namespace attention::loadgen {
namespace {

using core::JsonQuoted;

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

}  // namespace

std::string ToJson(const Config& c, const Report& r) {
  std::ostringstream o;
  const LatencySummary& l = r.latency;
  auto latency = [&](double v) { return l.count > 0 ? JsonNumber(v) : std::string("null"); };
  o << "{\n";
  o << "  \"config\": {\"target\": " << JsonQuoted(c.target)
    << ", \"layer\": " << JsonQuoted(c.layer) << ", \"mode\": \"" << (c.stream ? "stream" : "unary")
    << "\", \"loop\": \"" << (c.open_loop ? "open" : "closed")
    << "\", \"concurrency\": " << (c.open_loop ? 0 : c.concurrency)
    << ", \"rate\": " << JsonNumber(c.rate) << ", \"streams\": " << (c.stream ? c.streams : 0)
    << ", \"connections\": " << c.connections << ", \"batch\": " << c.batch
    << ", \"tokens\": " << JsonQuoted(c.tokens_flag) << ", \"min_tokens\": " << c.min_tokens
    << ", \"max_tokens\": " << c.max_tokens << ", \"embed_dim\": " << c.embed_dim
    << ", \"dtype\": " << JsonQuoted(c.dtype_name)
    << ", \"causal\": " << (c.causal ? "true" : "false")
    << ", \"duration_seconds\": " << JsonNumber(c.duration)
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
              c.stream ? absl::StrCat(", stream x", c.streams).c_str() : ", unary", c.layer.c_str(),
              c.batch, c.tokens_flag.c_str(), c.dtype_name.c_str(), c.causal ? ", causal" : "");
  std::printf("window %.1f s after %.1f s warmup, %d connection(s)\n\n", r.window_seconds, c.warmup,
              c.connections);
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
    std::printf("                 %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f\n", l.mean_ms, l.min_ms,
                l.p50_ms, l.p90_ms, l.p99_ms, l.p999_ms, l.max_ms);
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

}  // namespace attention::loadgen

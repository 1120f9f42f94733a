// Chunked prefill into a KV-cache session against stateless attention on the same tokens
// (issue 25, section 7), in one run.
//
// BM_SessionPrefill writes N tokens into a new session in chunks through SessionTable::Step
// (q, k and v given) and, in the same iteration, runs core's blocked kernel causal over the
// whole Q/K/V (AttentionBlockedCpu: what CpuBackend::ScaledDotProductAttention runs). It
// reports both as tokens/s and their ratio session/stateless (cpu_ratio: the same by the
// process's CPU time); `old` = 1 keeps every entry on the decode kernel, as steps ran before
// the prefill path.
//
// BM_PagedKernelCrossover runs n new queries over a context of L keys on the decode kernel
// and on the prefill path: where prefill_speedup passes 1 sets kPagedPrefillMinQueries.
//
//   build/bench/session_prefill_bench --benchmark_counters_tabular=true
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "bench/bench_util.h"
#include "benchmark/benchmark.h"
#include "core/attention_kernels.h"
#include "core/attention_options.h"
#include "core/cpu/attention_cpu.h"
#include "core/cpu/paged_attention_cpu.h"
#include "core/cpu/paged_prefill_cpu.h"
#include "core/cpu/thread_pool.h"
#include "core/dtype.h"
#include "core/kv_cache/block_pool.h"
#include "server/sessions/session_table.h"

namespace attention {
namespace {

int ComputeThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

struct Heads {
  int64_t heads, kv_heads, head_dim;
};
// Llama-3-8B's attention, and a small model's (GPT-2 small's heads).
constexpr Heads kShapes[] = {{32, 8, 128}, {12, 12, 64}};

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// CPU seconds of every thread of the process: on a shared host, less noisy than wall time
// (the pool's idle threads sleep, so they add nothing).
double ProcessCpuSeconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// Args: shape index, N tokens, chunk tokens (0: one chunk of N), old path (1) or new (0).
void BM_SessionPrefill(benchmark::State& state) {
  const Heads shape = kShapes[state.range(0)];
  const int64_t tokens = state.range(1);
  const int64_t chunk = state.range(2) == 0 ? tokens : state.range(2);
  const bool old_path = state.range(3) != 0;
  const int64_t h = shape.heads, hkv = shape.kv_heads, d = shape.head_dim;
  // Token-major, as projections come out of a GEMM: Q [N][H][d], K and V [N][Hkv][d].
  const std::vector<float> query = bench::RandomValues(tokens * h * d, 1);
  const std::vector<float> key = bench::RandomValues(tokens * hkv * d, 2);
  const std::vector<float> value = bench::RandomValues(tokens * hkv * d, 3);
  std::vector<float> output(tokens * h * d);

  core::ThreadPool threads(ComputeThreads());
  server::SessionTableOptions options;
  options.kv_cache_bytes = tokens * hkv * 2 * d * sizeof(float) * 2 + (int64_t{8} << 20);
  options.max_session_tokens = tokens;
  if (old_path) options.prefill_min_queries = tokens + 1;
  std::unique_ptr<server::SessionTable> table = *server::SessionTable::Create(options, threads);
  server::SessionShape session_shape;
  session_shape.num_heads = h;
  session_shape.num_kv_heads = hkv;
  session_shape.head_dim = d;

  // The stateless problem: [B, heads, rows, width], as SDPA's inputs.
  const std::vector<float> sdpa_query = bench::RandomValues(tokens * h * d, 4);
  const std::vector<float> sdpa_key = bench::RandomValues(tokens * hkv * d, 5);
  const std::vector<float> sdpa_value = bench::RandomValues(tokens * hkv * d, 6);
  std::vector<float> sdpa_output(tokens * h * d);
  core::AttentionOptions causal;
  causal.causal = true;
  core::AttentionProblem problem;
  problem.dims = {1, h, hkv, tokens, tokens, d, d};
  problem.query = sdpa_query.data();
  problem.query_layout = core::HeadLayout::BatchHeadRow(h, tokens, d);
  problem.key = sdpa_key.data();
  problem.key_layout = core::HeadLayout::BatchHeadRow(hkv, tokens, d);
  problem.value = sdpa_value.data();
  problem.value_layout = core::HeadLayout::BatchHeadRow(hkv, tokens, d);
  problem.output = sdpa_output.data();
  problem.output_layout = core::HeadLayout::BatchHeadRow(h, tokens, d);
  problem.options = &causal;

  const auto prefill_session = [&] {
    const absl::Time now = absl::Now();
    const std::string id = table->CreateSession(session_shape, tokens, {}, now)->id;
    bool ok = true;
    for (int64_t position = 0; position < tokens; position += chunk) {
      server::StepEntry entry;
      entry.session_id = id;
      entry.position = position;
      entry.num_tokens = std::min(chunk, tokens - position);
      entry.query = query.data() + position * h * d;
      entry.key = key.data() + position * hkv * d;
      entry.value = value.data() + position * hkv * d;
      entry.output = output.data() + position * h * d;
      ok = ok && table->Step({entry}, now)[0].ok();
    }
    ok = ok && table->Drop(id, now).ok();
    benchmark::DoNotOptimize(output.data());
    return ok;
  };
  // Once untimed: the pool's pages and both paths' scratch are touched before the clock runs.
  if (!prefill_session()) state.SkipWithError("a session step failed");
  core::AttentionBlockedCpu({problem}, threads);

  double session_seconds = 0, stateless_seconds = 0, session_cpu = 0, stateless_cpu = 0;
  for (auto _ : state) {
    const double cpu_start = ProcessCpuSeconds();
    const auto start = std::chrono::steady_clock::now();
    if (!prefill_session()) state.SkipWithError("a session step failed");
    const auto middle = std::chrono::steady_clock::now();
    const double cpu_middle = ProcessCpuSeconds();
    core::AttentionBlockedCpu({problem}, threads);
    benchmark::DoNotOptimize(sdpa_output.data());
    const auto end = std::chrono::steady_clock::now();
    session_cpu += cpu_middle - cpu_start;
    stateless_cpu += ProcessCpuSeconds() - cpu_middle;
    session_seconds += Seconds(middle - start);
    stateless_seconds += Seconds(end - middle);
    state.SetIterationTime(Seconds(middle - start));
  }
  const double all_tokens = static_cast<double>(tokens) * state.iterations();
  state.counters["session_tok/s"] = all_tokens / session_seconds;
  state.counters["stateless_tok/s"] = all_tokens / stateless_seconds;
  state.counters["session/stateless"] = stateless_seconds / session_seconds;
  state.counters["cpu_ratio"] = stateless_cpu / session_cpu;  // the same by CPU time
  state.SetLabel(absl::StrCat("H", h, "/", hkv, " d", d, old_path ? " decode kernel" : ""));
}
BENCHMARK(BM_SessionPrefill)
    ->ArgNames({"shape", "N", "chunk", "old"})
    ->ArgsProduct({{0, 1}, {2048, 4096}, {256, 512, 0}, {0}})
    ->UseManualTime()
    ->Iterations(4)
    ->Unit(benchmark::kMillisecond);
// The old path, once per configuration: it takes seconds.
BENCHMARK(BM_SessionPrefill)
    ->ArgNames({"shape", "N", "chunk", "old"})
    ->ArgsProduct({{0, 1}, {2048, 4096}, {256, 512, 0}, {1}})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

// Args: shape index, n new queries, context L. One sequence of a pool of 256 KiB blocks.
void BM_PagedKernelCrossover(benchmark::State& state) {
  const Heads shape = kShapes[state.range(0)];
  const int64_t n = state.range(1), context = state.range(2);
  const core::kv_cache::KvLayout layout{shape.kv_heads, shape.head_dim, shape.head_dim,
                                        core::DType::kFloat32};
  const int64_t tokens_per_block =
      *core::kv_cache::TokensPerBlock(layout, core::kv_cache::kDefaultBlockBytes);
  const int64_t blocks = (context + tokens_per_block - 1) / tokens_per_block;
  const std::vector<float> storage =
      bench::RandomValues(blocks * core::kv_cache::kDefaultBlockBytes / sizeof(float), 7);
  std::vector<core::kv_cache::BlockId> table(blocks);
  for (int64_t b = 0; b < blocks; ++b) table[b] = static_cast<core::kv_cache::BlockId>(b);
  const std::vector<float> query = bench::RandomValues(n * shape.heads * shape.head_dim, 8);
  std::vector<float> output(n * shape.heads * shape.head_dim);
  const core::PagedDecodeSequence sequence{table, context, n, query.data(), output.data(), nullptr};
  core::PagedDecodeBatch batch;
  batch.storage = {storage.data(), core::kv_cache::kDefaultBlockBytes, blocks};
  batch.layout = layout;
  batch.tokens_per_block = tokens_per_block;
  batch.num_heads = shape.heads;
  batch.scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  batch.sequences = {&sequence, 1};
  core::ThreadPool threads(ComputeThreads());
  double decode_seconds = 0, prefill_seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    if (!core::PagedDecodeCpu(batch, threads).ok()) state.SkipWithError("decode failed");
    const auto middle = std::chrono::steady_clock::now();
    if (!core::PagedPrefillCpu(batch, threads).ok()) state.SkipWithError("prefill failed");
    const auto end = std::chrono::steady_clock::now();
    decode_seconds += Seconds(middle - start);
    prefill_seconds += Seconds(end - middle);
    state.SetIterationTime(Seconds(end - start));
  }
  const double iterations = static_cast<double>(state.iterations());
  state.counters["decode_us"] = 1e6 * decode_seconds / iterations;
  state.counters["prefill_us"] = 1e6 * prefill_seconds / iterations;
  state.counters["prefill_speedup"] = decode_seconds / prefill_seconds;
  state.SetLabel(absl::StrCat("H", shape.heads, "/", shape.kv_heads, " d", shape.head_dim));
}
BENCHMARK(BM_PagedKernelCrossover)
    ->ArgNames({"shape", "n", "L"})
    ->ArgsProduct({{0, 1}, {8, 16, 32, 64}, {512, 4096, 16384}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace attention

BENCHMARK_MAIN();

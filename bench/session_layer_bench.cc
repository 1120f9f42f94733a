// Sessions over a served layer (issue 25 §7, prefill): chunked prefill of hidden states into
// a session (projections, RoPE at the cache positions, KV writes, attention over the paged
// cache, output projection) against the stateless MHA path on the same tokens (the layer's
// ForwardBatch, causal), and decode steps of B sessions, in process. The layers (first
// argument) are the attention of Llama-3.2-1B (0: E 2048, 32 query heads, 8 KV heads, head
// dim 64, no biases) and Qwen2-0.5B (1: E 896, 14 query heads, 2 KV heads, head dim 64, Q/K/V
// biases), with RoPE.
//
//   build/bench/session_layer_bench --benchmark_counters_tabular=true
//
// tokens/s counts hidden-state rows in; the prefill ratio is session / stateless in one run.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "bench/bench_util.h"
#include "core/cpu/cpu_backend.h"
#include "core/mha_layer.h"
#include "server/sessions/session_layers.h"
#include "server/sessions/session_table.h"

namespace attention::bench {
namespace {

using server::LayerStepInput;
using server::SessionShape;
using server::SessionTable;
using server::StepEntry;

core::CpuBackend& Backend() {
  static auto* backend =
      new core::CpuBackend(static_cast<int>(std::thread::hardware_concurrency()));
  return *backend;
}

core::MhaConfig ModelConfig(int64_t model) {
  core::MhaConfig config;
  config.head_dim = 64;
  config.always_causal = true;
  config.output_bias = false;
  if (model == 0) {  // Llama-3.2-1B
    config.embed_dim = 2048;
    config.num_heads = 32;
    config.num_kv_heads = 8;
    config.qkv_bias = false;
    config.rope_theta = 500000;
  } else {  // Qwen2-0.5B
    config.embed_dim = 896;
    config.num_heads = 14;
    config.num_kv_heads = 2;
    config.rope_theta = 1000000;
  }
  return *core::MhaConfig::Resolve(config);
}

const std::shared_ptr<const core::MhaLayer>& Layer(int64_t model) {
  static const auto* layers = [] {
    auto backend = std::shared_ptr<const core::Backend>(&Backend(), [](const core::Backend*) {});
    auto* made = new std::vector<std::shared_ptr<const core::MhaLayer>>;
    for (int64_t m = 0; m < 2; ++m) {
      const core::MhaConfig config = ModelConfig(m);
      made->push_back(
          *core::MhaLayer::Create(config, core::MhaWeights::Random(config, 7 + m), backend));
    }
    return made;
  }();
  return (*layers)[model];
}

int64_t Embed(int64_t model) { return Layer(model)->config().embed_dim; }

std::unique_ptr<SessionTable> Table(int64_t bytes) {
  server::SessionTableOptions options;
  options.kv_cache_bytes = bytes;
  options.max_session_tokens = 1 << 16;
  return *SessionTable::Create(options, Backend().pool());
}

SessionShape LayerShape(int64_t model) {
  SessionShape requested;  // as a config naming only its layers: every head field unset
  requested.num_layers = requested.num_heads = requested.num_kv_heads = requested.head_dim = 0;
  return *server::ShapeOverLayers(requested, {Layer(model)}, {"layer"});
}

// Steps `tokens` rows of `x` ([*, E]) at `position` into `session`, in chunks of `chunk`.
void Prefill(int64_t model, SessionTable& table, const std::string& session,
             const std::vector<float>& x, int64_t position, int64_t tokens, int64_t chunk,
             std::vector<float>& out) {
  const int64_t embed = Embed(model);
  for (int64_t first = 0; first < tokens; first += chunk) {
    const int64_t n = std::min(chunk, tokens - first);
    StepEntry entry;
    entry.session_id = session;
    entry.position = position + first;
    entry.num_tokens = n;
    const LayerStepInput input{Layer(model).get(), x.data() + first * embed,
                               out.data() + first * embed};
    const auto statuses = server::StepOverLayers(table, {entry}, {input}, absl::Now());
    if (!statuses[0].ok()) std::abort();
  }
}

// The stateless path: the whole sequence through the layer, causal.
void BM_StatelessForward(benchmark::State& state) {
  const int64_t model = state.range(0), tokens = state.range(1);
  const std::vector<float> x = RandomValues(tokens * Embed(model), 1);
  core::MhaInput input;
  input.q_len = input.kv_len = tokens;
  input.query = x;
  input.options.causal = true;
  const core::MhaInput* inputs[] = {&input};
  for (auto _ : state) benchmark::DoNotOptimize(Layer(model)->ForwardBatch(inputs));
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(tokens * state.iterations()),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_StatelessForward)
    ->ArgsProduct({{0, 1}, {2048, 4096}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// A fresh session per iteration, prefilled in chunks of range(1).
void BM_SessionPrefill(benchmark::State& state) {
  const int64_t model = state.range(0), tokens = state.range(1), chunk = state.range(2);
  const std::vector<float> x = RandomValues(tokens * Embed(model), 1);
  std::vector<float> out(tokens * Embed(model));
  auto table = Table(int64_t{1} << 30);
  for (auto _ : state) {
    const auto info =
        table->CreateSession(LayerShape(model), tokens, absl::ZeroDuration(), absl::Now());
    Prefill(model, *table, info->id, x, 0, tokens, chunk, out);
    if (!table->Drop(info->id, absl::Now()).ok()) std::abort();
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(tokens * state.iterations()),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SessionPrefill)
    ->ArgsProduct({{0, 1}, {2048}, {256, 512, 2048}})
    ->ArgsProduct({{0, 1}, {4096}, {512, 4096}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// B sessions at `context` tokens, one new token each per step (rewriting the same position,
// which the table answers as a retry, so the context stays put).
void BM_SessionDecode(benchmark::State& state) {
  const int64_t model = state.range(0), context = state.range(1), sessions = state.range(2);
  const int64_t embed = Embed(model);
  auto table = Table(int64_t{1} << 30);
  std::vector<StepEntry> entries;
  std::vector<LayerStepInput> inputs;
  std::vector<std::vector<float>> xs, outs;
  for (int64_t s = 0; s < sessions; ++s) {
    const auto info =
        table->CreateSession(LayerShape(model), context + 1, absl::ZeroDuration(), absl::Now());
    xs.push_back(RandomValues((context + 1) * embed, 10 + s));
    outs.emplace_back((context + 1) * embed);
    Prefill(model, *table, info->id, xs.back(), 0, context + 1, 512, outs.back());
    StepEntry entry;
    entry.session_id = info->id;
    entry.position = context;
    entry.num_tokens = 1;
    entries.push_back(entry);
  }
  for (int64_t s = 0; s < sessions; ++s) {
    inputs.push_back({Layer(model).get(), xs[s].data() + context * embed, outs[s].data()});
  }
  for (auto _ : state) {
    const auto statuses = server::StepOverLayers(*table, entries, inputs, absl::Now());
    if (!statuses[0].ok()) std::abort();
  }
  state.counters["layer-steps/s"] = benchmark::Counter(
      static_cast<double>(sessions * state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SessionDecode)
    ->ArgsProduct({{0, 1}, {4096}, {1, 8}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace attention::bench

BENCHMARK_MAIN();

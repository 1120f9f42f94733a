// Microbenchmarks of the CUDA backend (issue 12's shapes), as useful GFLOPS: 8*N*E^2 for the
// projections plus 4*N^2*E for attention (half when causal) per sequence, host inputs in and
// host outputs out as the server sees them. Without a GPU every benchmark reports the
// reason as an error. bench/gpu_compare.py puts them next to PyTorch on the same GPU.
//
//   build/bench/cuda_bench --benchmark_counters_tabular=true
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "core/devices.h"
#include "core/mha_layer.h"

namespace attention::core {
namespace {

std::shared_ptr<const Backend> Gpu(std::string* why_none) {
  static Devices* devices = new Devices(1);
  auto backend = devices->Get("cuda");
  if (!backend.ok()) {
    *why_none = std::string(backend.status().message());
    return nullptr;
  }
  return *backend;
}

// B sequences of N tokens through an E-wide layer of H heads on the GPU.
void RunCudaMha(benchmark::State& state, int64_t batch, int64_t tokens, int64_t embed_dim,
                int64_t heads, bool causal) {
  std::string why_none;
  const std::shared_ptr<const Backend> gpu = Gpu(&why_none);
  if (gpu == nullptr) {
    state.SkipWithError(why_none.c_str());
    return;
  }
  MhaConfig config;
  config.embed_dim = embed_dim;
  config.num_heads = heads;
  const MhaConfig resolved = *MhaConfig::Resolve(config);
  auto layer = MhaLayer::Create(resolved, MhaWeights::Random(resolved, 7), gpu);
  if (!layer.ok()) {
    state.SkipWithError(std::string(layer.status().message()).c_str());
    return;
  }
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> query(batch * tokens * embed_dim);
  for (float& v : query) v = uniform(rng);
  MhaInput input;
  input.batch = batch;
  input.q_len = input.kv_len = tokens;
  input.query = query;
  input.options.causal = causal;
  const MhaInput* inputs[] = {&input};
  auto warmup = (*layer)->ForwardBatch(inputs);
  if (!warmup.ok()) {
    state.SkipWithError(std::string(warmup.status().message()).c_str());
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize((*layer)->ForwardBatch(inputs));
  const double n = static_cast<double>(tokens), e = static_cast<double>(embed_dim);
  const double flops = batch * (8.0 * n * e * e + (causal ? 2.0 : 4.0) * n * n * e);
  state.counters["GFLOPS"] =
      benchmark::Counter(flops * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["tokens_per_second"] = benchmark::Counter(
      static_cast<double>(batch * tokens) * state.iterations(), benchmark::Counter::kIsRate);
}

void BM_CudaMhaS1(benchmark::State& s) { RunCudaMha(s, 32, 128, 768, 12, false); }
void BM_CudaMhaS2(benchmark::State& s) { RunCudaMha(s, 8, 512, 768, 12, false); }
void BM_CudaMhaS3(benchmark::State& s) { RunCudaMha(s, 1, 2048, 768, 12, true); }
void BM_CudaMhaS4(benchmark::State& s) { RunCudaMha(s, 256, 16, 768, 12, false); }
void BM_CudaMhaS5(benchmark::State& s) { RunCudaMha(s, 1, 65536, 512, 8, true); }
void BM_CudaMhaLarge(benchmark::State& s) { RunCudaMha(s, 64, 1024, 1024, 16, false); }
void BM_CudaMhaCausal16k(benchmark::State& s) { RunCudaMha(s, 1, 16384, 768, 12, true); }
BENCHMARK(BM_CudaMhaS1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaMhaS2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaMhaS3)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaMhaS4)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaMhaS5)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaMhaLarge)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaMhaCausal16k)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace attention::core

BENCHMARK_MAIN();

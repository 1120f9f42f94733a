// What the Google Benchmark binaries share: seeded inputs and a GFLOPS counter.
#ifndef ATTENTION_BENCH_BENCH_UTIL_H_
#define ATTENTION_BENCH_BENCH_UTIL_H_

#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"

namespace attention::bench {

// `count` values uniform in [-1, 1), the same for the same seed.
inline std::vector<float> RandomValues(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = uniform(rng);
  return values;
}

// Reports `flops_per_iteration` as the rate "GFLOPS".
inline void SetGflops(benchmark::State& state, double flops_per_iteration) {
  state.counters["GFLOPS"] = benchmark::Counter(flops_per_iteration * state.iterations() / 1e9,
                                                benchmark::Counter::kIsRate);
}

}  // namespace attention::bench

#endif  // ATTENTION_BENCH_BENCH_UTIL_H_

// What a bfloat16 compute path could buy on this host (issue 26's first measurement): the
// projection GEMM of S1, S2 and S4 (4096 tokens x 768 -> 2304, and the 768 -> 768 output
// projection) by OpenBLAS sgemm in float32 and by oneDNN's matmul in float32 and in
// bfloat16 (bf16 inputs and weights, float32 accumulation and output), on the same threads.
// Each oneDNN row's label is the implementation it picked (e.g. brg:avx512_core_bf16 uses
// vdpbf16ps; without bf16 instructions it converts and runs float32 kernels).
//
//   OMP_NUM_THREADS=2 build/bench/bf16_gemm_bench --benchmark_counters_tabular=true
#include <cblas.h>

#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "benchmark/benchmark.h"
#include "core/cpu/gemm.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cpu/thread_pool.h"
#include "core/dtype.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace {

using attention::bench::RandomValues;
using attention::bench::SetGflops;
using dnnl::memory;

// y[M][N] = x[M][K] * w[N][K]^T, as the layers' projections (weights row-major [out][in]).
void BM_Sgemm(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  openblas_set_num_threads(static_cast<int>(state.range(3)));
  const auto x = RandomValues(m * k, 1), w = RandomValues(n * k, 2);
  std::vector<float> y(m * n);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x.data(), k, w.data(), k,
                0.0f, y.data(), n);
    benchmark::DoNotOptimize(y.data());
  }
  SetGflops(state, 2.0 * m * n * k);
}

// `values`, float32 in `layout`, converted into memory of `wanted`.
memory Reordered(const std::vector<float>& values, memory::format_tag layout,
                 const memory::desc& wanted, const dnnl::engine& engine, dnnl::stream& stream) {
  memory source(memory::desc(wanted.dims(), memory::data_type::f32, layout), engine,
                const_cast<float*>(values.data()));
  memory target(wanted, engine);
  dnnl::reorder(source, target).execute(stream, source, target);
  stream.wait();
  return target;
}

// The same product by oneDNN, inputs and weights in `dtype` (f32 or bf16), float32 out; the
// weights reordered once into the layout the primitive wants, as a loaded layer would keep
// them.
void OneDnnMatmul(benchmark::State& state, memory::data_type dtype,
                  memory::format_tag weight_layout = memory::format_tag::any) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const memory::desc x_md({m, k}, dtype, memory::format_tag::ab);
  const memory::desc w_any({k, n}, dtype, weight_layout);
  const memory::desc y_md({m, n}, memory::data_type::f32, memory::format_tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x_md, w_any, y_md), engine);
  const dnnl::matmul matmul(pd);

  const auto x_values = RandomValues(m * k, 1), w_values = RandomValues(n * k, 2);
  memory x = Reordered(x_values, memory::format_tag::ab, x_md, engine, stream);
  // The weights are row-major [n][k]: a {k, n} matrix in layout ba.
  memory w = Reordered(w_values, memory::format_tag::ba, pd.weights_desc(), engine, stream);
  memory y(y_md, engine);
  for (auto _ : state) {
    matmul.execute(stream, {{DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, y}});
    stream.wait();
  }
  SetGflops(state, 2.0 * m * n * k);
  state.SetLabel(pd.impl_info_str());
}

// The service's own kernels on weights packed once: its float32 microkernel and its bf16
// one (vdpbf16ps), on its thread pool.
void BM_OwnF32(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  attention::core::ThreadPool pool(static_cast<int>(state.range(3)));
  const auto x = RandomValues(m * k, 1), w = RandomValues(n * k, 2);
  const attention::core::PackedWeight packed(w, n, k);
  std::vector<float> y(m * n);
  for (auto _ : state) {
    attention::core::LinearForward(pool, x.data(), m, k, w, {}, n, y.data(), packed.panels());
    benchmark::DoNotOptimize(y.data());
  }
  SetGflops(state, 2.0 * m * n * k);
}

// The project's bf16 panels on `kernel`: AVX512-BF16 dot products or AMX tiles.
void OwnBf16(benchmark::State& state, attention::core::Bf16Kernel kernel) {
  if (!attention::core::CpuSupports(kernel)) {
    state.SkipWithError("this CPU cannot run the kernel");
    return;
  }
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  attention::core::ThreadPool pool(static_cast<int>(state.range(3)));
  const auto x = RandomValues(m * k, 1), w = RandomValues(n * k, 2);
  std::vector<uint16_t> x_bf16(x.size()), w_bf16(w.size());
  for (size_t i = 0; i < x.size(); ++i) x_bf16[i] = attention::core::FloatToBFloat16(x[i]);
  for (size_t i = 0; i < w.size(); ++i) w_bf16[i] = attention::core::FloatToBFloat16(w[i]);
  const attention::core::PackedBf16Weight packed(w_bf16, n, k);
  std::vector<float> y(m * n);
  for (auto _ : state) {
    attention::core::LinearForwardBf16(pool, x_bf16.data(), m, k, packed, {}, n, y.data(), kernel);
    benchmark::DoNotOptimize(y.data());
  }
  SetGflops(state, 2.0 * m * n * k);
}
void BM_OwnBf16(benchmark::State& state) {
  OwnBf16(state, attention::core::Bf16Kernel::kAvx512Bf16);
}
void BM_OwnAmx(benchmark::State& state) { OwnBf16(state, attention::core::Bf16Kernel::kAmx); }

void BM_OneDnnF32(benchmark::State& state) { OneDnnMatmul(state, memory::data_type::f32); }
void BM_OneDnnBf16(benchmark::State& state) { OneDnnMatmul(state, memory::data_type::bf16); }
// float32 on the weights as a layer holds them (W [n][k] row-major, "ba"), read in place.
void BM_OneDnnF32InPlace(benchmark::State& state) {
  OneDnnMatmul(state, memory::data_type::f32, memory::format_tag::ba);
}

// QKV (768 -> 2304) and output (768 -> 768) projections of 4096 tokens; 2 threads for sgemm
// (oneDNN takes OMP_NUM_THREADS). The one-thread rows time the kernels without the pool,
// which on a shared host varies less between runs.
void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"m", "n", "k", "threads"})
      ->Args({4096, 2304, 768, 2})
      ->Args({4096, 768, 768, 2})
      ->Args({16, 2304, 768, 2})
      ->Args({64, 2304, 768, 2})
      ->Args({256, 2304, 768, 2})
      ->Args({1024, 2304, 768, 1})
      ->Args({1024, 768, 768, 1})
      // One head's products in the flash loop at S2 (256 queries, 512 keys of 64): scores
      // and values.
      ->Args({256, 512, 64, 1})
      ->Args({256, 64, 512, 1});
  b->UseRealTime();
}
BENCHMARK(BM_Sgemm)->Apply(Shapes);
BENCHMARK(BM_OneDnnF32)->Apply(Shapes);
BENCHMARK(BM_OneDnnF32InPlace)->Apply(Shapes);
BENCHMARK(BM_OneDnnBf16)->Apply(Shapes);
BENCHMARK(BM_OwnF32)->Apply(Shapes);
BENCHMARK(BM_OwnBf16)->Apply(Shapes);
BENCHMARK(BM_OwnAmx)->Apply(Shapes);

}  // namespace

BENCHMARK_MAIN();

// Decode attention over the paged KV cache against the machine's read bandwidth, in one
// run (issue 25, section 7): BM_ReadBandwidth sums >= 512 MiB with every thread (a
// STREAM-style read); BM_PagedDecode runs core/cpu/paged_attention_cpu at a Llama-3-8B
// layer (32 query heads, 8 KV heads, head dim 128, n = 1). Both report bytes read per
// second, so KV_bytes/s over read_bytes/s is the decode kernel's roofline fraction.
// BM_PagedDecode also reads its own KV bytes with every thread after each step
// (same_memory_read/s) and reports of_same_memory_roof: the ratio against the very memory
// the kernel reads, alternated with it, steadier on a host whose bandwidth differs from
// one buffer (or process) to the next. BM_SharedPrefixDecode (issue 41): sessions forked
// from one 4,096-token prefix, decoding one token a step, with the prefix read once for all
// of them, read once per fork (share_prefixes off: the step before sharing), and held as
// private copies; BM_SgemmCeiling is OpenBLAS at the shared part's product shape, and
// BM_Bf16GemmCeiling the host's bf16 products there (those the shared part over bf16 KV
// runs on: FastestBf16Products, named in the label; skipped where float32's are faster).
//
//   build/bench/paged_decode_bench --benchmark_counters_tabular=true
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <cblas.h>

#include "benchmark/benchmark.h"
#include "core/cpu/attention_cpu.h"
#include "core/cpu/gemm.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cpu/paged_attention_cpu.h"
#include "core/cpu/thread_pool.h"
#include "core/dtype.h"
#include "core/half_bits.h"
#include "core/kv_cache/block_pool.h"

namespace attention::core {
namespace {

int ComputeThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

// Bytes on 2 MiB huge pages where the kernel grants them (as a KV pool allocated once at
// start-up would be), for the read benchmark and the KV storage alike: with 4 KiB pages
// every 16 KiB run of one head's keys crosses pages the hardware prefetchers stop at.
struct HugePageBytes {
  static constexpr size_t kHugePage = size_t{2} << 20;
  explicit HugePageBytes(size_t bytes)
      : size((bytes + kHugePage - 1) / kHugePage * kHugePage),
        data(static_cast<uint8_t*>(std::aligned_alloc(kHugePage, size))) {
    madvise(data, size, MADV_HUGEPAGE);  // advice only: 4 KiB pages if refused
  }
  ~HugePageBytes() { std::free(data); }
  size_t size;
  uint8_t* data;
};

// Sum of `count` floats (a multiple of 64); several independent chains so the adds' latency
// does not bound it. The generic version vectorizes in the AVX2 wrapper.
__attribute__((always_inline)) inline float SumGeneric(const float* x, int64_t count) {
  float lanes[32] = {};
  for (int64_t i = 0; i + 32 <= count; i += 32) {
    for (int l = 0; l < 32; ++l) lanes[l] += x[i + l];
  }
  float sum = 0;
  for (const float lane : lanes) sum += lane;
  return sum;
}
#if defined(__x86_64__)
// (GCC 12 takes the reduction's undefined pass-through operands for uninitialised reads.)
#pragma GCC diagnostic push
#if !defined(__clang__)  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
__attribute__((target("avx512f"))) float SumAvx512(const float* x, int64_t count) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 64 <= count; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(x + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(x + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(x + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(x + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#pragma GCC diagnostic pop
__attribute__((target("avx2"))) float SumAvx2(const float* x, int64_t count) {
  return SumGeneric(x, count);
}
#endif
float Sum(const float* x, int64_t count) {
#if defined(__x86_64__)
  if (BestSimdLevel() == SimdLevel::kAvx512) return SumAvx512(x, count);
  if (BestSimdLevel() == SimdLevel::kAvx2) return SumAvx2(x, count);
#endif
  return SumGeneric(x, count);
}

// Sums `count` floats with every thread of the pool, `chunk_floats` (or the rest) per item.
void ReadWithEveryThread(ThreadPool& pool, const float* values, int64_t count,
                         int64_t chunk_floats) {
  std::vector<float> sums((count + chunk_floats - 1) / chunk_floats);
  pool.ParallelFor(static_cast<int64_t>(sums.size()), [&](int64_t chunk) {
    const int64_t first = chunk * chunk_floats;
    sums[chunk] = Sum(values + first, std::min(chunk_floats, count - first) / 64 * 64);
  });
  benchmark::DoNotOptimize(sums.data());
}

// The read roof: every compute thread sums its share of a 512 MiB buffer.
void BM_ReadBandwidth(benchmark::State& state) {
  constexpr int64_t kBytes = int64_t{512} << 20;
  constexpr int64_t kChunkFloats = (int64_t{4} << 20) / sizeof(float);  // 4 MiB per item
  constexpr int64_t kFloats = kBytes / sizeof(float);
  HugePageBytes buffer(kBytes);
  float* values = reinterpret_cast<float*>(buffer.data);
  for (int64_t i = 0; i < kFloats; ++i) values[i] = static_cast<float>(i % 7);
  ThreadPool pool(ComputeThreads());
  for (auto _ : state) ReadWithEveryThread(pool, values, kFloats, kChunkFloats);
  state.counters["read_bytes/s"] = benchmark::Counter(
      static_cast<double>(kBytes) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["threads"] = ComputeThreads();
  state.SetLabel(SimdLevelName(BestSimdLevel()));
}
BENCHMARK(BM_ReadBandwidth)->UseRealTime()->Unit(benchmark::kMillisecond);

// Small finite KV values of `dtype` in every byte of `storage`: the kernel's speed does not
// depend on them.
void FillKv(HugePageBytes& storage, DType dtype) {
  const int64_t elements = static_cast<int64_t>(storage.size) / ElementSize(dtype);
  for (int64_t i = 0; i < elements; ++i) {
    const float x = 0.01f * static_cast<float>(i % 101) - 0.5f;
    if (dtype == DType::kBFloat16) {
      const uint16_t bits = FloatToBFloat16(x);
      std::memcpy(storage.data + 2 * i, &bits, 2);
    } else {
      std::memcpy(storage.data + 4 * i, &x, 4);
    }
  }
}

// Llama-3-8B's query heads (its KV heads are the layouts' 8, of 128 dims).
constexpr int64_t kLlamaHeads = 32;

// A batch of Llama-3-8B's query heads over `blocks` default-sized blocks of `storage`.
PagedDecodeBatch LlamaBatch(const HugePageBytes& storage, int64_t blocks,
                            const kv_cache::KvLayout& layout, int64_t tokens_per_block,
                            absl::Span<const PagedDecodeSequence> sequences) {
  PagedDecodeBatch batch;
  batch.storage = {storage.data, kv_cache::kDefaultBlockBytes, blocks};
  batch.layout = layout;
  batch.tokens_per_block = tokens_per_block;
  batch.num_heads = kLlamaHeads;
  batch.scale = 1.0f / std::sqrt(128.0f);
  batch.sequences = sequences;
  return batch;
}

// One layer-step of B sequences of `context` tokens, n = 1, Llama-3-8B shapes, KV float32
// (dtype 0) or bfloat16 (dtype 1) in a pool of 256 KiB blocks.
void BM_PagedDecode(benchmark::State& state) {
  const int64_t context = state.range(0), sequences = state.range(1);
  const kv_cache::KvLayout layout{8, 128, 128,
                                  state.range(2) == 0 ? DType::kFloat32 : DType::kBFloat16};
  const int64_t tokens_per_block = *kv_cache::TokensPerBlock(layout, kv_cache::kDefaultBlockBytes);
  const int64_t blocks = sequences * ((context + tokens_per_block - 1) / tokens_per_block);
  kv_cache::KvBlockPool pool =
      *kv_cache::KvBlockPool::Create(blocks * kv_cache::kDefaultBlockBytes);
  HugePageBytes storage(blocks * kv_cache::kDefaultBlockBytes);
  FillKv(storage, layout.dtype);
  std::vector<float> queries(sequences * kLlamaHeads * layout.key_dim, 0.03f);
  std::vector<float> outputs(sequences * kLlamaHeads * layout.value_dim);
  std::vector<PagedDecodeSequence> batch_sequences;
  for (int64_t b = 0; b < sequences; ++b) {
    const kv_cache::SequenceId id = *pool.Reserve(layout, 1, context);
    (void)pool.EnsureCapacity(id, context);
    batch_sequences.push_back({(*pool.Find(id))->block_tables[0], context, 1,
                               queries.data() + b * kLlamaHeads * layout.key_dim,
                               outputs.data() + b * kLlamaHeads * layout.value_dim, nullptr});
  }
  const PagedDecodeBatch batch =
      LlamaBatch(storage, blocks, layout, tokens_per_block, batch_sequences);
  ThreadPool threads(ComputeThreads());
  // Each step is followed by a plain read of the same KV bytes with every thread: a roof
  // over the very memory the kernel reads, alternated with it (on this shared host a
  // separate buffer's bandwidth swings 43-80 GB/s from one process to the next).
  constexpr int64_t kRoofChunkFloats = (int64_t{2} << 20) / sizeof(float);
  const int64_t storage_floats = blocks * kv_cache::kDefaultBlockBytes / sizeof(float);
  const auto* storage_floats_at = reinterpret_cast<const float*>(storage.data);
  double step_seconds = 0, roof_seconds = 0;
  using Clock = std::chrono::steady_clock;
  for (auto _ : state) {
    const Clock::time_point start = Clock::now();
    if (!PagedDecodeCpu(batch, threads).ok()) state.SkipWithError("PagedDecodeCpu failed");
    benchmark::DoNotOptimize(outputs.data());
    const Clock::time_point step_end = Clock::now();
    ReadWithEveryThread(threads, storage_floats_at, storage_floats, kRoofChunkFloats);
    roof_seconds += std::chrono::duration<double>(Clock::now() - step_end).count();
    const double step = std::chrono::duration<double>(step_end - start).count();
    step_seconds += step;
    state.SetIterationTime(step);
  }
  const double kv_bytes = static_cast<double>(sequences * context * layout.TokenBytes());
  state.counters["KV_bytes/s"] =
      benchmark::Counter(kv_bytes * state.iterations(), benchmark::Counter::kIsRate);
  const double same_memory_roof =
      static_cast<double>(storage_floats * sizeof(float)) * state.iterations() / roof_seconds;
  state.counters["same_memory_read/s"] = same_memory_roof;
  state.counters["of_same_memory_roof"] =
      kv_bytes * state.iterations() / step_seconds / same_memory_roof;
  state.counters["layer_steps/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.SetLabel(std::string(DTypeName(layout.dtype)));
}
BENCHMARK(BM_PagedDecode)
    ->ArgNames({"context", "B", "bf16"})
    ->ArgsProduct({{4096, 32768}, {1, 8}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// The kernel of shared prefixes' products over `dtype` KV, as CpuBackend::SessionBf16Products.
std::optional<Bf16Kernel> SharedBf16Products(DType dtype) {
  if (dtype != DType::kBFloat16) return std::nullopt;
  return SharedPrefixBf16Products(FastestBf16Products());
}

// Mode of BM_SharedPrefixDecode.
enum PrefixMode { kShared = 0, kForksUnshared = 1, kPrivateCopies = 2, kSharedAsProducts = 3 };

// One layer-step of `sessions` sessions over one 4,096-token prefix, each with 1-256 tokens
// of its own (the new one included), n = 1, Llama-3-8B heads, KV float32 or bfloat16. The
// forks' tables share the prefix's blocks; private copies hold the same values in blocks of
// their own. GFLOPS counts each session's attention (4 * H * L * d), as if nothing were shared.
void BM_SharedPrefixDecode(benchmark::State& state) {
  const int64_t sessions = state.range(0);
  const auto mode = static_cast<PrefixMode>(state.range(1));
  const kv_cache::KvLayout layout{8, 128, 128,
                                  state.range(2) == 0 ? DType::kFloat32 : DType::kBFloat16};
  constexpr int64_t kPrefix = 4096;
  const int64_t tokens_per_block = *kv_cache::TokensPerBlock(layout, kv_cache::kDefaultBlockBytes);
  const int64_t prefix_blocks = kPrefix / tokens_per_block;
  std::vector<int64_t> lengths;
  int64_t blocks = mode == kPrivateCopies ? 0 : prefix_blocks;
  for (int64_t b = 0; b < sessions; ++b) {
    lengths.push_back(kPrefix + 1 + (b * 37) % 256);  // 1-256 own tokens
    const int64_t own_blocks = (lengths.back() - kPrefix + tokens_per_block - 1) / tokens_per_block;
    blocks += own_blocks + (mode == kPrivateCopies ? prefix_blocks : 0);
  }
  HugePageBytes storage(blocks * kv_cache::kDefaultBlockBytes);
  FillKv(storage, layout.dtype);
  std::vector<std::vector<kv_cache::BlockId>> tables(sessions);
  kv_cache::BlockId next = mode == kPrivateCopies ? 0 : prefix_blocks;
  for (int64_t b = 0; b < sessions; ++b) {
    for (int64_t k = 0; k < prefix_blocks; ++k) {
      tables[b].push_back(mode == kPrivateCopies ? next++ : k);
    }
    while (static_cast<int64_t>(tables[b].size()) * tokens_per_block < lengths[b]) {
      tables[b].push_back(next++);
    }
  }
  std::vector<float> queries(sessions * kLlamaHeads * layout.key_dim, 0.03f);
  std::vector<float> outputs(sessions * kLlamaHeads * layout.value_dim);
  std::vector<PagedDecodeSequence> batch_sequences;
  double flops = 0;
  for (int64_t b = 0; b < sessions; ++b) {
    batch_sequences.push_back({tables[b], lengths[b], 1,
                               queries.data() + b * kLlamaHeads * layout.key_dim,
                               outputs.data() + b * kLlamaHeads * layout.value_dim, nullptr});
    flops += 4.0 * kLlamaHeads * static_cast<double>(lengths[b]) * 128;
  }
  const PagedDecodeBatch batch =
      LlamaBatch(storage, blocks, layout, tokens_per_block, batch_sequences);
  ThreadPool threads(ComputeThreads());
  // As the server's sessions: bf16 KV's shared products on the host's bf16 products.
  const std::optional<Bf16Kernel> bf16_products = SharedBf16Products(layout.dtype);
  for (auto _ : state) {
    const SharedPrefixes shared = mode == kSharedAsProducts ? SharedPrefixes::kAsProducts
                                  : mode == kShared         ? SharedPrefixes::kReadOnce
                                                            : SharedPrefixes::kReadPerFork;
    if (!PagedDecodeCpu(batch, threads, BestSimdLevel(), shared, bf16_products).ok()) {
      state.SkipWithError("PagedDecodeCpu failed");
    }
    benchmark::DoNotOptimize(outputs.data());
  }
  state.counters["GFLOPS"] =
      benchmark::Counter(flops * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["layer_steps/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  static const char* const kModes[] = {"shared", "forks, read per fork", "private copies",
                                       "shared as products (not batch-invariant)"};
  state.SetLabel(std::string(kModes[mode]) + ", " + std::string(DTypeName(layout.dtype)) +
                 (bf16_products ? std::string(", products ") + Bf16KernelName(*bf16_products)
                                : std::string()));
}
BENCHMARK(BM_SharedPrefixDecode)
    ->ArgNames({"sessions", "mode", "bf16"})
    ->ArgsProduct({{8, 16, 64},
                   {kShared, kForksUnshared, kPrivateCopies, kSharedAsProducts},
                   {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// The GEMM ceiling of the shared part: 256 query rows (64 sessions x a GQA group of 4)
// against 4,096 keys of 128 dims, OpenBLAS sgemm on as many threads as the decode.
void BM_SgemmCeiling(benchmark::State& state) {
  constexpr int64_t kRows = 256, kKeys = 4096, kDim = 128;
  openblas_set_num_threads(ComputeThreads());
  std::vector<float> a(kRows * kDim, 0.01f), b(kDim * kKeys, 0.02f), c(kRows * kKeys);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, kRows, kKeys, kDim, 1.0f, a.data(), kDim,
                b.data(), kKeys, 0.0f, c.data(), kKeys);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOPS"] = benchmark::Counter(
      2.0 * kRows * kKeys * kDim * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SgemmCeiling)->UseRealTime()->Unit(benchmark::kMillisecond);

// The same product in bf16 on the shared part's bf16 kernel, its panels split across the
// decode's threads.
void BM_Bf16GemmCeiling(benchmark::State& state) {
  constexpr int64_t kRows = 256, kKeys = 4096, kDim = 128;
  const std::optional<Bf16Kernel> kernel = SharedBf16Products(DType::kBFloat16);
  if (!kernel.has_value()) {
    state.SkipWithError("float32 products are this host's faster (FastestBf16Products)");
    return;
  }
  std::vector<uint16_t> a(kRows * kDim, FloatToBFloat16Bits(0.01f));
  std::vector<uint16_t> b(kDim * kKeys, FloatToBFloat16Bits(0.02f));
  std::vector<uint16_t> panels(Bf16PanelElements(kDim, kKeys));
  PackBf16Panels(b.data(), kDim, kKeys, kKeys, 1, panels.data(), *kernel);
  std::vector<float> c(kRows * kKeys);
  ThreadPool threads(ComputeThreads());
  const int64_t parts = threads.size(), panel_count = PanelCount(kKeys);
  for (auto _ : state) {
    threads.ParallelFor(parts, [&](int64_t part) {
      GemmBf16Panels(*kernel, a.data(), kDim, kRows, panels.data(), kDim, kKeys,
                     panel_count * part / parts, panel_count * (part + 1) / parts, 1.0f, nullptr,
                     c.data(), kKeys);
    });
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOPS"] = benchmark::Counter(
      2.0 * kRows * kKeys * kDim * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.SetLabel(Bf16KernelName(*kernel));
}
BENCHMARK(BM_Bf16GemmCeiling)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace attention::core

BENCHMARK_MAIN();

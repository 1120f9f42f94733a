// Microbenchmarks of the CUDA backend (issue 12's shapes), as useful GFLOPS: 8*N*E^2 for the
// projections plus 4*N^2*E for attention (half when causal) per sequence, host inputs in and
// host outputs out as the server sees them. Without a GPU every benchmark reports the
// reason as an error. bench/gpu_compare.py puts them next to PyTorch on the same GPU.
//
//   build/bench/cuda_bench --benchmark_counters_tabular=true
//
// Paged decode (issue 25): BM_CudaPagedDecode reads a Llama-3-8B layer's KV cache and reports
// kv_GBps (bytes of K and V read per second of kernel time) and its fraction of
// BM_CudaReadRoof's read bandwidth, measured in the same process:
//
//   build/bench/cuda_bench --benchmark_filter='Paged|ReadRoof' --benchmark_counters_tabular=true
//
// BM_CudaSharedPrefixDecode (issue 41): forks of one 4,096-token prefix decoding together,
// their shared splits run once for the group, against the same forks each reading the
// prefix, and against private copies (paged_decode_bench's BM_SharedPrefixDecode on a GPU).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "bench/cuda_read_roof.h"
#include "benchmark/benchmark.h"
#include "core/cuda/paged_decode.h"
#include "core/cuda/paged_decode_plan.h"
#include "core/devices.h"
#include "core/half_bits.h"
#include "core/kv_cache/kv_storage.h"
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
// compute_dtype BFLOAT16 runs the projections on tensor cores (issue 26), and its inputs
// come in and its answers go out as bf16, as a bf16 caller's do.
void RunCudaMha(benchmark::State& state, int64_t batch, int64_t tokens, int64_t embed_dim,
                int64_t heads, bool causal, DType compute_dtype = DType::kFloat32) {
  std::string why_none;
  const std::shared_ptr<const Backend> gpu = Gpu(&why_none);
  if (gpu == nullptr) {
    state.SkipWithError(why_none.c_str());
    return;
  }
  MhaConfig config;
  config.embed_dim = embed_dim;
  config.num_heads = heads;
  config.compute_dtype = compute_dtype;
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
  std::vector<uint16_t> query_bf16;
  MhaInput input;
  input.batch = batch;
  input.q_len = input.kv_len = tokens;
  if (compute_dtype == DType::kBFloat16) {
    for (const float v : query) query_bf16.push_back(FloatToBFloat16Bits(v));
    input.half_dtype = DType::kBFloat16;
    input.query_half = query_bf16;
  } else {
    input.query = query;
  }
  input.options.causal = causal;
  // Answers go where a served caller's do: into its response, in its dtype.
  std::vector<float> answer;
  std::vector<uint16_t> answer_bf16;
  if (compute_dtype == DType::kBFloat16) {
    answer_bf16.resize(query.size());
    input.output_destination_bf16 = absl::MakeSpan(answer_bf16);
  } else {
    answer.resize(query.size());
    input.output_destination = absl::MakeSpan(answer);
  }
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
// Scaled dot-product attention alone on host tensors (B sequences, 12 heads of 64, N query
// and key tokens, float32 in and out, as a served ScaledDotProductAttention call), as
// attention GFLOPS (4 * N^2 * 64 per head) and the bytes a second it moves each way. Calls of
// this size run in chunks on two streams unless ATTENTION_CUDA_OVERLAP=off.
void RunCudaSdpa(benchmark::State& state, int64_t batch, int64_t tokens) {
  std::string why_none;
  const std::shared_ptr<const Backend> gpu = Gpu(&why_none);
  if (gpu == nullptr) {
    state.SkipWithError(why_none.c_str());
    return;
  }
  SdpaInput input;
  input.dims = {batch, 12, 12, tokens, tokens, 64, 64};
  std::mt19937_64 rng(2);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> q(batch * 12 * tokens * 64), k(q.size()), v(q.size());
  for (std::vector<float>* tensor : {&q, &k, &v}) {
    for (float& x : *tensor) x = uniform(rng);
  }
  input.query = q;
  input.key = k;
  input.value = v;
  if (auto warmup = gpu->ScaledDotProductAttention(input); !warmup.ok()) {
    state.SkipWithError(std::string(warmup.status().message()).c_str());
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(gpu->ScaledDotProductAttention(input));
  const double flops = 4.0 * batch * 12 * static_cast<double>(tokens) * tokens * 64;
  state.counters["GFLOPS"] =
      benchmark::Counter(flops * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["moved_GBps"] = benchmark::Counter(
      4.0 * q.size() * sizeof(float) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
void BM_CudaSdpaS1(benchmark::State& s) { RunCudaSdpa(s, 32, 128); }
void BM_CudaSdpaS2(benchmark::State& s) { RunCudaSdpa(s, 8, 512); }
void BM_CudaSdpaLarge(benchmark::State& s) { RunCudaSdpa(s, 64, 1024); }
BENCHMARK(BM_CudaSdpaS1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaSdpaS2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaSdpaLarge)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_CudaMhaBf16S1(benchmark::State& s) {
  RunCudaMha(s, 32, 128, 768, 12, false, DType::kBFloat16);
}
void BM_CudaMhaBf16S2(benchmark::State& s) {
  RunCudaMha(s, 8, 512, 768, 12, false, DType::kBFloat16);
}
void BM_CudaMhaBf16S3(benchmark::State& s) {
  RunCudaMha(s, 1, 2048, 768, 12, true, DType::kBFloat16);
}
void BM_CudaMhaBf16Causal16k(benchmark::State& s) {
  RunCudaMha(s, 1, 16384, 768, 12, true, DType::kBFloat16);
}
void BM_CudaMhaBf16S4(benchmark::State& s) {
  RunCudaMha(s, 256, 16, 768, 12, false, DType::kBFloat16);
}
BENCHMARK(BM_CudaMhaBf16S1)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaMhaBf16S2)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaMhaBf16S3)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaMhaBf16S4)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CudaMhaBf16Causal16k)->UseRealTime()->Unit(benchmark::kMillisecond);

// Paged decode and the read roof: kernel time from CUDA events around a CUDA graph of
// kGraphCalls calls (no host time between them), per call.
constexpr int kGraphCalls = 20;

// Device memory that frees itself; null after a failed cudaMalloc (the error is kept).
struct DeviceMemory {
  explicit DeviceMemory(size_t bytes) { error = cudaMalloc(&data, bytes); }
  ~DeviceMemory() { cudaFree(data); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void* data = nullptr;
  cudaError_t error;
};

// Seconds per call of `enqueue` (kGraphCalls calls captured once into a graph on `stream`),
// or an error message.
template <typename Enqueue>
std::string TimeGraph(cudaStream_t stream, Enqueue enqueue, cudaGraphExec_t* exec) {
  cudaGraph_t graph = nullptr;
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    return "cudaStreamBeginCapture failed";
  }
  std::string error;
  for (int call = 0; call < kGraphCalls && error.empty(); ++call) error = enqueue(call);
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (!error.empty()) return error;
  if (ended != cudaSuccess) return absl::StrCat("capture: ", cudaGetErrorString(ended));
  const cudaError_t made = cudaGraphInstantiate(exec, graph, 0);
  cudaGraphDestroy(graph);
  if (made != cudaSuccess) return absl::StrCat("cudaGraphInstantiate: ", cudaGetErrorString(made));
  return "";
}

// Runs `exec` once per benchmark iteration, timing it with events; false on an error.
bool RunTimedGraph(benchmark::State& state, cudaStream_t stream, cudaGraphExec_t exec,
                   double* seconds_per_call) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaGraphLaunch(exec, stream);  // warm-up
  double total = 0;
  int64_t calls = 0;
  for (auto _ : state) {
    cudaEventRecord(start, stream);
    cudaGraphLaunch(exec, stream);
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1e3 / kGraphCalls);
    total += ms / 1e3;
    calls += kGraphCalls;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const cudaError_t error = cudaStreamSynchronize(stream);
  if (error != cudaSuccess) {
    state.SkipWithError(cudaGetErrorString(error));
    return false;
  }
  *seconds_per_call = total / std::max<int64_t>(calls, 1);
  return true;
}

std::string NoGpuReason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) return absl::StrCat("no CUDA device: ", cudaGetErrorString(error));
  return count == 0 ? "no CUDA device" : "";
}

// Bytes per second of ReadRoofKernel over a 2 GiB buffer, measured once per process (0 on
// an error).
double ReadRoofBytesPerSecond(benchmark::State* state = nullptr) {
  static double measured = -1;
  if (measured >= 0 && state == nullptr) return measured;
  constexpr int64_t kBytes = int64_t{2} << 30;
  DeviceMemory buffer(kBytes);
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int blocks = sms * 8;  // 8 blocks of 256 threads: 2048 threads per SM
  DeviceMemory sums(blocks * sizeof(float));
  if (buffer.error != cudaSuccess || sums.error != cudaSuccess) {
    if (state != nullptr) state->SkipWithError("cudaMalloc of the read roof's buffer failed");
    return measured = 0;
  }
  cudaMemset(buffer.data, 0, kBytes);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cudaGraphExec_t exec = nullptr;
  const std::string error = TimeGraph(
      stream,
      [&](int) -> std::string {
        const cudaError_t e = attention::bench::LaunchReadRoof(
            buffer.data, kBytes / 16, static_cast<float*>(sums.data), blocks, stream);
        return e == cudaSuccess ? "" : cudaGetErrorString(e);
      },
      &exec);
  double seconds = 0;
  if (!error.empty()) {
    if (state != nullptr) state->SkipWithError(error.c_str());
    measured = 0;
  } else if (state != nullptr) {
    if (RunTimedGraph(*state, stream, exec, &seconds)) measured = kBytes / seconds;
  } else {  // for the ratio, outside a benchmark: ten graph launches
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    cudaGraphLaunch(exec, stream);
    cudaEventRecord(start, stream);
    for (int i = 0; i < 10; ++i) cudaGraphLaunch(exec, stream);
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    measured = ms > 0 ? kBytes * 10.0 * kGraphCalls / (ms / 1e3) : 0;
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  return measured;
}

void BM_CudaReadRoof(benchmark::State& state) {
  if (const std::string why = NoGpuReason(); !why.empty()) {
    state.SkipWithError(why.c_str());
    return;
  }
  const double bytes_per_second = ReadRoofBytesPerSecond(&state);
  state.counters["read_GBps"] = bytes_per_second / 1e9;
}
BENCHMARK(BM_CudaReadRoof)->UseManualTime()->Unit(benchmark::kMicrosecond);

// Seconds per PagedDecodeCuda call over `batches` in turn (the calls of one graph, on one
// scratch), with `shared` groups; false, the benchmark skipped with the error, when it fails.
bool TimePagedDecode(benchmark::State& state, const std::vector<PagedDecodeBatch>& batches,
                     const std::vector<SharedPrefixGroup>& shared, double* seconds) {
  const absl::StatusOr<int64_t> scratch_bytes =
      cuda::PagedDecodeCudaScratchBytes(batches[0], shared);
  if (!scratch_bytes.ok()) {
    state.SkipWithError(std::string(scratch_bytes.status().message()).c_str());
    return false;
  }
  DeviceMemory scratch(*scratch_bytes);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cudaGraphExec_t exec = nullptr;
  const std::string error = TimeGraph(
      stream,
      [&](int call) -> std::string {
        const absl::Status status = cuda::PagedDecodeCuda(
            batches[call % batches.size()], scratch.data, *scratch_bytes, stream, shared);
        return status.ok() ? "" : std::string(status.message());
      },
      &exec);
  bool timed = false;
  if (!error.empty()) {
    state.SkipWithError(error.c_str());
  } else {
    timed = RunTimedGraph(state, stream, exec, seconds);
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
  return timed;
}

// B sequences of `context` tokens of a Llama-3-8B layer (32 query heads, 8 KV heads of 128),
// one new query each, in 256 KiB blocks at random places of the pool. Enough copies of the
// KV cache that the calls of one graph rotate through 512 MiB: a small cache would otherwise
// be read from L2 (50 MiB on an H100) from the second call on.
void RunCudaPagedDecode(benchmark::State& state, int64_t context, int64_t batch, DType dtype) {
  if (const std::string why = NoGpuReason(); !why.empty()) {
    state.SkipWithError(why.c_str());
    return;
  }
  constexpr int64_t kHeads = 32, kDim = 128;
  const kv_cache::KvLayout layout{8, kDim, kDim, dtype};
  const int64_t block_bytes = kv_cache::kDefaultBlockBytes;
  const int64_t tokens_per_block = *kv_cache::TokensPerBlock(layout, block_bytes);
  const int64_t blocks_per_sequence = (context + tokens_per_block - 1) / tokens_per_block;
  const int64_t kv_bytes = batch * context * layout.TokenBytes();  // read per call
  const int64_t copies = std::max<int64_t>(1, (int64_t{512} << 20) / kv_bytes);
  const int64_t num_blocks = copies * batch * blocks_per_sequence;
  DeviceMemory storage(num_blocks * block_bytes);
  if (storage.error != cudaSuccess) {
    state.SkipWithError(
        absl::StrCat("cudaMalloc(", num_blocks * block_bytes, " bytes) failed").c_str());
    return;
  }
  cudaMemset(storage.data, 0x3c, num_blocks * block_bytes);  // 0.0115 in float32 and bf16
  std::mt19937_64 rng(1);
  std::vector<kv_cache::BlockId> permutation(num_blocks);
  std::iota(permutation.begin(), permutation.end(), 0);
  std::shuffle(permutation.begin(), permutation.end(), rng);
  DeviceMemory tables(num_blocks * sizeof(kv_cache::BlockId));
  cudaMemcpy(tables.data, permutation.data(), num_blocks * sizeof(kv_cache::BlockId),
             cudaMemcpyHostToDevice);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> host_query(batch * kHeads * kDim);
  for (float& x : host_query) x = uniform(rng);
  DeviceMemory query(host_query.size() * sizeof(float));
  cudaMemcpy(query.data, host_query.data(), host_query.size() * sizeof(float),
             cudaMemcpyHostToDevice);
  DeviceMemory output(batch * kHeads * kDim * sizeof(float));
  DeviceMemory log_sum_exp(batch * kHeads * sizeof(float));

  // One batch per copy of the cache.
  std::vector<std::vector<PagedDecodeSequence>> sequences(copies);
  std::vector<PagedDecodeBatch> batches(copies);
  for (int64_t copy = 0; copy < copies; ++copy) {
    for (int64_t b = 0; b < batch; ++b) {
      const auto* table = static_cast<const kv_cache::BlockId*>(tables.data) +
                          (copy * batch + b) * blocks_per_sequence;
      sequences[copy].push_back({absl::Span<const kv_cache::BlockId>(table, blocks_per_sequence),
                                 context, 1,
                                 static_cast<const float*>(query.data) + b * kHeads * kDim,
                                 static_cast<float*>(output.data) + b * kHeads * kDim,
                                 static_cast<float*>(log_sum_exp.data) + b * kHeads});
    }
    PagedDecodeBatch& p = batches[copy];
    p.storage = {storage.data, block_bytes, num_blocks};
    p.layout = layout;
    p.tokens_per_block = tokens_per_block;
    p.num_heads = kHeads;
    p.scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    p.sequences = sequences[copy];
  }
  double seconds = 0;
  if (TimePagedDecode(state, batches, {}, &seconds)) {
    const double bytes_per_second = kv_bytes / seconds;
    state.counters["kv_MiB"] = kv_bytes / double(1 << 20);
    state.counters["kv_GBps"] = bytes_per_second / 1e9;
    const double roof = ReadRoofBytesPerSecond();
    if (roof > 0) state.counters["of_read_roof"] = bytes_per_second / roof;
  }
}

void BM_CudaPagedDecode(benchmark::State& state) {
  RunCudaPagedDecode(state, state.range(0), state.range(1),
                     state.range(2) == 0 ? DType::kFloat32 : DType::kBFloat16);
}
BENCHMARK(BM_CudaPagedDecode)
    ->ArgNames({"context", "B", "bf16"})
    ->ArgsProduct({{4096, 32768}, {1, 8}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// A session step as the session table makes it: a GPU KV storage's Attend (block tables,
// queries and outputs in host memory) over B sequences of `context` bf16 tokens of a
// Llama-3-8B layer, one query each, as a BFLOAT16 layer's step (`cudnn`: cuDNN's paged SDPA
// where it loads) or a float32 session's (the project's paged decode kernel), rotating
// through copies of the cache as BM_CudaPagedDecode does. Wall time per step.
void BM_CudaSessionStep(benchmark::State& state) {
  if (const std::string why = NoGpuReason(); !why.empty()) {
    state.SkipWithError(why.c_str());
    return;
  }
  const int64_t context = state.range(0), batch = state.range(1);
  constexpr int64_t kHeads = 32, kDim = 128;
  const kv_cache::KvLayout layout{8, kDim, kDim, DType::kBFloat16};
  const int64_t block_bytes = kv_cache::kDefaultBlockBytes;
  const int64_t tokens_per_block = *kv_cache::TokensPerBlock(layout, block_bytes);
  const int64_t blocks_per_sequence = (context + tokens_per_block - 1) / tokens_per_block;
  const int64_t kv_bytes = batch * context * layout.TokenBytes();
  const int64_t copies = std::max<int64_t>(1, (int64_t{512} << 20) / kv_bytes);
  const int64_t num_blocks = copies * batch * blocks_per_sequence;
  static Devices* devices = new Devices(1);
  absl::StatusOr<std::unique_ptr<kv_cache::KvStorage>> storage =
      devices->CreateKvStorage("cuda:0", num_blocks, block_bytes);
  if (!storage.ok()) {
    state.SkipWithError(std::string(storage.status().message()).c_str());
    return;
  }
  const std::vector<char> filled(block_bytes, 0x3c);  // 0.0115 in bf16
  for (kv_cache::BlockId block = 0; block < num_blocks; ++block) {
    if (!(*storage)->WriteBlock(block, filled.data()).ok()) {
      state.SkipWithError("WriteBlock failed");
      return;
    }
  }
  std::mt19937_64 rng(1);
  std::vector<kv_cache::BlockId> tables(num_blocks);
  std::iota(tables.begin(), tables.end(), 0);
  std::shuffle(tables.begin(), tables.end(), rng);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> query(batch * kHeads * kDim), output(query.size());
  for (float& x : query) x = uniform(rng);
  std::vector<std::vector<PagedDecodeSequence>> sequences(copies);
  std::vector<PagedDecodeBatch> batches(copies);
  for (int64_t copy = 0; copy < copies; ++copy) {
    for (int64_t b = 0; b < batch; ++b) {
      sequences[copy].push_back({absl::MakeConstSpan(tables).subspan(
                                     (copy * batch + b) * blocks_per_sequence, blocks_per_sequence),
                                 context, 1, query.data() + b * kHeads * kDim,
                                 output.data() + b * kHeads * kDim, nullptr});
    }
    PagedDecodeBatch& p = batches[copy];
    p.layout = layout;
    p.tokens_per_block = tokens_per_block;
    p.num_heads = kHeads;
    p.scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    p.bf16_products = state.range(2) == 1;
    p.sequences = sequences[copy];
  }
  int64_t step = 0;
  for (auto _ : state) {
    if (const absl::Status status = (*storage)->Attend(batches[step++ % copies]); !status.ok()) {
      state.SkipWithError(std::string(status.message()).c_str());
      return;
    }
  }
  const std::map<std::string, int64_t> paths = (*storage)->AttendCallsByPath();
  state.SetLabel(absl::StrCat("cudnn steps ", paths.count("cudnn") ? paths.at("cudnn") : 0,
                              ", kernel steps ", paths.count("kernels") ? paths.at("kernels") : 0));
  const double bytes = static_cast<double>(kv_bytes) * state.iterations();
  state.counters["kv_GBps"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsRate);
  const double roof = ReadRoofBytesPerSecond();
  if (roof > 0) {
    state.counters["of_read_roof"] = benchmark::Counter(bytes / roof, benchmark::Counter::kIsRate);
  }
}
BENCHMARK(BM_CudaSessionStep)
    ->ArgNames({"context", "B", "cudnn"})
    ->ArgsProduct({{4096, 32768}, {1, 8}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

enum PrefixMode { kShared = 0, kForksUnshared = 1, kPrivateCopies = 2 };

// One layer-step of `sessions` sessions over one 4,096-token prefix, each with 1-256 tokens
// of its own, n = 1, Llama-3-8B heads; the forks' tables share the prefix's blocks, private
// copies hold blocks of their own. The pool is copied until a graph's calls rotate through
// 512 MiB, so each call reads its prefix from memory, as a model's next layer would.
void BM_CudaSharedPrefixDecode(benchmark::State& state) {
  if (const std::string why = NoGpuReason(); !why.empty()) {
    state.SkipWithError(why.c_str());
    return;
  }
  const int64_t sessions = state.range(0);
  const auto mode = static_cast<PrefixMode>(state.range(1));
  constexpr int64_t kHeads = 32, kDim = 128, kPrefix = 4096;
  const kv_cache::KvLayout layout{8, kDim, kDim,
                                  state.range(2) == 0 ? DType::kFloat32 : DType::kBFloat16};
  const int64_t block_bytes = kv_cache::kDefaultBlockBytes;
  const int64_t tokens_per_block = *kv_cache::TokensPerBlock(layout, block_bytes);
  const int64_t prefix_blocks = kPrefix / tokens_per_block;
  // One copy's tables, block ids from 0.
  std::vector<int64_t> lengths;
  std::vector<std::vector<kv_cache::BlockId>> tables(sessions);
  kv_cache::BlockId next = mode == kPrivateCopies ? 0 : prefix_blocks;
  for (int64_t b = 0; b < sessions; ++b) {
    lengths.push_back(kPrefix + 1 + (b * 37) % 256);
    for (int64_t k = 0; k < prefix_blocks; ++k) {
      tables[b].push_back(mode == kPrivateCopies ? next++ : k);
    }
    while (static_cast<int64_t>(tables[b].size()) * tokens_per_block < lengths[b]) {
      tables[b].push_back(next++);
    }
  }
  const int64_t copy_blocks = next;
  const int64_t copies = std::max<int64_t>(1, (int64_t{512} << 20) / (copy_blocks * block_bytes));
  DeviceMemory storage(copies * copy_blocks * block_bytes);
  if (storage.error != cudaSuccess) {
    state.SkipWithError("cudaMalloc of the pool failed");
    return;
  }
  cudaMemset(storage.data, 0x3c, copies * copy_blocks * block_bytes);
  std::vector<kv_cache::BlockId> all_tables;  // [copy][session][block]
  for (int64_t copy = 0; copy < copies; ++copy) {
    for (const auto& table : tables) {
      for (const kv_cache::BlockId id : table) all_tables.push_back(copy * copy_blocks + id);
    }
  }
  DeviceMemory device_tables(all_tables.size() * sizeof(kv_cache::BlockId));
  cudaMemcpy(device_tables.data, all_tables.data(), all_tables.size() * sizeof(kv_cache::BlockId),
             cudaMemcpyHostToDevice);
  std::mt19937_64 rng(2);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> host_query(sessions * kHeads * kDim);
  for (float& x : host_query) x = uniform(rng);
  DeviceMemory query(host_query.size() * sizeof(float));  // contiguous: as a group needs
  cudaMemcpy(query.data, host_query.data(), host_query.size() * sizeof(float),
             cudaMemcpyHostToDevice);
  DeviceMemory output(sessions * kHeads * kDim * sizeof(float));
  std::vector<std::vector<PagedDecodeSequence>> sequences(copies);
  std::vector<PagedDecodeBatch> batches(copies);
  size_t table_offset = 0;
  double flops = 0;
  for (int64_t copy = 0; copy < copies; ++copy) {
    for (int64_t b = 0; b < sessions; ++b) {
      const auto* table = static_cast<const kv_cache::BlockId*>(device_tables.data) + table_offset;
      table_offset += tables[b].size();
      sequences[copy].push_back({absl::Span<const kv_cache::BlockId>(table, tables[b].size()),
                                 lengths[b], 1,
                                 static_cast<const float*>(query.data) + b * kHeads * kDim,
                                 static_cast<float*>(output.data) + b * kHeads * kDim, nullptr});
      if (copy == 0) flops += 4.0 * kHeads * static_cast<double>(lengths[b]) * kDim;
    }
    PagedDecodeBatch& p = batches[copy];
    p.storage = {storage.data, block_bytes, copies * copy_blocks};
    p.layout = layout;
    p.tokens_per_block = tokens_per_block;
    p.num_heads = kHeads;
    p.scale = 1.0f / std::sqrt(static_cast<float>(kDim));
    p.sequences = sequences[copy];
  }
  // The groups, as the KV storage finds them: over the host's tables (the same in every copy).
  std::vector<SharedPrefixGroup> shared;
  if (mode == kShared) {
    std::vector<PagedDecodeSequence> host_sequences = sequences[0];
    for (int64_t b = 0; b < sessions; ++b) host_sequences[b].block_table = tables[b];
    PagedDecodeBatch host_batch = batches[0];
    host_batch.sequences = host_sequences;
    shared = FindSharedPrefixes(host_batch, cuda::kCudaPagedSplitKeys);
  }
  double seconds = 0;
  if (TimePagedDecode(state, batches, shared, &seconds)) {
    state.counters["GFLOPS"] = flops / seconds / 1e9;
    state.counters["distinct_kv_MiB"] =
        static_cast<double>(copy_blocks * block_bytes) / double(1 << 20);
    static const char* const kModes[] = {"shared", "forks, read per fork", "private copies"};
    state.SetLabel(std::string(kModes[mode]) + ", " + std::string(DTypeName(layout.dtype)));
  }
}
BENCHMARK(BM_CudaSharedPrefixDecode)
    ->ArgNames({"sessions", "mode", "bf16"})
    ->ArgsProduct({{8, 16, 64}, {kShared, kForksUnshared, kPrivateCopies}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace attention::core

BENCHMARK_MAIN();

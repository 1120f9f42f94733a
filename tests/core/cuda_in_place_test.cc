// Layers on the CUDA backend reading inputs from, and writing answers to, GPU memory in
// place (InputMemory::kGpu, MhaInput::output_on_gpu: a caller's CUDA shared memory region),
// and reading inputs straight from page-locked host memory (InputMemory::kPinnedHost). In a
// batch of the same composition they answer bitwise as the same values from host memory,
// for float32, FP16 and BF16 inputs and float32 and bf16 answers, beside host inputs; a
// batch large enough to run in overlapped chunks answers by FlashAttention's rule.
// Without a GPU every test reports SKIPPED with the reason.
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/half_bits.h"
#include "core/mha_layer.h"
#include "gtest/gtest.h"
#include "tests/core/fidelity.h"
#include "tests/core/random_options.h"
#include "tests/core/test_backends.h"

namespace attention::core {
namespace {

using testing::FidelityStats;
using testing::RandomFloats;
using testing::TestDevices;
using testing::TestSeed;

// One buffer in GPU memory (cudaMalloc) or, `pinned`, page-locked host memory
// (cudaHostAlloc), holding a copy of host values; a failure fails the test.
class GpuCopy {
 public:
  GpuCopy(const void* host, size_t bytes, bool pinned = false) : bytes_(bytes), pinned_(pinned) {
    const size_t allocated = bytes == 0 ? 1 : bytes;
    EXPECT_EQ(pinned ? cudaHostAlloc(&data_, allocated, cudaHostAllocPortable)
                     : cudaMalloc(&data_, allocated),
              cudaSuccess)
        << bytes << " bytes";
    if (host != nullptr) {
      EXPECT_EQ(cudaMemcpy(data_, host, bytes, cudaMemcpyDefault), cudaSuccess);
    } else {
      EXPECT_EQ(cudaMemset(data_, 0xff, bytes), cudaSuccess);  // NaN until written
    }
  }
  GpuCopy(const GpuCopy&) = delete;
  GpuCopy& operator=(const GpuCopy&) = delete;
  ~GpuCopy() { pinned_ ? cudaFreeHost(data_) : cudaFree(data_); }

  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  template <typename T>
  std::vector<T> Download() const {
    std::vector<T> host(bytes_ / sizeof(T));
    EXPECT_EQ(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
  bool pinned_;
};

class CudaInPlaceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    const cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess || count == 0) {
      GTEST_SKIP() << "no CUDA device: "
                   << (error != cudaSuccess ? cudaGetErrorString(error) : "none visible");
    }
    auto backend = TestDevices().Get("cuda:0");
    if (!backend.ok()) GTEST_SKIP() << "cuda:0 cannot run here: " << backend.status().message();
    backend_ = *std::move(backend);
    ASSERT_EQ(backend_->InPlaceGpu(), 0);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  }

  std::shared_ptr<const MhaLayer> Layer(DType compute_dtype, uint64_t seed) const {
    MhaConfig config;
    config.embed_dim = 64;
    config.num_heads = 4;
    config.compute_dtype = compute_dtype;
    const MhaConfig resolved = *MhaConfig::Resolve(config);
    auto layer = MhaLayer::Create(resolved, MhaWeights::Random(resolved, seed), backend_);
    EXPECT_TRUE(layer.ok()) << layer.status();
    return layer.ok() ? *std::move(layer) : nullptr;
  }

  std::shared_ptr<const Backend> backend_;
};

std::vector<uint16_t> Rounded(absl::Span<const float> values, DType dtype) {
  std::vector<uint16_t> bits(values.size());
  for (size_t e = 0; e < values.size(); ++e) {
    bits[e] = dtype == DType::kFloat16 ? FloatToHalf(values[e]) : FloatToBFloat16(values[e]);
  }
  return bits;
}

TEST_F(CudaInPlaceTest, GpuInputsAndAnswersMatchHostOnesBitwise) {
  const uint64_t seed = TestSeed(2026);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  for (DType layer_dtype : {DType::kFloat32, DType::kBFloat16}) {
    const std::shared_ptr<const MhaLayer> layer = Layer(layer_dtype, rng());
    ASSERT_NE(layer, nullptr);
    for (DType input_dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      for (bool bf16_answer : {false, true}) {
        for (InputMemory memory : {InputMemory::kGpu, InputMemory::kPinnedHost}) {
          const bool pinned = memory == InputMemory::kPinnedHost;
          SCOPED_TRACE(absl::StrCat("layer ", DTypeName(layer_dtype), ", inputs ",
                                    DTypeName(input_dtype), bf16_answer ? ", bf16 answer" : "",
                                    pinned ? ", inputs in page-locked host memory" : ""));
          // Input 0 (2 x 17 tokens, causal) in GPU memory or on the host; input 1 (1 x 5) on
          // the host in both batches.
          const std::vector<float> values = RandomFloats(rng, 2 * 17 * 64);
          const std::vector<uint16_t> bits = input_dtype == DType::kFloat32
                                                 ? std::vector<uint16_t>()
                                                 : Rounded(values, input_dtype);
          const std::vector<float> other = RandomFloats(rng, 1 * 5 * 64);
          const bool half = input_dtype != DType::kFloat32;
          const GpuCopy on_gpu(half ? static_cast<const void*>(bits.data()) : values.data(),
                               half ? bits.size() * 2 : values.size() * 4, pinned);
          const int64_t answer_elements = 2 * 17 * layer->config().output_dim;
          const GpuCopy answer_on_gpu(nullptr, answer_elements * (bf16_answer ? 2 : 4));
          std::vector<float> host_answer(answer_elements);
          std::vector<uint16_t> host_answer_bf16(answer_elements);

          const auto batch = [&](bool gpu) {
            MhaInput in;
            in.batch = 2;
            in.q_len = in.kv_len = 17;
            in.options.causal = true;
            if (half) {
              in.half_dtype = input_dtype;
              in.query_half = gpu ? absl::MakeConstSpan(on_gpu.as<uint16_t>(), bits.size())
                                  : absl::MakeConstSpan(bits);
            } else {
              in.query = gpu ? absl::MakeConstSpan(on_gpu.as<float>(), values.size())
                             : absl::MakeConstSpan(values);
            }
            in.inputs_memory = gpu ? memory : InputMemory::kHost;
            if (bf16_answer) {
              in.output_destination_bf16 =
                  gpu ? absl::MakeSpan(answer_on_gpu.as<uint16_t>(), answer_elements)
                      : absl::MakeSpan(host_answer_bf16);
            } else {
              in.output_destination =
                  gpu ? absl::MakeSpan(answer_on_gpu.as<float>(), answer_elements)
                      : absl::MakeSpan(host_answer);
            }
            in.output_on_gpu = gpu;
            return in;
          };
          MhaInput second;
          second.batch = 1;
          second.q_len = second.kv_len = 5;
          second.query = other;
          const MhaInput from_gpu = batch(true), from_host = batch(false);
          ASSERT_TRUE(layer->ValidateInput(from_gpu).ok()) << layer->ValidateInput(from_gpu);
          const auto gpu_results = layer->ForwardBatch({&from_gpu, &second});
          const auto host_results = layer->ForwardBatch({&from_host, &second});
          ASSERT_TRUE(gpu_results.ok()) << gpu_results.status();
          ASSERT_TRUE(host_results.ok()) << host_results.status();
          EXPECT_TRUE((*gpu_results)[0].output.empty());  // the answer went to the GPU
          if (bf16_answer) {
            EXPECT_EQ(answer_on_gpu.Download<uint16_t>(), host_answer_bf16);
          } else {
            const std::vector<float> answer = answer_on_gpu.Download<float>();
            EXPECT_EQ(std::memcmp(answer.data(), host_answer.data(), answer.size() * 4), 0);
          }
          EXPECT_EQ((*gpu_results)[1].output, (*host_results)[1].output);
        }
      }
    }
  }
}

TEST_F(CudaInPlaceTest, BatchesInOverlappedChunksFollowTheRule) {
  // 8 MiB of host input and answer beside a GPU input cuts the batch into chunks on two
  // streams; the GPU input's sequences land in several of them.
  const uint64_t seed = TestSeed(2027);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  const std::shared_ptr<const MhaLayer> layer = Layer(DType::kFloat32, rng());
  ASSERT_NE(layer, nullptr);
  const int64_t e = layer->config().embed_dim;
  const std::vector<float> gpu_values = RandomFloats(rng, 24 * 40 * e);
  const std::vector<float> host_values = RandomFloats(rng, 64 * 256 * e);
  const GpuCopy on_gpu(gpu_values.data(), gpu_values.size() * 4);
  const GpuCopy answer_on_gpu(nullptr, gpu_values.size() * 4);
  MhaInput from_gpu;
  from_gpu.batch = 24;
  from_gpu.q_len = from_gpu.kv_len = 40;
  from_gpu.query = absl::MakeConstSpan(on_gpu.as<float>(), gpu_values.size());
  from_gpu.output_destination = absl::MakeSpan(answer_on_gpu.as<float>(), gpu_values.size());
  from_gpu.inputs_memory = InputMemory::kGpu;
  from_gpu.output_on_gpu = true;
  MhaInput from_host;
  from_host.batch = 64;
  from_host.q_len = from_host.kv_len = 256;
  from_host.query = host_values;
  const auto results = layer->ForwardBatch({&from_gpu, &from_host});
  ASSERT_TRUE(results.ok()) << results.status();

  FidelityStats outputs("in-place chunked batch outputs");
  MhaInput gpu_values_on_host = from_gpu;
  gpu_values_on_host.query = gpu_values;
  gpu_values_on_host.inputs_memory = InputMemory::kHost;
  gpu_values_on_host.output_on_gpu = false;
  gpu_values_on_host.output_destination = {};
  const std::vector<float> answer = answer_on_gpu.Download<float>();
  EXPECT_TRUE(outputs.Check(answer, layer->ForwardTextbook<float>(gpu_values_on_host).output,
                            layer->ForwardTextbook<double>(gpu_values_on_host).output))
      << "the GPU input's answer";
  EXPECT_TRUE(outputs.Check((*results)[1].output, layer->ForwardTextbook<float>(from_host).output,
                            layer->ForwardTextbook<double>(from_host).output))
      << "the host input's answer";
}

}  // namespace
}  // namespace attention::core

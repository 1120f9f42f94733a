// The CUDA paged decode kernel (core/cuda/paged_decode.h) against the dense references of
// the CPU kernel's test (paged_attention_cpu_test.cc), over the same seeded grids:
// FlashAttention's fidelity rule, NaN-filled blocks outside the tables, bitwise the same
// alone and batched. Without a GPU every test that needs one reports SKIPPED with the
// reason; the refusals, made before any device call, run everywhere.
#include "core/cuda/paged_decode.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/cuda/paged_decode_plan.h"
#include "core/devices.h"
#include "core/mha_layer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/fidelity.h"
#include "tests/core/paged_decode_fixture.h"

namespace attention::core::cuda {
namespace {

using kv_cache::BlockId;
using testing::FidelityStats;
using testing::HostPagedPool;
using testing::PagedMatchesReferences;
using testing::PagedSequence;
using testing::PagedShape;

// Why no test can run here, or empty.
std::string NoGpuReason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) return std::string("no CUDA device: ") + cudaGetErrorString(error);
  if (count == 0) return "no CUDA device";
  return "";
}

// One cudaMalloc'd array; a failure fails the test that made it.
class DeviceArray {
 public:
  explicit DeviceArray(size_t bytes) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&data_, bytes == 0 ? 1 : bytes), cudaSuccess) << bytes << " bytes";
  }
  DeviceArray(const void* host, size_t bytes) : DeviceArray(bytes) { Upload(host); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(data_); }

  void Upload(const void* host) {
    EXPECT_EQ(cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  void Download(void* host) const {
    EXPECT_EQ(cudaMemcpy(host, data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  template <typename T>
  T* As() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

template <typename T>
std::unique_ptr<DeviceArray> ToDevice(const std::vector<T>& host) {
  return std::make_unique<DeviceArray>(host.data(), host.size() * sizeof(T));
}

// The host pool's storage, tables and queries on the device; Run computes a batch there and
// brings its outputs back into the host pool's sequences.
class DevicePagedPool {
 public:
  explicit DevicePagedPool(HostPagedPool& host) : host_(host) {
    EXPECT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    storage_ = ToDevice(host.bytes());
    for (const PagedSequence& s : host.sequences()) {
      tables_.push_back(ToDevice(s.table));
      queries_.push_back(ToDevice(s.query));
      outputs_.push_back(std::make_unique<DeviceArray>(s.output.size() * sizeof(float)));
      log_sum_exps_.push_back(std::make_unique<DeviceArray>(s.log_sum_exp.size() * sizeof(float)));
    }
  }
  ~DevicePagedPool() { cudaStreamDestroy(stream_); }

  // After the host changed sequence i's table.
  void UploadTable(size_t i) { tables_[i] = ToDevice(host_.sequences()[i].table); }

  // `indices` as one batch; outputs start as NaN on the device, so one not written shows.
  // With `share_prefixes`, forks of one prefix share their splits (FindSharedPrefixes over
  // the host's tables), their queries copied one after another as the kernels read them.
  absl::Status Run(const std::vector<size_t>& indices, bool log_sum_exp = true,
                   bool own_scratch = false, bool share_prefixes = false,
                   PagedAttendStats* stats = nullptr) {
    std::vector<SharedPrefixGroup> shared;
    std::vector<const float*> grouped_queries(indices.size(), nullptr);
    if (share_prefixes) {
      std::vector<PagedDecodeSequence> host_entries;
      shared = FindSharedPrefixes(host_.Batch(indices, host_entries), kCudaPagedSplitKeys);
      std::vector<float> queries;
      std::vector<size_t> starts;
      for (const SharedPrefixGroup& group : shared) {
        for (const int64_t k : group.sequences) {
          const std::vector<float>& query = host_.sequences()[indices[k]].query;
          starts.push_back(queries.size());
          queries.insert(queries.end(), query.begin(), query.end());
        }
      }
      grouped_queries_ = ToDevice(queries);
      size_t next = 0;
      for (const SharedPrefixGroup& group : shared) {
        for (const int64_t k : group.sequences) {
          grouped_queries[k] = grouped_queries_->As<float>() + starts[next++];
        }
      }
    }
    std::vector<PagedDecodeSequence> sequences;
    for (const size_t i : indices) {
      PagedSequence& s = host_.sequences()[i];
      EXPECT_EQ(cudaMemset(outputs_[i]->As<void>(), 0xff, s.output.size() * sizeof(float)),
                cudaSuccess);
      EXPECT_EQ(
          cudaMemset(log_sum_exps_[i]->As<void>(), 0xff, s.log_sum_exp.size() * sizeof(float)),
          cudaSuccess);
      const float* query = grouped_queries[sequences.size()] != nullptr
                               ? grouped_queries[sequences.size()]
                               : queries_[i]->As<float>();
      sequences.push_back({absl::Span<const BlockId>(tables_[i]->As<BlockId>(), s.table.size()),
                           s.length, s.queries, query, outputs_[i]->As<float>(),
                           log_sum_exp ? log_sum_exps_[i]->As<float>() : nullptr});
    }
    PagedDecodeBatch batch;
    batch.storage = {storage_->As<void>(), host_.block_bytes(), host_.num_blocks()};
    batch.layout = host_.layout();
    batch.tokens_per_block = host_.shape().tokens_per_block;
    batch.num_heads = host_.shape().heads;
    batch.scale = host_.scale();
    batch.sliding_window = host_.sliding_window;
    batch.sequences = sequences;
    batch.stats = stats;
    absl::Status status;
    std::unique_ptr<DeviceArray> scratch;
    if (own_scratch) {
      const absl::StatusOr<int64_t> bytes = PagedDecodeCudaScratchBytes(batch, shared);
      if (!bytes.ok()) return bytes.status();
      scratch = std::make_unique<DeviceArray>(*bytes);
      status = PagedDecodeCuda(batch, scratch->As<void>(), *bytes, stream_, shared);
    } else {
      status = PagedDecodeCuda(batch, stream_, shared);
    }
    if (!status.ok()) return status;
    const cudaError_t error = cudaStreamSynchronize(stream_);
    if (error != cudaSuccess) return absl::InternalError(cudaGetErrorString(error));
    for (const size_t i : indices) {
      PagedSequence& s = host_.sequences()[i];
      outputs_[i]->Download(s.output.data());
      if (log_sum_exp) log_sum_exps_[i]->Download(s.log_sum_exp.data());
    }
    return absl::OkStatus();
  }

 private:
  HostPagedPool& host_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceArray> storage_;
  std::vector<std::unique_ptr<DeviceArray>> tables_, queries_, outputs_, log_sum_exps_;
  std::unique_ptr<DeviceArray> grouped_queries_;
};

// Whether the kernel reads `pool` with vector loads (see PagedDecodePlan::key_vector).
bool VectorLoads(HostPagedPool& pool, uint64_t storage_address) {
  PagedDecodeDims d;
  d.num_heads = pool.shape().heads;
  d.num_kv_heads = pool.shape().kv_heads;
  d.key_dim = pool.shape().key_dim;
  d.value_dim = pool.shape().value_dim;
  d.element_bytes = pool.layout().ElementBytes();
  d.tokens_per_block = pool.shape().tokens_per_block;
  d.block_bytes = pool.block_bytes();
  d.storage_address = storage_address;
  return PlanPagedDecode(d, {{1, 1}}).vector > 1;
}

// A KV storage on GPU 0 holding every block of `pool`, as a session table's would; null
// (the test failed) when it cannot be made.
std::unique_ptr<kv_cache::KvStorage> GpuStorageHolding(Devices& devices,
                                                       const HostPagedPool& pool) {
  absl::StatusOr<std::unique_ptr<kv_cache::KvStorage>> storage =
      devices.CreateKvStorage("cuda:0", pool.num_blocks(), pool.block_bytes());
  EXPECT_TRUE(storage.ok()) << storage.status();
  if (!storage.ok()) return nullptr;
  const absl::Status written = pool.WriteBlocksTo(**storage);
  EXPECT_TRUE(written.ok()) << written;
  return written.ok() ? *std::move(storage) : nullptr;
}

class CudaPagedDecodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = NoGpuReason(); !why.empty()) GTEST_SKIP() << why;
  }
};

TEST_F(CudaPagedDecodeTest, MatchesDenseReferencesOverASeededGrid) {
  constexpr uint64_t kSeed = 25;  // the CPU test's grid
  std::mt19937_64 rng(kSeed);
  FidelityStats outputs("cuda paged decode output"), lses("cuda paged decode log-sum-exp");
  struct Heads {
    int64_t heads, kv_heads;
  };
  // GQA groups 1, 4 and 8, and MQA.
  const Heads head_shapes[] = {{2, 2}, {8, 2}, {16, 2}, {4, 1}};
  const std::pair<int64_t, int64_t> head_dims[] = {{40, 24}, {64, 80}, {16, 16}};
  int cases = 0, vector_cases = 0;
  for (const int64_t length : {1, 54, 97, 512, 1500, 5000}) {
    for (const int64_t queries : {1, 3, 17}) {
      if (queries > length) continue;
      for (const Heads& heads : head_shapes) {
        for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
          const auto [key_dim, value_dim] = head_dims[rng() % 3];
          // Blocks of 1, 5 or 16 tokens: partial last blocks for most lengths.
          const int64_t tokens_per_block = std::vector<int64_t>{1, 5, 16}[rng() % 3];
          const uint64_t seed = rng();
          // Every other case with blocks 16-byte aligned (vector loads), else 8 (scalar).
          const int64_t slack = cases % 2 == 0 ? 16 : 8;
          const PagedShape shape{heads.heads, heads.kv_heads,   key_dim,
                                 value_dim,   tokens_per_block, dtype};
          SCOPED_TRACE(::testing::Message()
                       << "seed " << seed << " (grid seed " << kSeed << "): L " << length << " n "
                       << queries << " H " << heads.heads << " H_kv " << heads.kv_heads << " dk "
                       << key_dim << " dv " << value_dim << " tokens/block " << tokens_per_block
                       << " " << DTypeName(dtype) << " slack " << slack);
          HostPagedPool pool(shape, {{length, queries}}, seed, slack);
          DevicePagedPool device(pool);
          ASSERT_TRUE(device.Run({0}).ok());
          ASSERT_TRUE(PagedMatchesReferences(pool, 0, outputs, lses));
          vector_cases += VectorLoads(pool, 256) ? 1 : 0;  // cudaMalloc: 256-byte aligned
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 6 * 3 * 4 * 2 - 2 * 4 * 2);  // n > L skipped for L = 1
  EXPECT_GT(vector_cases, cases / 4);           // both load paths are covered
  EXPECT_LT(vector_cases, cases);
}

TEST_F(CudaPagedDecodeTest, SlidingWindowMatchesDenseReferences) {
  // Windows shorter than a block, than a split and than the sequence, and longer than it;
  // the splits before the first query's window are not run.
  constexpr uint64_t kSeed = 26;  // the CPU test's grid
  std::mt19937_64 rng(kSeed);
  FidelityStats outputs("cuda windowed output"), lses("cuda windowed log-sum-exp");
  int cases = 0;
  for (const int64_t length : {54, 1500, 5000}) {
    for (const int64_t queries : {1, 17}) {
      for (const int64_t window : {1, 7, 1024, 1500, 4096}) {
        const DType dtype = rng() % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
        const uint64_t seed = rng();
        const PagedShape shape{8, 2, 40, 24, 5, dtype};
        SCOPED_TRACE(::testing::Message()
                     << "seed " << seed << " (grid seed " << kSeed << "): L " << length << " n "
                     << queries << " window " << window << " " << DTypeName(dtype));
        HostPagedPool pool(shape, {{length, queries}}, seed, 16);
        pool.sliding_window = window;
        DevicePagedPool device(pool);
        ASSERT_TRUE(device.Run({0}).ok());
        ASSERT_TRUE(PagedMatchesReferences(pool, 0, outputs, lses));
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 3 * 2 * 5);
}

TEST_F(CudaPagedDecodeTest, WideRowsMatchDenseReferences) {
  // The kernels of more vectors per lane (PagedDecodePlan::chunks): float32 rows of 256 and
  // 512 (4 float4s a lane), bfloat16 of 512 (2 vectors of 8), and scalars of 200 (16 a lane).
  FidelityStats outputs("cuda wide output"), lses("cuda wide log-sum-exp");
  struct Case {
    int64_t key_dim, value_dim;
    DType dtype;
    int64_t slack;
    int chunks;
  };
  const Case cases[] = {{256, 256, DType::kFloat32, 16, 4},
                        {512, 384, DType::kFloat32, 16, 4},
                        {192, 512, DType::kBFloat16, 16, 2},
                        {200, 200, DType::kFloat32, 8, 16},
                        {136, 72, DType::kBFloat16, 8, 16}};
  uint64_t seed = 40;
  for (const Case& c : cases) {
    for (const int64_t length : {97, 700}) {
      SCOPED_TRACE(::testing::Message()
                   << "dk " << c.key_dim << " dv " << c.value_dim << " " << DTypeName(c.dtype)
                   << " slack " << c.slack << " L " << length);
      const PagedShape shape{8, 2, c.key_dim, c.value_dim, 16, c.dtype};
      HostPagedPool pool(shape, {{length, 3}}, ++seed, c.slack);
      PagedDecodeDims d;
      d.num_heads = 8;
      d.num_kv_heads = 2;
      d.key_dim = c.key_dim;
      d.value_dim = c.value_dim;
      d.element_bytes = pool.layout().ElementBytes();
      d.tokens_per_block = 16;
      d.block_bytes = pool.block_bytes();
      d.storage_address = 256;  // cudaMalloc's alignment
      EXPECT_EQ(PlanPagedDecode(d, {{length, 3}}).chunks, c.chunks);
      DevicePagedPool device(pool);
      ASSERT_TRUE(device.Run({0}).ok());
      ASSERT_TRUE(PagedMatchesReferences(pool, 0, outputs, lses));
    }
  }
}

// Outputs and log-sum-exps of every sequence, to compare bitwise.
std::vector<std::vector<float>> Results(HostPagedPool& pool) {
  std::vector<std::vector<float>> results;
  for (const PagedSequence& s : pool.sequences()) {
    results.push_back(s.output);
    results.push_back(s.log_sum_exp);
  }
  return results;
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_F(CudaPagedDecodeTest, ResultsAreBitwiseTheSameAloneAndBatched) {
  for (const int64_t window : {0, 700}) {
    for (const int64_t slack : {16, 8}) {  // vector and scalar loads
      SCOPED_TRACE(::testing::Message() << "window " << window << " slack " << slack);
      const PagedShape shape{8, 2, 64, 48, 16, DType::kBFloat16};
      // Several splits, and a short sequence.
      HostPagedPool pool(shape, {{5000, 3}, {97, 1}, {2049, 17}}, 7, slack);
      pool.sliding_window = window;
      DevicePagedPool device(pool);
      ASSERT_TRUE(device.Run({0, 1, 2}).ok());
      const std::vector<std::vector<float>> batched = Results(pool);
      FidelityStats outputs("cuda batched output"), lses("cuda batched log-sum-exp");
      for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(PagedMatchesReferences(pool, i, outputs, lses));
      ASSERT_TRUE(device.Run({2, 0, 1}).ok());  // another order
      EXPECT_EQ(Results(pool), batched);
      for (size_t i = 0; i < 3; ++i) {
        ASSERT_TRUE(device.Run({i}).ok());  // alone
        EXPECT_TRUE(BitwiseEqual(pool.sequences()[i].output, batched[2 * i])) << "sequence " << i;
        EXPECT_TRUE(BitwiseEqual(pool.sequences()[i].log_sum_exp, batched[2 * i + 1]))
            << "sequence " << i;
      }
      // The caller's scratch, and no log-sum-exp asked for: the same outputs.
      ASSERT_TRUE(device.Run({0, 1, 2}, /*log_sum_exp=*/false, /*own_scratch=*/true).ok());
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_TRUE(BitwiseEqual(pool.sequences()[i].output, batched[2 * i])) << "sequence " << i;
      }
    }
  }
}

TEST_F(CudaPagedDecodeTest, BatchesLargerThanALaunchMatchTheirSequencesAlone) {
  // More sequences than one launch's parameter holds, of mixed lengths and query counts.
  const PagedShape shape{4, 1, 32, 32, 8, DType::kFloat32};
  std::vector<std::pair<int64_t, int64_t>> lengths;
  std::vector<size_t> all;
  for (int64_t b = 0; b < kCudaPagedSequencesPerLaunch + 9; ++b) {
    lengths.push_back({1 + (b * 37) % 400, 1 + b % 3});
    all.push_back(b);
  }
  HostPagedPool pool(shape, lengths, 5, 16);
  DevicePagedPool device(pool);
  ASSERT_TRUE(device.Run(all).ok());
  const std::vector<std::vector<float>> batched = Results(pool);
  FidelityStats outputs("cuda many output"), lses("cuda many log-sum-exp");
  for (size_t i = 0; i < all.size(); ++i) {
    ASSERT_TRUE(PagedMatchesReferences(pool, i, outputs, lses)) << "sequence " << i;
    ASSERT_TRUE(device.Run({i}).ok());
    EXPECT_TRUE(BitwiseEqual(pool.sequences()[i].output, batched[2 * i])) << "sequence " << i;
  }
}

// Forks of one 2,048-key prefix (8 of its splits) with 1-3 queries each: sharing its splits
// gives every member bitwise the results it gets without, by PagedDecodeCuda and through the
// CUDA KV storage of sessions (which finds the groups itself); both within the rule.
TEST_F(CudaPagedDecodeTest, ForksSharingTheirPrefixGetTheirOwnResultsBitwise) {
  constexpr uint64_t kSeed = 41;
  for (const DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(::testing::Message() << DTypeName(dtype) << ", seed " << kSeed);
    const PagedShape shape{8, 2, 64, 48, 16, dtype};
    HostPagedPool pool(shape, {{2600, 1}, {8000, 1}}, kSeed, 16);
    std::vector<size_t> forks = {0};
    for (int f = 0; f < 9; ++f) {
      forks.push_back(pool.AddFork(0, 128, 2049 + (131 * f) % 500, 1 + f % 3, kSeed + 1 + f));
    }
    DevicePagedPool device(pool);
    ASSERT_TRUE(device.Run(forks).ok());
    const std::vector<std::vector<float>> alone = Results(pool);
    PagedAttendStats stats;
    ASSERT_TRUE(device.Run(forks, true, false, /*share_prefixes=*/true, &stats).ok());
    EXPECT_EQ(stats.shared_blocks, 128);
    EXPECT_EQ(stats.keys_not_reread, 2048 * 9);
    FidelityStats outputs("cuda shared output"), lses("cuda shared log-sum-exp");
    for (const size_t i : forks) {
      ASSERT_TRUE(PagedMatchesReferences(pool, i, outputs, lses)) << "sequence " << i;
      EXPECT_TRUE(BitwiseEqual(pool.sequences()[i].output, alone[2 * i])) << "sequence " << i;
      EXPECT_TRUE(BitwiseEqual(pool.sequences()[i].log_sum_exp, alone[2 * i + 1]))
          << "sequence " << i;
    }
    // The caller's scratch, sized for the groups.
    ASSERT_TRUE(device.Run(forks, true, /*own_scratch=*/true, /*share_prefixes=*/true).ok());
    EXPECT_EQ(Results(pool), alone);

    Devices devices(1);
    const std::unique_ptr<kv_cache::KvStorage> storage = GpuStorageHolding(devices, pool);
    ASSERT_NE(storage, nullptr);
    std::vector<PagedDecodeSequence> entries;
    PagedDecodeBatch batch = pool.Batch(forks, entries);
    PagedAttendStats session_stats;
    batch.stats = &session_stats;
    ASSERT_TRUE(storage->Attend(batch).ok());
    EXPECT_EQ(session_stats.shared_blocks, 128);
    EXPECT_EQ(Results(pool), alone);
  }
}

// `ours` ([n][H][dv], a session step's output rows) of sequence `s` against PyTorch's bf16
// attention on the same queries, keys and values (SdpaHalfTextbook), by the bf16 rule.
::testing::AssertionResult StepFollowsTheBf16Rule(const PagedShape& shape, const PagedSequence& s,
                                                  int64_t sliding_window, FidelityStats& stats) {
  const int64_t n = s.queries, l = s.length, h = shape.heads, hkv = shape.kv_heads;
  const int64_t dk = shape.key_dim, dv = shape.value_dim;
  // The step's rows [n][H][d] and the cache's [L][Hkv][d] as SDPA's [H][n][d] and [Hkv][L][d].
  std::vector<float> query(h * n * dk), keys(hkv * l * dk), values(hkv * l * dv), ours(h * n * dv);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t head = 0; head < h; ++head) {
      std::memcpy(&query[(head * n + i) * dk], &s.query[(i * h + head) * dk], dk * sizeof(float));
      std::memcpy(&ours[(head * n + i) * dv], &s.output[(i * h + head) * dv], dv * sizeof(float));
    }
  }
  for (int64_t t = 0; t < l; ++t) {
    for (int64_t head = 0; head < hkv; ++head) {
      std::memcpy(&keys[(head * l + t) * dk], &s.keys[(t * hkv + head) * dk], dk * sizeof(float));
      std::memcpy(&values[(head * l + t) * dv], &s.values[(t * hkv + head) * dv],
                  dv * sizeof(float));
    }
  }
  SdpaInput input;
  input.dims = {1, h, hkv, n, l, dk, dv};
  input.query = query;
  input.key = keys;
  input.value = values;
  input.options.causal = true;  // bottom-right: query i at position L - n + i
  input.options.sliding_window = sliding_window;
  input.compute_dtype = DType::kBFloat16;
  const TextbookResult<float> reference = SdpaHalfTextbook(input);
  const TextbookResult<double> oracle = SdpaTextbook<double>(input);
  return stats.CheckBf16(ours, reference.output, oracle.output);
}

// Steps of BFLOAT16 layers' sessions over bf16 KV run on cuDNN's paged SDPA over the GPU
// storage's blocks in place (the storage counts the path), decode steps and chunks of
// queries in one batch, with and without a sliding window, within the bf16 rule; the
// blocks past each sequence's keys hold NaN, which must not show. Sessions that compute in
// float32 stay on the project's kernel.
TEST_F(CudaPagedDecodeTest, Bf16LayerStepsRunOnCudnnWithinTheBf16Rule) {
  constexpr uint64_t kSeed = 4023;
  const PagedShape shape{8, 2, 64, 64, 64, DType::kBFloat16};  // 64 tokens a block, as Llama's
  for (const int64_t window : {int64_t{0}, int64_t{200}}) {
    SCOPED_TRACE(::testing::Message() << "window " << window << ", seed " << kSeed);
    HostPagedPool pool(shape, {{300, 1}, {1000, 1}, {77, 1}, {2050, 16}, {513, 40}}, kSeed, 16);
    pool.sliding_window = window;
    Devices devices(1);
    const std::unique_ptr<kv_cache::KvStorage> storage = GpuStorageHolding(devices, pool);
    ASSERT_NE(storage, nullptr);
    std::vector<PagedDecodeSequence> entries;
    PagedDecodeBatch batch = pool.Batch({0, 1, 2, 3, 4}, entries, /*with_log_sum_exp=*/false);
    const int64_t kernels = storage->AttendCallsByPath()["kernels"];
    ASSERT_TRUE(storage->Attend(batch).ok());
    EXPECT_EQ(storage->AttendCallsByPath()["kernels"], kernels + 1) << "a float32 session";
    batch.bf16_products = true;
    const int64_t cudnn = storage->AttendCallsByPath()["cudnn"];
    const absl::Status attended = storage->Attend(batch);
    ASSERT_TRUE(attended.ok()) << attended;
    if (storage->AttendCallsByPath()["cudnn"] == cudnn) {
      GTEST_SKIP() << "cuDNN's paged SDPA did not take the step on this GPU (the plugin's "
                      "start-up line says why)";
    }
    FidelityStats stats("cuDNN paged SDPA output");
    for (size_t i = 0; i < pool.sequences().size(); ++i) {
      EXPECT_TRUE(StepFollowsTheBf16Rule(shape, pool.sequences()[i], window, stats))
          << "sequence " << i;
    }
  }
}

// A group whose members' queries are not one after another is refused, naming them, before
// any device call (so on every machine).
TEST(CudaPagedDecodeRefusalTest, RefusesAGroupWhoseQueriesAreApart) {
  const PagedShape shape{4, 2, 32, 32, 16, DType::kFloat32};
  HostPagedPool pool(shape, {{600, 1}, {2000, 1}}, 43, 16);
  const size_t fork = pool.AddFork(0, 32, 700, 1, 44);
  std::vector<PagedDecodeSequence> entries;
  PagedDecodeBatch batch = pool.Batch({0, fork}, entries);
  std::vector<SharedPrefixGroup> shared = FindSharedPrefixes(batch, kCudaPagedSplitKeys);
  ASSERT_EQ(shared.size(), 1u);
  // Host pointers stand in for device ones.
  const absl::Status status = PagedDecodeCuda(batch, nullptr, shared);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "paged decode: shared group 0: the queries of sequence 1 do not follow those of "
            "sequence 0");
}

TEST_F(CudaPagedDecodeTest, AReadOutsideTheBlockTableShows) {
  // The negative control of the NaN poisoning: a table naming one unwritten block.
  const PagedShape shape{4, 2, 32, 32, 8, DType::kFloat32};
  HostPagedPool pool(shape, {{40, 1}}, 11, 16);
  std::vector<BlockId>& table = pool.sequences()[0].table;
  const std::vector<BlockId> written = table;
  for (BlockId b = 0; std::find(written.begin(), written.end(), table[2]) != written.end(); ++b) {
    table[2] = b;  // the first block no sequence wrote
  }
  DevicePagedPool device(pool);
  device.UploadTable(0);
  ASSERT_TRUE(device.Run({0}).ok());
  EXPECT_TRUE(std::isnan(pool.sequences()[0].output[0]));
  FidelityStats outputs("poisoned"), lses("poisoned lse");
  EXPECT_FALSE(PagedMatchesReferences(pool, 0, outputs, lses));
  // A block id outside the storage is not read: NaN, and no fault.
  table[2] = 1 << 20;
  device.UploadTable(0);
  ASSERT_TRUE(device.Run({0}).ok());
  EXPECT_TRUE(std::isnan(pool.sequences()[0].output[0]));
  table[2] = -1;
  device.UploadTable(0);
  ASSERT_TRUE(device.Run({0}).ok());
  EXPECT_TRUE(std::isnan(pool.sequences()[0].log_sum_exp[0]));
}

TEST_F(CudaPagedDecodeTest, RefusesScratchTooSmall) {
  const PagedShape shape{4, 2, 32, 32, 8, DType::kFloat32};
  HostPagedPool pool(shape, {{300, 2}}, 3, 16);
  PagedSequence& s = pool.sequences()[0];
  const std::vector<PagedDecodeSequence> sequences = {
      {s.table, s.length, s.queries, s.query.data(), s.output.data(), nullptr}};
  PagedDecodeBatch batch;
  batch.storage = {pool.bytes().data(), pool.block_bytes(), pool.num_blocks()};
  batch.layout = pool.layout();
  batch.tokens_per_block = 8;
  batch.num_heads = 4;
  batch.sequences = sequences;
  // 2 KV heads * 2 splits * 4 rows * (32 + 2) floats.
  EXPECT_EQ(*PagedDecodeCudaScratchBytes(batch), 4 * 2 * 2 * 4 * 34);
  const absl::Status status = PagedDecodeCuda(batch, nullptr, 100, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("scratch_bytes 100 < the 2176 needed"));
}

// The CPU kernel's refusals with its messages, but for block ids (on the device, not read by
// the host). Made before any device call: no GPU needed.
TEST(CudaPagedDecodeRefusalTest, RefusesMalformedBatches) {
  const PagedShape shape{4, 2, 32, 32, 8, DType::kFloat32};
  HostPagedPool pool(shape, {{20, 2}}, 3);
  PagedSequence& s = pool.sequences()[0];
  int64_t window = 0;
  const float* query = s.query.data();
  // Host pointers in place of device ones: a refused batch is never read.
  const auto run = [&] {
    const std::vector<PagedDecodeSequence> sequences = {
        {s.table, s.length, s.queries, query, s.output.data(), nullptr}};
    PagedDecodeBatch batch;
    batch.storage = {pool.bytes().data(), pool.block_bytes(), pool.num_blocks()};
    batch.layout = pool.layout();
    batch.tokens_per_block = 8;
    batch.num_heads = 4;
    batch.sliding_window = window;
    batch.sequences = sequences;
    return PagedDecodeCuda(batch, nullptr);
  };
  s.length = 0, s.queries = 0;  // an empty sequence with no query
  absl::Status status = run();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("num_queries 0 and length 0"));
  s.length = 2, s.queries = 3;
  EXPECT_EQ(run().code(), absl::StatusCode::kInvalidArgument);
  s.length = 20, s.queries = 2;
  s.table.pop_back();
  status = run();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              ::testing::HasSubstr("needs 3 blocks of 8 tokens; its block table has 2"));
  s.table.push_back(s.table.front());
  window = -1;
  status = run();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("sliding_window -1 must be >= 0"));
  window = 0;
  query = nullptr;
  status = run();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("sequence 0 lacks its query or output"));
}

}  // namespace
}  // namespace attention::core::cuda

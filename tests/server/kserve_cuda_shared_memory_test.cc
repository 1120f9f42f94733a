// Triton's CUDA shared memory extension on the KServe endpoint: every rejection of a
// registration with its status and message, the one namespace and limit it shares with
// system shared memory, and calls through a real server whose inputs and outputs pass
// through GPU regions (answers equal the raw call's bitwise). Everywhere over a twin of the
// GPU side (host memory behind core::SharedDeviceMemory, opened as the plugin would open a
// handle); where a GPU exists, over a real cudaIpcMemHandle that another process
// (cuda_ipc_exporter) exported, and SKIPPED with the reason elsewhere.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include <grpcpp/create_channel.h>

#include "absl/strings/str_cat.h"
#include "core/devices.h"
#include "core/dtype.h"
#include "core/half_bits.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/kserve/kserve_convert.h"
#include "server/kserve/shared_memory.h"
#include "server/validation/input_decoding.h"
#include "tests/core/random_options.h"
#include "tests/server/cuda_ipc_exporter_process.h"
#include "tests/server/shared_memory_testing.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

using attention::testing::CudaIpcExporter;
using inference::CudaSharedMemoryRegisterRequest;
using inference::ModelInferRequest;
using kserve::SharedMemory;

constexpr int64_t kTokens = 3;
constexpr uint64_t kQueryBytes = kTokens * kDemoEmbedDim * sizeof(float);
// Region "io": the query at kQueryOffset, the answer right after it.
constexpr uint64_t kQueryOffset = 64;
constexpr uint64_t kRegionBytes = kQueryOffset + 2 * kQueryBytes;

// Host memory standing in for another process's GPU buffers: handle i names buffer i, GPU 0
// is the only device, and a region may not pass its buffer, as the plugin checks.
class TwinGpu {
 public:
  size_t Add(uint64_t bytes) {
    buffers_.push_back(std::make_shared<std::string>(bytes, '\0'));
    return buffers_.size() - 1;
  }
  std::string& buffer(size_t index) { return *buffers_.at(index); }
  static std::string Handle(size_t index) {
    std::string handle(core::kCudaIpcHandleBytes, '\0');
    std::memcpy(handle.data(), &index, sizeof(index));
    return handle;
  }
  int opens() const { return opens_; }

  kserve::DeviceMemoryOpener Opener() {
    return [this](int64_t device, absl::string_view handle,
                  uint64_t byte_size) -> absl::StatusOr<std::unique_ptr<core::SharedDeviceMemory>> {
      ++opens_;
      if (device != 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("device_id = ", device, " is not available: 1 GPU(s) visible (0 to 0)"));
      }
      size_t index = 0;
      std::memcpy(&index, handle.data(), sizeof(index));
      if (index >= buffers_.size()) {
        return absl::InvalidArgumentError("raw_handle: cudaIpcOpenMemHandle refused it");
      }
      if (byte_size > buffers_[index]->size()) {
        return absl::InvalidArgumentError(absl::StrCat("byte_size = ", byte_size,
                                                       " is past the exported allocation's ",
                                                       buffers_[index]->size(), " bytes"));
      }
      return std::unique_ptr<core::SharedDeviceMemory>(
          std::make_unique<Memory>(buffers_[index], broken_, copies_to_host_));
    };
  }
  // Copies fail from now on, as a lost device's would.
  void Break() { broken_->store(true); }
  // Copies from the twin's memory to the host so far.
  int copies_to_host() const { return *copies_to_host_; }

 private:
  class Memory final : public core::SharedDeviceMemory {
   public:
    Memory(std::shared_ptr<std::string> bytes, std::shared_ptr<std::atomic<bool>> broken,
           std::shared_ptr<std::atomic<int>> copies_to_host)
        : bytes_(std::move(bytes)),
          broken_(std::move(broken)),
          copies_to_host_(std::move(copies_to_host)) {}
    absl::Status CopyToHost(uint64_t offset, uint64_t bytes, void* host) const override {
      if (*broken_) return absl::InternalError("cudaMemcpy: an illegal memory access");
      ++*copies_to_host_;
      std::memcpy(host, bytes_->data() + offset, bytes);
      return absl::OkStatus();
    }
    absl::Status CopyFromHost(uint64_t offset, const void* host, uint64_t bytes) const override {
      if (*broken_) return absl::InternalError("cudaMemcpy: an illegal memory access");
      std::memcpy(bytes_->data() + offset, host, bytes);
      return absl::OkStatus();
    }
    int device() const override { return 0; }
    char* data() const override { return bytes_->data(); }
    absl::StatusOr<int64_t> FindNonFinite(uint64_t offset, int64_t count,
                                          core::DType dtype) const override {
      if (*broken_)
        return absl::InternalError("non-finite search kernel: an illegal memory access");
      const std::string bytes = bytes_->substr(offset, count * core::ElementSize(dtype));
      auto values = core::DecodeFloats(bytes, dtype, "twin");
      if (!values.ok()) return values.status();
      for (int64_t e = 0; e < count; ++e) {
        if (!std::isfinite((*values)[e])) return e;
      }
      return -1;
    }

   private:
    const std::shared_ptr<std::string> bytes_;
    const std::shared_ptr<std::atomic<bool>> broken_;
    const std::shared_ptr<std::atomic<int>> copies_to_host_;
  };
  std::vector<std::shared_ptr<std::string>> buffers_;
  int opens_ = 0;
  std::shared_ptr<std::atomic<bool>> broken_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<std::atomic<int>> copies_to_host_ = std::make_shared<std::atomic<int>>(0);
};

CudaSharedMemoryRegisterRequest GpuRegistration(const std::string& name, const std::string& handle,
                                                int64_t device, uint64_t byte_size) {
  CudaSharedMemoryRegisterRequest request;
  request.set_name(name);
  request.set_raw_handle(handle);
  request.set_device_id(device);
  request.set_byte_size(byte_size);
  return request;
}

TEST(CudaSharedMemoryTest, EveryRegistrationRejectionNamesTheFieldAndValues) {
  using C = absl::StatusCode;
  TwinGpu gpu;
  const std::string handle = TwinGpu::Handle(gpu.Add(4096));
  ExpectStatus(SharedMemory(true, 1 << 20).RegisterCuda(GpuRegistration("r", handle, 0, 8)),
               C::kFailedPrecondition, "start it with --kserve_cuda_shared_memory");
  SharedMemory regions(false, 1 << 20, gpu.Opener());
  ExpectStatus(regions.RegisterCuda(GpuRegistration("", handle, 0, 8)), C::kInvalidArgument,
               "name is empty");
  ExpectStatus(regions.RegisterCuda(GpuRegistration("r", handle.substr(0, 10), 0, 8)),
               C::kInvalidArgument, "raw_handle has 10 bytes; a cudaIpcMemHandle_t has 64");
  ExpectStatus(regions.RegisterCuda(GpuRegistration("r", handle, -1, 8)), C::kInvalidArgument,
               "device_id = -1 is negative");
  ExpectStatus(regions.RegisterCuda(GpuRegistration("r", handle, 0, 0)), C::kInvalidArgument,
               "byte_size is 0 for region \"r\"");
  EXPECT_EQ(gpu.opens(), 0);  // refused before the handle is opened
  // The opener's refusals reach the caller as they are.
  ExpectStatus(regions.RegisterCuda(GpuRegistration("r", handle, 1, 8)), C::kFailedPrecondition,
               "device_id = 1 is not available");
  ExpectStatus(regions.RegisterCuda(GpuRegistration("r", handle, 0, 4097)), C::kInvalidArgument,
               "byte_size = 4097 is past the exported allocation's 4096 bytes");
  EXPECT_TRUE(regions.RegisterCuda(GpuRegistration("r", handle, 0, 4096)).ok());
  const int opens = gpu.opens();
  ExpectStatus(regions.RegisterCuda(GpuRegistration("r", handle, 0, 8)), C::kAlreadyExists,
               "region \"r\" is already registered (cuda:0); unregister it first");
  for (size_t n = 1; n < SharedMemory::kMaxRegions; ++n) {
    ASSERT_TRUE(regions.RegisterCuda(GpuRegistration("r" + std::to_string(n), handle, 0, 8)).ok());
  }
  ExpectStatus(regions.RegisterCuda(GpuRegistration("one more", handle, 0, 8)),
               C::kResourceExhausted, "256 regions are registered");
  EXPECT_EQ(gpu.opens(), opens + static_cast<int>(SharedMemory::kMaxRegions) - 1);
}

// System and GPU regions share one namespace and one limit; status and unregister see
// their own kind only; a slice of either kind reads and writes its memory.
TEST(CudaSharedMemoryTest, OneNamespaceWithSystemRegions) {
  using C = absl::StatusCode;
  TwinGpu gpu;
  const size_t buffer = gpu.Add(256);
  SharedObject object(64);
  SharedMemory regions(true, 1 << 20, gpu.Opener());
  ASSERT_TRUE(regions.RegisterSystem(Registration("s", object.key(), 0, 64)).ok());
  ASSERT_TRUE(regions.RegisterCuda(GpuRegistration("c", TwinGpu::Handle(buffer), 0, 128)).ok());
  ExpectStatus(regions.RegisterCuda(GpuRegistration("s", TwinGpu::Handle(buffer), 0, 8)),
               C::kAlreadyExists, "region \"s\" is already registered (key \"" + object.key());
  ExpectStatus(regions.RegisterSystem(Registration("c", object.key(), 0, 64)), C::kAlreadyExists,
               "region \"c\" is already registered (cuda:0)");

  inference::CudaSharedMemoryStatusResponse gpu_regions;
  ASSERT_TRUE(regions.DescribeCuda("", &gpu_regions).ok());
  ASSERT_EQ(gpu_regions.regions_size(), 1);
  EXPECT_EQ(gpu_regions.regions().at("c").name(), "c");
  EXPECT_EQ(gpu_regions.regions().at("c").device_id(), 0u);
  EXPECT_EQ(gpu_regions.regions().at("c").byte_size(), 128u);
  inference::CudaSharedMemoryStatusResponse none;
  ExpectStatus(regions.DescribeCuda("s", &none), C::kNotFound,
               "name = \"s\" is not a registered region");

  auto slice = regions.Find("outputs[\"output\"]", "c", 16, 32);
  ASSERT_TRUE(slice.ok()) << slice.status();
  ASSERT_TRUE(kserve::WriteSlice(*slice, "0123456789").ok());
  EXPECT_EQ(gpu.buffer(buffer).substr(16, 10), "0123456789");
  std::string bytes;
  ASSERT_TRUE(kserve::ReadSlice(*slice, &bytes).ok());
  EXPECT_EQ(bytes.substr(0, 10), "0123456789");
  gpu.Break();  // a failed copy names the tensor, the region and the device
  ExpectStatus(kserve::ReadSlice(*slice, &bytes), C::kInternal,
               "outputs[\"output\"]: region \"c\" (cuda:0) cudaMemcpy: an illegal memory access");
  ExpectStatus(kserve::WriteSlice(*slice, "x"), C::kInternal,
               "outputs[\"output\"]: region \"c\" (cuda:0) cudaMemcpy");
  ExpectStatus(regions.Find("inputs[\"query\"]", "c", 100, 32).status(), C::kInvalidArgument,
               "inputs[\"query\"] asks for bytes [100, 132) of region \"c\", which has 128");

  EXPECT_TRUE(regions.UnregisterCuda("").ok());
  inference::SystemSharedMemoryStatusResponse system_regions;
  ASSERT_TRUE(regions.DescribeSystem("", &system_regions).ok());
  EXPECT_EQ(system_regions.regions_size(), 1);  // the GPU regions' unregister left it
  inference::CudaSharedMemoryStatusResponse after;
  ASSERT_TRUE(regions.DescribeCuda("", &after).ok());
  EXPECT_EQ(after.regions_size(), 0);
  ExpectStatus(regions.UnregisterSystem("s"), C::kOk, "");
  ASSERT_TRUE(regions.RegisterCuda(GpuRegistration("s", TwinGpu::Handle(buffer), 0, 8)).ok());
  EXPECT_TRUE(regions.UnregisterSystem("s").ok());  // not a system region: nothing to do
  ASSERT_TRUE(regions.DescribeCuda("s", &after).ok());
}

// A demo-layer request whose query is in region "io" at kQueryOffset and whose answer goes
// right after it.
ModelInferRequest RegionRequest() {
  ModelInferRequest request;
  request.set_model_name(kDemoLayerName);
  (*request.mutable_parameters())["causal"].set_bool_param(true);
  auto* query = request.add_inputs();
  query->set_name("query");
  query->set_datatype("FP32");
  for (int64_t dim : {int64_t{1}, kTokens, kDemoEmbedDim}) query->add_shape(dim);
  auto& parameters = *query->mutable_parameters();
  parameters["shared_memory_region"].set_string_param("io");
  parameters["shared_memory_byte_size"].set_uint64_param(kQueryBytes);
  parameters["shared_memory_offset"].set_uint64_param(kQueryOffset);
  auto* output = request.add_outputs();
  output->set_name("output");
  auto& destination = *output->mutable_parameters();
  destination["shared_memory_region"].set_string_param("io");
  destination["shared_memory_byte_size"].set_uint64_param(kQueryBytes);
  destination["shared_memory_offset"].set_uint64_param(kQueryOffset + kQueryBytes);
  return request;
}

std::string RandomQueryBytes(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::vector<float> query = RandomValues(rng, kTokens * kDemoEmbedDim);
  return std::string(reinterpret_cast<const char*>(query.data()), kQueryBytes);
}

// What ToNativeRequest made of a request for a layer on GPU `layer_gpu` (-1: the CPU).
struct Converted {
  absl::Status status;
  v1::MultiHeadAttentionRequest native;
  kserve::OutputPlan plan;
  GpuTensors on_gpu;
};
Converted Convert(const ModelInferRequest& request, const SharedMemory& regions, int layer_gpu) {
  Converted converted;
  converted.on_gpu.gpu = layer_gpu;
  converted.status = kserve::ToNativeRequest(request, &converted.native, &converted.plan, &regions,
                                             &converted.on_gpu);
  return converted;
}

// Query, key, value and output in regions on the layer's GPU stay there: no byte reaches
// the host, the native tensors keep shape and dtype only, and the regions stay open. Any
// other case (another GPU, the CPU, a misaligned offset, an input elsewhere, an answer
// that is FP16 or JSON) reads and writes through the host as before.
TEST(CudaSharedMemoryTest, TensorsOnTheLayersGpuStayThere) {
  TwinGpu gpu;
  const size_t buffer = gpu.Add(kRegionBytes + 64);
  SharedMemory regions(false, 1 << 20, gpu.Opener());
  ASSERT_TRUE(
      regions.RegisterCuda(GpuRegistration("io", TwinGpu::Handle(buffer), 0, kRegionBytes + 64))
          .ok());
  Converted in_place = Convert(RegionRequest(), regions, 0);
  ASSERT_TRUE(in_place.status.ok()) << in_place.status;
  EXPECT_EQ(gpu.copies_to_host(), 0);
  ASSERT_TRUE(in_place.on_gpu.query.has_value());
  EXPECT_EQ(in_place.on_gpu.query->offset, kQueryOffset);
  EXPECT_EQ(in_place.on_gpu.query->size, kQueryBytes);
  EXPECT_EQ(in_place.on_gpu.query->data(), gpu.buffer(buffer).data() + kQueryOffset);
  EXPECT_FALSE(in_place.on_gpu.key.has_value());
  EXPECT_TRUE(in_place.native.query().raw_data().empty());
  EXPECT_EQ(in_place.native.query().shape_size(), 3);
  EXPECT_EQ(in_place.native.query().dtype(), v1::FLOAT32);
  EXPECT_TRUE(in_place.plan.output_on_gpu);
  ASSERT_TRUE(in_place.on_gpu.output.has_value());
  EXPECT_EQ(in_place.on_gpu.output->offset, kQueryOffset + kQueryBytes);
  EXPECT_EQ(in_place.on_gpu.output->field, "outputs[\"output\"]");
  EXPECT_EQ(in_place.on_gpu.regions.size(), 2u);

  const auto through_host = [&](const ModelInferRequest& request, int layer_gpu,
                                bool output_on_gpu) {
    const int copies = gpu.copies_to_host();
    const Converted converted = Convert(request, regions, layer_gpu);
    ASSERT_TRUE(converted.status.ok()) << converted.status;
    EXPECT_FALSE(converted.on_gpu.inputs());
    EXPECT_EQ(converted.native.query().raw_data().size(), kQueryBytes);
    EXPECT_EQ(gpu.copies_to_host(), copies + 1);
    EXPECT_EQ(converted.plan.output_on_gpu, output_on_gpu);
    EXPECT_EQ(converted.on_gpu.output.has_value(), output_on_gpu);
  };
  {
    SCOPED_TRACE("a layer on the CPU");
    through_host(RegionRequest(), -1, false);
  }
  {
    SCOPED_TRACE("a layer on another GPU");
    through_host(RegionRequest(), 1, false);
  }
  {
    SCOPED_TRACE("a query at an offset no float32 is aligned to");
    ModelInferRequest misaligned = RegionRequest();
    (*misaligned.mutable_inputs(0)->mutable_parameters())["shared_memory_offset"].set_uint64_param(
        kQueryOffset + 2);
    through_host(misaligned, 0, true);
  }
  {
    SCOPED_TRACE("a key from raw_input_contents");
    ModelInferRequest cross = RegionRequest();
    for (const char* name : {"key", "value"}) {
      auto* input = cross.add_inputs();
      input->set_name(name);
      input->set_datatype("FP32");
      for (int64_t dim : {int64_t{1}, int64_t{2}, kDemoEmbedDim}) input->add_shape(dim);
      cross.add_raw_input_contents(std::string(2 * kDemoEmbedDim * sizeof(float), '\0'));
    }
    through_host(cross, 0, true);
  }
  {
    SCOPED_TRACE("an FP16 query and answer");
    ModelInferRequest fp16 = RegionRequest();
    fp16.mutable_inputs(0)->set_datatype("FP16");
    (*fp16.mutable_inputs(0)->mutable_parameters())["shared_memory_byte_size"].set_uint64_param(
        kQueryBytes / 2);
    const Converted converted = Convert(fp16, regions, 0);
    ASSERT_TRUE(converted.status.ok()) << converted.status;
    EXPECT_TRUE(converted.on_gpu.inputs());
    EXPECT_FALSE(converted.plan.output_on_gpu);  // no FP16 answers on the GPU
  }
  {
    SCOPED_TRACE("a JSON answer");
    ModelInferRequest json = RegionRequest();
    (*json.mutable_parameters())["binary_data_output"].set_bool_param(false);
    const Converted converted = Convert(json, regions, 0);
    ASSERT_TRUE(converted.status.ok()) << converted.status;
    EXPECT_TRUE(converted.on_gpu.inputs());
    EXPECT_FALSE(converted.plan.output_on_gpu);
  }
}

// For a layer on a GPU, query, key and value in system shared memory are read straight into
// page-locked memory its backend gives (here plain memory, counted): the native tensors keep
// shape and dtype only, and the decoded spans are that memory's own. Without such memory to
// spare, or with an input elsewhere, they are read as usual.
TEST(CudaSharedMemoryTest, SystemInputsForAGpuLayerAreReadIntoPinnedMemory) {
  const uint64_t seed = core::testing::TestSeed(3660);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  const std::string query_bytes = RandomQueryBytes(seed);
  SharedObject object(kRegionBytes);
  object.Write(kQueryOffset, query_bytes);
  TwinGpu gpu;
  const size_t buffer = gpu.Add(kRegionBytes);
  SharedMemory regions(true, 1 << 20, gpu.Opener());
  ASSERT_TRUE(regions.RegisterSystem(Registration("io", object.key(), 0, kRegionBytes)).ok());
  ASSERT_TRUE(
      regions.RegisterCuda(GpuRegistration("gpu", TwinGpu::Handle(buffer), 0, kRegionBytes)).ok());
  std::vector<size_t> pinned_sizes;
  bool spare = true;
  const auto convert = [&](const ModelInferRequest& request) {
    Converted converted;
    converted.on_gpu.gpu = 0;
    converted.on_gpu.pin = [&](size_t bytes) -> std::shared_ptr<char> {
      pinned_sizes.push_back(bytes);
      if (!spare) return nullptr;
      return std::shared_ptr<char>(new char[bytes], std::default_delete<char[]>());
    };
    converted.status = kserve::ToNativeRequest(request, &converted.native, &converted.plan,
                                               &regions, &converted.on_gpu);
    return converted;
  };
  const Converted pinned = convert(RegionRequest());
  ASSERT_TRUE(pinned.status.ok()) << pinned.status;
  EXPECT_EQ(pinned_sizes, std::vector<size_t>{kQueryBytes});
  ASSERT_TRUE(pinned.on_gpu.pinned_inputs());
  EXPECT_FALSE(pinned.on_gpu.inputs());
  EXPECT_EQ(std::string(pinned.on_gpu.pinned_query->buffer.get(), kQueryBytes), query_bytes);
  EXPECT_TRUE(pinned.native.query().raw_data().empty());
  EXPECT_FALSE(pinned.plan.output_on_gpu);  // a system region: written from the host
  TensorDecoding how;
  const auto decoded =
      DecodePinnedTensor(pinned.native.query(), "query", *pinned.on_gpu.pinned_query, how);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(reinterpret_cast<const char*>(decoded->borrowed.data()),
            pinned.on_gpu.pinned_query->buffer.get());
  ExpectStatus(
      DecodePinnedTensor(pinned.native.query(), "query",
                         PinnedBytes{pinned.on_gpu.pinned_query->buffer, kQueryBytes - 4}, how)
          .status(),
      absl::StatusCode::kInvalidArgument, "query.raw_data has");

  spare = false;
  const Converted none_to_spare = convert(RegionRequest());
  ASSERT_TRUE(none_to_spare.status.ok()) << none_to_spare.status;
  EXPECT_FALSE(none_to_spare.on_gpu.pinned_inputs());
  EXPECT_EQ(none_to_spare.native.query().raw_data(), query_bytes);

  spare = true;
  pinned_sizes.clear();
  ModelInferRequest mixed = RegionRequest();  // a key and value on the GPU: neither way
  for (const char* name : {"key", "value"}) {
    auto* input = mixed.add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    for (int64_t dim : {int64_t{1}, kTokens, kDemoEmbedDim}) input->add_shape(dim);
    auto& parameters = *input->mutable_parameters();
    parameters["shared_memory_region"].set_string_param("gpu");
    parameters["shared_memory_byte_size"].set_uint64_param(kQueryBytes);
  }
  const Converted neither = convert(mixed);
  ASSERT_TRUE(neither.status.ok()) << neither.status;
  EXPECT_TRUE(pinned_sizes.empty());
  EXPECT_FALSE(neither.on_gpu.pinned_inputs());
  EXPECT_FALSE(neither.on_gpu.inputs());
  EXPECT_EQ(neither.native.key().raw_data().size(), kQueryBytes);
}

// Inputs on the GPU are decoded where they are: shape, dtype and byte count as any input,
// NaN and infinities found on the GPU and named by index, and spans that are the region's
// own memory (no copy).
TEST(CudaSharedMemoryTest, GpuInputsAreCheckedWhereTheyAre) {
  using C = absl::StatusCode;
  TwinGpu gpu;
  const size_t buffer = gpu.Add(256);
  const auto memory = gpu.Opener()(0, TwinGpu::Handle(buffer), 256);
  ASSERT_TRUE(memory.ok()) << memory.status();
  std::vector<float> values(12, 0.5f);
  std::memcpy(gpu.buffer(buffer).data() + 64, values.data(), 48);
  v1::Tensor tensor;
  tensor.set_dtype(v1::FLOAT32);
  for (int64_t dim : {1, 3, 4}) tensor.add_shape(dim);
  const GpuBytes bytes{memory->get(), 64, 48, "query"};
  TensorDecoding how;
  auto decoded = DecodeGpuTensor(tensor, "query", bytes, how);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->borrowed.data(),
            reinterpret_cast<const float*>(gpu.buffer(buffer).data() + 64));
  EXPECT_EQ(decoded->borrowed.size(), 12u);
  EXPECT_EQ(gpu.copies_to_host(), 0);

  ExpectStatus(
      DecodeGpuTensor(tensor, "query", GpuBytes{memory->get(), 64, 40, "query"}, how).status(),
      C::kInvalidArgument, "query.raw_data has 40 bytes; shape [1, 3, 4] of FLOAT32 needs 48");
  values[5] = std::nanf("");
  std::memcpy(gpu.buffer(buffer).data() + 64, values.data(), 48);
  ExpectStatus(DecodeGpuTensor(tensor, "query", bytes, how).status(), C::kInvalidArgument,
               "query holds NaN at [0, 1, 1]; non-finite inputs are refused (--reject_non_finite)");
  how.reject_non_finite = false;
  EXPECT_TRUE(DecodeGpuTensor(tensor, "query", bytes, how).ok());

  // bf16 bits: kept as sent, +inf named with its index.
  tensor.set_dtype(v1::BFLOAT16);
  how.reject_non_finite = true;
  std::vector<uint16_t> bits(12, core::FloatToBFloat16(1.5f));
  bits[2] = core::FloatToBFloat16(INFINITY);
  std::memcpy(gpu.buffer(buffer).data() + 128, bits.data(), 24);
  const GpuBytes bf16_bytes{memory->get(), 128, 24, "query"};
  ExpectStatus(DecodeGpuTensor(tensor, "query", bf16_bytes, how).status(), C::kInternal,
               "query is BFLOAT16 in GPU memory, which only the GPU can widen");
  how.keep_half = true;
  ExpectStatus(DecodeGpuTensor(tensor, "query", bf16_bytes, how).status(), C::kInvalidArgument,
               "query holds +inf at [0, 0, 2]");
  bits[2] = core::FloatToBFloat16(-2.0f);
  std::memcpy(gpu.buffer(buffer).data() + 128, bits.data(), 24);
  decoded = DecodeGpuTensor(tensor, "query", bf16_bytes, how);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->borrowed_half.data(),
            reinterpret_cast<const uint16_t*>(gpu.buffer(buffer).data() + 128));
  gpu.Break();  // the device's own failure reaches the caller
  ExpectStatus(DecodeGpuTensor(tensor, "query", bf16_bytes, how).status(), C::kInternal,
               "non-finite search kernel");
}

class KserveCudaSharedMemoryServerTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.kserve_cuda_shared_memory = true;
    options.kserve_system_shared_memory = true;
    options.device_memory_opener = OpenerForTest();
    return options;
  }
  virtual kserve::DeviceMemoryOpener OpenerForTest() { return gpu_.Opener(); }
  void SetUp() override {
    ServerTest::SetUp();
    stub_ = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  }
  grpc::Status Register(const CudaSharedMemoryRegisterRequest& request) {
    grpc::ClientContext context;
    inference::CudaSharedMemoryRegisterResponse response;
    return stub_->CudaSharedMemoryRegister(&context, request, &response);
  }
  // The region call's answer is in region "io" (checked by the caller); returns the same
  // query's raw call's output bytes.
  std::string CallThroughRegionAndRaw(const std::string& query_bytes) {
    grpc::ClientContext context;
    inference::ModelInferResponse response;
    const grpc::Status status = stub_->ModelInfer(&context, RegionRequest(), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.raw_output_contents_size(), 1);  // an empty entry keeps the order
    if (response.raw_output_contents_size() == 1) {
      EXPECT_TRUE(response.raw_output_contents(0).empty());
    }
    ModelInferRequest raw = RegionRequest();
    raw.mutable_inputs(0)->clear_parameters();
    raw.clear_outputs();
    raw.add_raw_input_contents(query_bytes);
    grpc::ClientContext raw_context;
    inference::ModelInferResponse expected;
    const grpc::Status raw_status = stub_->ModelInfer(&raw_context, raw, &expected);
    EXPECT_TRUE(raw_status.ok()) << raw_status.error_message();
    return expected.raw_output_contents_size() == 1 ? expected.raw_output_contents(0) : "";
  }

  TwinGpu gpu_;
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
};

TEST_F(KserveCudaSharedMemoryServerTest, InputsAndOutputsThroughGpuRegionsEqualTheRawCall) {
  const uint64_t seed = core::testing::TestSeed(5400);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  const std::string query_bytes = RandomQueryBytes(seed);
  const size_t buffer = gpu_.Add(kRegionBytes);
  gpu_.buffer(buffer).replace(kQueryOffset, kQueryBytes, query_bytes);
  ASSERT_TRUE(Register(GpuRegistration("io", TwinGpu::Handle(buffer), 0, kRegionBytes)).ok());

  grpc::ClientContext metadata_context;
  inference::ServerMetadataResponse metadata;
  ASSERT_TRUE(stub_->ServerMetadata(&metadata_context, {}, &metadata).ok());
  EXPECT_NE(
      std::find(metadata.extensions().begin(), metadata.extensions().end(), "cuda_shared_memory"),
      metadata.extensions().end());

  const std::string expected = CallThroughRegionAndRaw(query_bytes);
  ASSERT_EQ(expected.size(), kQueryBytes);
  EXPECT_EQ(gpu_.buffer(buffer).substr(kQueryOffset + kQueryBytes, kQueryBytes), expected);
  EXPECT_EQ(gpu_.buffer(buffer).substr(kQueryOffset, kQueryBytes), query_bytes);

  EXPECT_EQ(Register(GpuRegistration("io", TwinGpu::Handle(buffer), 0, 8)).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(
      Register(GpuRegistration("big", TwinGpu::Handle(buffer), 0, kRegionBytes + 1)).error_code(),
      grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext status_context;
  inference::CudaSharedMemoryStatusResponse regions;
  ASSERT_TRUE(stub_->CudaSharedMemoryStatus(&status_context, {}, &regions).ok());
  ASSERT_EQ(regions.regions_size(), 1);
  EXPECT_EQ(regions.regions().at("io").byte_size(), kRegionBytes);
  grpc::ClientContext unregister_context;
  inference::CudaSharedMemoryUnregisterRequest unregister;
  unregister.set_name("io");
  inference::CudaSharedMemoryUnregisterResponse unregistered;
  ASSERT_TRUE(
      stub_->CudaSharedMemoryUnregister(&unregister_context, unregister, &unregistered).ok());
  grpc::ClientContext after_context;
  inference::ModelInferResponse after;
  const grpc::Status gone = stub_->ModelInfer(&after_context, RegionRequest(), &after);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::NOT_FOUND) << gone.error_message();
}

// The default server refuses GPU registrations, naming the flag, and does not announce them.
TEST_F(ServerTest, CudaSharedMemoryIsOffByDefault) {
  auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  inference::CudaSharedMemoryRegisterResponse response;
  const grpc::Status status = stub->CudaSharedMemoryRegister(
      &context, GpuRegistration("r", TwinGpu::Handle(0), 0, 64), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(status.error_message().find("--kserve_cuda_shared_memory"), std::string::npos)
      << status.error_message();
  grpc::ClientContext metadata_context;
  inference::ServerMetadataResponse metadata;
  ASSERT_TRUE(stub->ServerMetadata(&metadata_context, {}, &metadata).ok());
  for (const std::string& extension : metadata.extensions()) {
    EXPECT_NE(extension, "cuda_shared_memory");
  }
}

// The real thing: a buffer another process cudaMalloc'd and exported, opened by the server's
// CUDA plugin. SKIPPED where no GPU can export one.
class KserveCudaSharedMemoryGpuTest : public KserveCudaSharedMemoryServerTest {
 protected:
  kserve::DeviceMemoryOpener OpenerForTest() override { return nullptr; }  // this process's GPUs
};

TEST_F(KserveCudaSharedMemoryGpuTest, ARealIpcHandleFromAnotherProcess) {
  if (!core::CudaBuilt()) GTEST_SKIP() << "this build has no CUDA backend";
  const uint64_t seed = core::testing::TestSeed(6090);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  const std::string query_bytes = RandomQueryBytes(seed);
  std::string contents(kRegionBytes, '\0');
  contents.replace(kQueryOffset, kQueryBytes, query_bytes);
  CudaIpcExporter exporter(CudaIpcExporter::BesideThisBinary());
  ASSERT_TRUE(exporter.found()) << exporter.path() << " is missing from a build with CUDA";
  std::string handle, failure;
  if (!exporter.Start(contents, &handle, &failure)) {
    GTEST_SKIP() << "no GPU buffer to share here: " << failure;
  }
  const grpc::Status registered = Register(GpuRegistration("io", handle, 0, kRegionBytes));
  ASSERT_TRUE(registered.ok()) << registered.error_message();
  const grpc::Status too_big = Register(GpuRegistration("big", handle, 0, 1ull << 40));
  EXPECT_EQ(too_big.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << too_big.error_message();
  const std::string expected = CallThroughRegionAndRaw(query_bytes);
  ASSERT_EQ(expected.size(), kQueryBytes);
  std::string after;
  ASSERT_TRUE(exporter.Dump(kRegionBytes, &after)) << exporter.Errors();
  EXPECT_EQ(after.substr(kQueryOffset + kQueryBytes, kQueryBytes), expected);
  EXPECT_EQ(after.substr(kQueryOffset, kQueryBytes), query_bytes);
}

// System shared memory into a layer on a GPU: the query is read into the backend's
// page-locked memory and copied from there in one DMA; the answer equals the raw call's.
// SKIPPED where the demo layer is not on a GPU.
TEST_F(KserveCudaSharedMemoryGpuTest, SystemRegionsIntoAGpuLayerEqualTheRawCall) {
  if (!DemoLayer()->backend().InPlaceGpu().has_value()) {
    GTEST_SKIP() << "the demo layer runs on " << DemoLayer()->device() << ": no GPU here";
  }
  const uint64_t seed = core::testing::TestSeed(6390);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  const std::string query_bytes = RandomQueryBytes(seed);
  SharedObject object(kRegionBytes);
  object.Write(kQueryOffset, query_bytes);
  grpc::ClientContext context;
  inference::SystemSharedMemoryRegisterResponse registered;
  const grpc::Status status = stub_->SystemSharedMemoryRegister(
      &context, Registration("io", object.key(), 0, kRegionBytes), &registered);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const std::string expected = CallThroughRegionAndRaw(query_bytes);
  ASSERT_EQ(expected.size(), kQueryBytes);
  EXPECT_EQ(object.Read(kQueryOffset + kQueryBytes, kQueryBytes), expected);
}

// On the GPU the layer runs on, the region's tensors stay there: the query's NaN is found
// on the device and named by index, and a destination too small for the answer is refused
// before anything runs. SKIPPED where no GPU can export a buffer.
TEST_F(KserveCudaSharedMemoryGpuTest, InPlaceInputsAreCheckedOnTheGpu) {
  if (!core::CudaBuilt()) GTEST_SKIP() << "this build has no CUDA backend";
  std::vector<float> query(kTokens * kDemoEmbedDim, 0.25f);
  query[kDemoEmbedDim + 7] = std::nanf("");
  std::string contents(kRegionBytes, '\0');
  std::memcpy(contents.data() + kQueryOffset, query.data(), kQueryBytes);
  CudaIpcExporter exporter(CudaIpcExporter::BesideThisBinary());
  ASSERT_TRUE(exporter.found()) << exporter.path() << " is missing from a build with CUDA";
  std::string handle, failure;
  if (!exporter.Start(contents, &handle, &failure)) {
    GTEST_SKIP() << "no GPU buffer to share here: " << failure;
  }
  EXPECT_EQ(DemoLayer()->backend().InPlaceGpu(), 0)
      << "the demo layer is on " << DemoLayer()->device();
  const grpc::Status registered = Register(GpuRegistration("io", handle, 0, kRegionBytes));
  ASSERT_TRUE(registered.ok()) << registered.error_message();
  grpc::ClientContext context;
  inference::ModelInferResponse response;
  const grpc::Status refused = stub_->ModelInfer(&context, RegionRequest(), &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("inputs[\"query\"] holds NaN at [0, 1, 7]"),
            std::string::npos)
      << refused.error_message();

  ModelInferRequest small = RegionRequest();  // a finite query: the zeros after the first
  (*small.mutable_inputs(0)->mutable_parameters())["shared_memory_offset"].set_uint64_param(
      kQueryOffset + kQueryBytes);
  (*small.mutable_outputs(0)->mutable_parameters())["shared_memory_byte_size"].set_uint64_param(
      kQueryBytes - 4);
  grpc::ClientContext small_context;
  const grpc::Status too_small = stub_->ModelInfer(&small_context, small, &response);
  EXPECT_EQ(too_small.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(too_small.error_message().find("cannot hold the answer's"), std::string::npos)
      << too_small.error_message();
}

}  // namespace
}  // namespace attention::server::testing

#include "core/cuda/cuda_backend.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "core/attention_kernels.h"
#include "core/cuda/kernels.h"
#include "core/cuda/launch_plan.h"
#include "core/mutex.h"
#include "core/status_macros.h"

namespace attention::core {
namespace {

using cuda::AttentionShape;
using cuda::DeviceAttentionProblem;
using cuda::DeviceLayout;

// A device out of memory is RESOURCE_EXHAUSTED (the server keeps serving); anything else
// is INTERNAL naming the call.
absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorString(error));
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

absl::Status CublasStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cublasGetStatusString(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

// Memory on the device, or pinned on the host, that grows to the largest request and is
// reused. Thread-compatible.
template <bool kPinnedHost>
class GrowingBuffer {
 public:
  GrowingBuffer() = default;
  GrowingBuffer(const GrowingBuffer&) = delete;
  GrowingBuffer& operator=(const GrowingBuffer&) = delete;
  ~GrowingBuffer() { Free(); }

  // At least `bytes`; the contents are not kept.
  absl::StatusOr<char*> Reserve(int64_t bytes) {
    if (bytes <= capacity_) return data_;
    Free();
    void* data = nullptr;
    const cudaError_t error = kPinnedHost ? cudaMallocHost(&data, bytes) : cudaMalloc(&data, bytes);
    RETURN_IF_ERROR(CudaStatus(error, absl::StrCat(kPinnedHost ? "cudaMallocHost(" : "cudaMalloc(",
                                                   bytes, " bytes)")));
    data_ = static_cast<char*>(data);
    capacity_ = bytes;
    return data_;
  }

 private:
  void Free() {
    if (data_ == nullptr) return;
    if (kPinnedHost) {
      cudaFreeHost(data_);
    } else {
      cudaFree(data_);
    }
    data_ = nullptr;
    capacity_ = 0;
  }

  char* data_ = nullptr;
  int64_t capacity_ = 0;
};
using DeviceBuffer = GrowingBuffer<false>;
using PinnedBuffer = GrowingBuffer<true>;

// Byte offsets of the arrays of one call inside one allocation, 256-byte aligned.
class Arena {
 public:
  int64_t Add(int64_t bytes) {
    const int64_t offset = (size_ + 255) / 256 * 256;
    size_ = offset + bytes;
    return offset;
  }
  int64_t size() const { return size_; }

 private:
  int64_t size_ = 0;
};

// What one batch worker thread computes with: its stream (so workers overlap), cuBLAS
// handle, device scratch and pinned staging for inputs and outputs.
struct StreamContext {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  DeviceBuffer device;
  PinnedBuffer staging;
};

// The two copies of one call: its inputs sit at the start of the staging and device buffers
// and go over in one copy; its outputs sit together at the end and come back in one.
struct Staged {
  int64_t input_bytes = 0;    // [0, input_bytes) is copied host -> device
  int64_t output_offset = 0;  // [output_offset, output_offset + output_bytes) comes back
  int64_t output_bytes = 0;
};

bool FitsInt(int64_t value) { return value <= INT_MAX; }

DeviceLayout ToDevice(const HeadLayout& layout) {
  return {layout.batch_stride, layout.head_stride, layout.row_stride};
}

AttentionShape ToShape(const AttentionDims& d) {
  return {d.batch, d.num_heads, d.num_kv_heads, d.q_len, d.kv_len, d.head_dim, d.v_head_dim};
}

// The masks of `options`, to be copied into staging at the given offsets.
struct StagedMask {
  int64_t key_lengths = -1, key_padding = -1, mask_keep = -1, mask_bias = -1;

  void Plan(const AttentionOptions& o, Arena& arena) {
    if (!o.key_lengths.empty()) key_lengths = arena.Add(o.key_lengths.size() * sizeof(int64_t));
    if (!o.key_padding_keep.empty()) key_padding = arena.Add(o.key_padding_keep.size());
    if (!o.attn_mask_keep.empty()) mask_keep = arena.Add(o.attn_mask_keep.size());
    if (!o.attn_mask_bias.empty()) mask_bias = arena.Add(o.attn_mask_bias.size() * sizeof(float));
  }
  void Stage(const AttentionOptions& o, char* staging) const {
    auto copy = [staging](int64_t offset, const void* data, size_t bytes) {
      if (offset >= 0) std::memcpy(staging + offset, data, bytes);
    };
    copy(key_lengths, o.key_lengths.data(), o.key_lengths.size() * sizeof(int64_t));
    copy(key_padding, o.key_padding_keep.data(), o.key_padding_keep.size());
    copy(mask_keep, o.attn_mask_keep.data(), o.attn_mask_keep.size());
    copy(mask_bias, o.attn_mask_bias.data(), o.attn_mask_bias.size() * sizeof(float));
  }
  // The options' masks with pointers into the device copy at `device`.
  MaskView View(const AttentionOptions& o, const AttentionDims& dims, char* device) const {
    MaskView view = o.View(dims);
    auto at = [device](int64_t offset) { return offset >= 0 ? device + offset : nullptr; };
    view.key_lengths = reinterpret_cast<const int64_t*>(at(key_lengths));
    view.key_padding_keep = reinterpret_cast<const uint8_t*>(at(key_padding));
    view.attn_mask_keep = reinterpret_cast<const uint8_t*>(at(mask_keep));
    view.attn_mask_bias = reinterpret_cast<const float*>(at(mask_bias));
    return view;
  }
};

// The attention weights and row statistics of one problem, when asked.
struct StagedWeights {
  int64_t weights = -1, row_max = -1, row_sum = -1;
  int64_t count = 0;

  void PlanOutput(const AttentionDims& d, NeedWeights need, Arena& arena) {
    if (need == NeedWeights::kNone) return;
    count = d.batch * d.num_heads * d.q_len * d.kv_len;
    weights = arena.Add(count * sizeof(float));
  }
  void PlanScratch(const AttentionDims& d, NeedWeights need, Arena& arena) {
    if (need == NeedWeights::kNone) return;
    row_max = arena.Add(d.batch * d.num_heads * d.q_len * sizeof(float));
    row_sum = arena.Add(d.batch * d.num_heads * d.q_len * sizeof(float));
  }
  void Attach(char* device, DeviceAttentionProblem& problem) const {
    if (weights < 0) return;
    problem.weights = reinterpret_cast<float*>(device + weights);
    problem.row_max = reinterpret_cast<float*>(device + row_max);
    problem.row_sum = reinterpret_cast<float*>(device + row_sum);
  }
  void CopyOut(const char* staging, std::vector<float>& out) const {
    if (weights < 0) return;
    out.resize(count);
    std::memcpy(out.data(), staging + weights, count * sizeof(float));
  }
};

class CudaBackend;

// Device copies of a layer's weights: one allocation, views into it (null when absent).
struct DeviceWeights {
  const float *q_weight = nullptr, *k_weight = nullptr, *v_weight = nullptr,
              *out_weight = nullptr;
  const float *q_bias = nullptr, *k_bias = nullptr, *v_bias = nullptr, *out_bias = nullptr;
  const float *fused_qkv_weight = nullptr, *fused_qkv_bias = nullptr;
};

class CudaPreparedLayer final : public PreparedLayer {
 public:
  CudaPreparedLayer(const CudaBackend& backend, const MhaConfig& config) : backend_(backend), config_(config) {}
  ~CudaPreparedLayer() override;

  absl::Status Upload(const MhaWeightsView& weights);
  absl::StatusOr<std::vector<AttentionResult>> ForwardBatch(
      absl::Span<const MhaInput* const> inputs) const override;
  int64_t DeviceWeightBytes() const override { return bytes_; }

 private:
  const CudaBackend& backend_;
  const MhaConfig config_;
  void* memory_ = nullptr;
  int64_t bytes_ = 0;
  DeviceWeights weights_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const cudaDeviceProp& properties)
      : device_(device),
        name_(absl::StrCat("cuda:", device)),
        max_shared_bytes_(static_cast<int64_t>(properties.sharedMemPerBlockOptin)) {}

  ~CudaBackend() override {
    cudaSetDevice(device_);
    for (auto& [thread, context] : contexts_) {
      cublasDestroy(context->cublas);
      cudaStreamDestroy(context->stream);
    }
  }

  const std::string& name() const override { return name_; }
  int device() const { return device_; }

  absl::Status Supports(const MhaConfig& config, const AttentionOptions& options) const override {
    AttentionShape shape;
    shape.head_dim = config.head_dim;
    shape.v_head_dim = config.v_head_dim;
    const std::string reason = cuda::FlashUnsupportedReason(shape, max_shared_bytes_);
    if (!reason.empty()) return absl::UnimplementedError(absl::StrCat(name_, ": ", reason));
    return absl::OkStatus();  // every AttentionOptions field is computed on the device
  }

  absl::StatusOr<std::unique_ptr<PreparedLayer>> Prepare(
      const MhaConfig& config, const MhaWeightsView& weights) const override {
    RETURN_IF_ERROR(Supports(config, AttentionOptions{}));
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    auto prepared = std::make_unique<CudaPreparedLayer>(*this, config);
    RETURN_IF_ERROR(prepared->Upload(weights));
    return prepared;
  }

  absl::StatusOr<AttentionResult> ScaledDotProductAttention(const SdpaInput& input) const override;

  // 16-bit inputs travel to the GPU as sent (half the bytes) and are converted there.
  bool ConvertsHalfInputs() const override { return true; }

  std::optional<DeviceMemory> Memory() const override {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(device_) != cudaSuccess ||
        cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      return std::nullopt;
    }
    return DeviceMemory{static_cast<int64_t>(total_bytes - free_bytes),
                        static_cast<int64_t>(total_bytes)};
  }

  // The calling thread's stream context on this device, created on first use.
  absl::StatusOr<StreamContext*> Context() const {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    MutexLock lock(mu_);
    std::unique_ptr<StreamContext>& context = contexts_[std::this_thread::get_id()];
    if (context == nullptr) {
      auto created = std::make_unique<StreamContext>();
      RETURN_IF_ERROR(CudaStatus(
          cudaStreamCreateWithFlags(&created->stream, cudaStreamNonBlocking), "cudaStreamCreate"));
      const cublasStatus_t status = cublasCreate(&created->cublas);
      if (status != CUBLAS_STATUS_SUCCESS) {
        cudaStreamDestroy(created->stream);
        return CublasStatus(status, "cublasCreate");
      }
      cublasSetStream(created->cublas, created->stream);
      // Full fp32 SGEMM: the default math mode never rounds to TF32 (only
      // CUBLAS_TF32_TENSOR_OP_MATH or NVIDIA_TF32_OVERRIDE=1 would), as PyTorch with
      // allow_tf32 = False; results match the CPU backend within float rounding.
      cublasSetMathMode(created->cublas, CUBLAS_DEFAULT_MATH);
      context = std::move(created);
    }
    return context.get();
  }

  // Runs one problem (shape checked by Supports) on `stream`.
  absl::Status Attend(const DeviceAttentionProblem& problem, cudaStream_t stream) const {
    const std::string reason = cuda::FlashUnsupportedReason(problem.shape, max_shared_bytes_);
    if (!reason.empty()) return absl::UnimplementedError(absl::StrCat(name_, ": ", reason));
    const cuda::FlashLaunchPlan plan =
        cuda::PlanFlashAttention(problem.shape, problem.weights != nullptr);
    return CudaStatus(cuda::LaunchAttention(problem, plan, stream), "attention kernel launch");
  }

 private:
  const int device_;
  const std::string name_;
  const int64_t max_shared_bytes_;
  mutable Mutex mu_;  // see core/mutex.h
  mutable std::map<std::thread::id, std::unique_ptr<StreamContext>> contexts_
      ABSL_GUARDED_BY(mu_);
};

// y[rows, out] (row stride ldy) = x[rows, in] * w[out, in]^T (+ bias), row-major, on cuBLAS:
// the column-major product y^T = w * x^T.
absl::Status Linear(const StreamContext& context, const float* x, int64_t rows, int64_t in,
                    const float* weight, const float* bias, int64_t out, float* y, int64_t ldy) {
  if (rows == 0) return absl::OkStatus();
  if (!FitsInt(rows) || !FitsInt(in) || !FitsInt(out) || !FitsInt(ldy)) {
    return absl::UnimplementedError(
        absl::StrCat("a GEMM of ", rows, " x ", in, " x ", out, " exceeds cuBLAS's int sizes"));
  }
  const float one = 1.0f, zero = 0.0f;
  RETURN_IF_ERROR(CublasStatus(
      cublasSgemm(context.cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out),
                  static_cast<int>(rows), static_cast<int>(in), &one, weight,
                  static_cast<int>(in), x, static_cast<int>(in), &zero, y, static_cast<int>(ldy)),
      "cublasSgemm"));
  if (bias == nullptr) return absl::OkStatus();
  return CudaStatus(cuda::LaunchAddBias(y, rows, out, ldy, bias, context.stream), "bias kernel");
}

CudaPreparedLayer::~CudaPreparedLayer() {
  if (memory_ != nullptr) {
    cudaSetDevice(backend_.device());
    cudaFree(memory_);
  }
}

absl::Status CudaPreparedLayer::Upload(const MhaWeightsView& w) {
  // One allocation for every tensor; Q, K and V stay fused when the host has them fused.
  const bool fused = !w.fused_qkv_weight.empty();
  struct Part {
    absl::Span<const float> host;
    const float** device;
    int64_t offset = 0;
  };
  std::vector<Part> parts = {{w.out_weight, &weights_.out_weight}, {w.out_bias, &weights_.out_bias}};
  if (fused) {
    parts.push_back({w.fused_qkv_weight, &weights_.fused_qkv_weight});
    parts.push_back({w.fused_qkv_bias, &weights_.fused_qkv_bias});
  } else {
    for (auto [host, device] : {std::pair{w.q_weight, &weights_.q_weight}, {w.k_weight, &weights_.k_weight},
                                {w.v_weight, &weights_.v_weight}, {w.q_bias, &weights_.q_bias},
                                {w.k_bias, &weights_.k_bias}, {w.v_bias, &weights_.v_bias}}) {
      parts.push_back({host, device});
    }
  }
  Arena arena;
  for (Part& part : parts) part.offset = arena.Add(part.host.size() * sizeof(float));
  bytes_ = arena.size();
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&memory_, std::max<int64_t>(bytes_, 1)),
                             absl::StrCat("cudaMalloc(", bytes_, " bytes of weights)")));
  char* base = static_cast<char*>(memory_);
  for (const Part& part : parts) {
    if (part.host.empty()) continue;
    RETURN_IF_ERROR(CudaStatus(cudaMemcpy(base + part.offset, part.host.data(),
                                          part.host.size() * sizeof(float), cudaMemcpyHostToDevice),
                               "cudaMemcpy(weights)"));
    *part.device = reinterpret_cast<const float*>(base + part.offset);
  }
  if (fused) {
    // Q, K and V rows, and their biases, are ranges of the fused matrix (as on the host).
    const MhaConfig& c = config_;
    weights_.q_weight = weights_.fused_qkv_weight;
    weights_.k_weight = weights_.q_weight + c.QWidth() * c.embed_dim;
    weights_.v_weight = weights_.k_weight + c.KWidth() * c.embed_dim;
    if (weights_.fused_qkv_bias != nullptr) {
      weights_.q_bias = weights_.fused_qkv_bias;
      weights_.k_bias = weights_.q_bias + c.QWidth();
      weights_.v_bias = weights_.k_bias + c.KWidth();
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<AttentionResult>> CudaPreparedLayer::ForwardBatch(
    absl::Span<const MhaInput* const> inputs) const {
  const MhaConfig& c = config_;
  const size_t count = inputs.size();
  // Row offsets of every input inside the packed token matrices, as on the CPU.
  std::vector<int64_t> q_row(count + 1, 0), kv_row(count + 1, 0);
  bool all_self_attention = true;
  for (size_t n = 0; n < count; ++n) {
    q_row[n + 1] = q_row[n] + inputs[n]->batch * inputs[n]->q_len;
    kv_row[n + 1] = kv_row[n] + inputs[n]->batch * inputs[n]->kv_len;
    all_self_attention = all_self_attention && inputs[n]->self_attention();
  }
  const int64_t q_rows = q_row.back(), kv_rows = kv_row.back();
  const bool fused = all_self_attention && weights_.fused_qkv_weight != nullptr;
  const int64_t qkv_width = c.QWidth() + c.KWidth() + c.VWidth();

  // Plan: inputs (copied in at once), scratch, outputs (copied out at once). 16-bit inputs
  // are copied as sent and converted into the float32 token matrices on the device; when
  // every input is 16-bit, those matrices are scratch and are not copied at all.
  const bool all_half = std::all_of(inputs.begin(), inputs.end(),
                                    [](const MhaInput* in) { return in->is_half(); });
  Arena arena;
  auto plan_tokens = [&] {
    return std::array<int64_t, 3>{
        arena.Add(q_rows * c.embed_dim * sizeof(float)),
        all_self_attention ? -1 : arena.Add(kv_rows * c.kdim * sizeof(float)),
        all_self_attention ? -1 : arena.Add(kv_rows * c.vdim * sizeof(float))};
  };
  std::array<int64_t, 3> tokens_at = {-1, -1, -1};
  if (!all_half) tokens_at = plan_tokens();
  // Per input: where its 16-bit query, key and value are staged (-1: none).
  std::vector<std::array<int64_t, 3>> half_at(count, {-1, -1, -1});
  for (size_t n = 0; n < count; ++n) {
    const MhaInput& in = *inputs[n];
    if (!in.is_half()) continue;
    half_at[n][0] = arena.Add(in.query_half.size() * sizeof(uint16_t));
    if (!in.key_half.empty()) {
      half_at[n][1] = arena.Add(in.key_half.size() * sizeof(uint16_t));
      half_at[n][2] = arena.Add(in.value_half.size() * sizeof(uint16_t));
    }
  }
  std::vector<StagedMask> masks(count);
  for (size_t n = 0; n < count; ++n) masks[n].Plan(inputs[n]->options, arena);
  Staged staged;
  staged.input_bytes = arena.size();
  if (all_half) tokens_at = plan_tokens();
  const int64_t x_at = tokens_at[0], xk_at = tokens_at[1], xv_at = tokens_at[2];
  const int64_t q_at = arena.Add((fused ? q_rows * qkv_width : q_rows * c.QWidth()) * sizeof(float));
  const int64_t k_at = fused ? -1 : arena.Add(kv_rows * c.KWidth() * sizeof(float));
  const int64_t v_at = fused ? -1 : arena.Add(kv_rows * c.VWidth() * sizeof(float));
  const int64_t attended_at =
      c.output_projection ? arena.Add(q_rows * c.AttentionWidth() * sizeof(float)) : -1;
  std::vector<StagedWeights> weights(count);
  std::vector<AttentionDims> dims(count);
  for (size_t n = 0; n < count; ++n) {
    const MhaInput& in = *inputs[n];
    dims[n] = {in.batch, c.num_heads, c.num_kv_heads, in.q_len, in.kv_len, c.head_dim, c.v_head_dim};
    weights[n].PlanScratch(dims[n], in.options.need_weights, arena);
  }
  staged.output_offset = arena.Add(0);
  const int64_t output_at = arena.Add(q_rows * c.output_dim * sizeof(float));
  for (size_t n = 0; n < count; ++n) weights[n].PlanOutput(dims[n], inputs[n]->options.need_weights, arena);
  staged.output_bytes = arena.size() - staged.output_offset;

  ASSIGN_OR_RETURN(StreamContext* context, backend_.Context());
  ASSIGN_OR_RETURN(char* device, context->device.Reserve(arena.size()));
  ASSIGN_OR_RETURN(char* staging, context->staging.Reserve(arena.size()));
  auto host = [staging](int64_t at) { return reinterpret_cast<float*>(staging + at); };
  auto on_device = [device](int64_t at) { return reinterpret_cast<float*>(device + at); };

  for (size_t n = 0; n < count; ++n) {
    const MhaInput& in = *inputs[n];
    if (in.is_half()) {
      for (auto [at, bits] : {std::pair{half_at[n][0], in.query_half}, {half_at[n][1], in.key_half},
                              {half_at[n][2], in.value_half}}) {
        if (at >= 0) std::memcpy(staging + at, bits.data(), bits.size() * sizeof(uint16_t));
      }
    } else {
      std::memcpy(host(x_at) + q_row[n] * c.embed_dim, in.query.data(),
                  in.query.size() * sizeof(float));
      if (!all_self_attention) {
        const absl::Span<const float> key = in.key.empty() ? in.query : in.key;
        const absl::Span<const float> value = in.value.empty() ? in.query : in.value;
        std::memcpy(host(xk_at) + kv_row[n] * c.kdim, key.data(), key.size() * sizeof(float));
        std::memcpy(host(xv_at) + kv_row[n] * c.vdim, value.data(), value.size() * sizeof(float));
      }
    }
    masks[n].Stage(in.options, staging);
  }
  RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(device, staging, staged.input_bytes,
                                             cudaMemcpyHostToDevice, context->stream),
                             "cudaMemcpyAsync(inputs)"));
  for (size_t n = 0; n < count; ++n) {
    const MhaInput& in = *inputs[n];
    if (!in.is_half()) continue;
    const bool bfloat16 = in.half_dtype == DType::kBFloat16;
    auto convert = [&](int64_t at, size_t elements, float* out) {
      return CudaStatus(cuda::LaunchHalfToFloat(reinterpret_cast<const uint16_t*>(device + at),
                                                out, elements, bfloat16, context->stream),
                        "16-bit conversion kernel");
    };
    RETURN_IF_ERROR(convert(half_at[n][0], in.query_half.size(),
                            on_device(x_at) + q_row[n] * c.embed_dim));
    if (!all_self_attention) {
      // A self-attention input of a mixed batch: its key and value rows are its query rows.
      const bool self = in.key_half.empty();
      RETURN_IF_ERROR(convert(self ? half_at[n][0] : half_at[n][1],
                              self ? in.query_half.size() : in.key_half.size(),
                              on_device(xk_at) + kv_row[n] * c.kdim));
      RETURN_IF_ERROR(convert(self ? half_at[n][0] : half_at[n][2],
                              self ? in.query_half.size() : in.value_half.size(),
                              on_device(xv_at) + kv_row[n] * c.vdim));
    }
  }

  // Projections over every token of the batch.
  float *q = on_device(q_at), *k, *v;
  int64_t q_stride = c.QWidth(), k_stride = c.KWidth(), v_stride = c.VWidth();
  if (fused) {
    RETURN_IF_ERROR(Linear(*context, on_device(x_at), q_rows, c.embed_dim, weights_.fused_qkv_weight,
                           weights_.fused_qkv_bias, qkv_width, q, qkv_width));
    k = q + c.QWidth();
    v = k + c.KWidth();
    q_stride = k_stride = v_stride = qkv_width;
  } else {
    const float* key_input = all_self_attention ? on_device(x_at) : on_device(xk_at);
    const float* value_input = all_self_attention ? on_device(x_at) : on_device(xv_at);
    k = on_device(k_at);
    v = on_device(v_at);
    RETURN_IF_ERROR(Linear(*context, on_device(x_at), q_rows, c.embed_dim, weights_.q_weight,
                           weights_.q_bias, c.QWidth(), q, q_stride));
    RETURN_IF_ERROR(Linear(*context, key_input, kv_rows, c.kdim, weights_.k_weight, weights_.k_bias,
                           c.KWidth(), k, k_stride));
    RETURN_IF_ERROR(Linear(*context, value_input, kv_rows, c.vdim, weights_.v_weight,
                           weights_.v_bias, c.VWidth(), v, v_stride));
  }
  float* attended = c.output_projection ? on_device(attended_at) : on_device(output_at);
  for (size_t n = 0; n < count; ++n) {
    const MhaInput& in = *inputs[n];
    if (c.rope_theta > 0.0) {
      const double base = c.RotaryBaseFor(std::max(in.q_len, in.kv_len));
      RETURN_IF_ERROR(CudaStatus(
          cuda::LaunchRotary(q + q_row[n] * q_stride, in.batch * in.q_len, in.q_len, c.num_heads,
                             c.head_dim, base, c.rope_scaling, q_stride, context->stream),
          "rotary kernel"));
      RETURN_IF_ERROR(CudaStatus(
          cuda::LaunchRotary(k + kv_row[n] * k_stride, in.batch * in.kv_len, in.kv_len,
                             c.num_kv_heads, c.head_dim, base, c.rope_scaling, k_stride,
                             context->stream),
          "rotary kernel"));
    }
    AttentionOptions options = c.LayerOptions(in.options);
    DeviceAttentionProblem p;
    p.shape = ToShape(dims[n]);
    p.query = q + q_row[n] * q_stride;
    p.query_layout = ToDevice(HeadLayout::StridedRows(in.q_len, c.head_dim, q_stride));
    p.key = k + kv_row[n] * k_stride;
    p.key_layout = ToDevice(HeadLayout::StridedRows(in.kv_len, c.head_dim, k_stride));
    p.value = v + kv_row[n] * v_stride;
    p.value_layout = ToDevice(HeadLayout::StridedRows(in.kv_len, c.v_head_dim, v_stride));
    p.output = attended + q_row[n] * c.AttentionWidth();
    p.output_layout = ToDevice(HeadLayout::BatchRowHead(c.num_heads, in.q_len, c.v_head_dim));
    p.mask = masks[n].View(options, dims[n], device);
    p.scale = options.Scale(dims[n]);
    p.dropout_p = options.dropout_p;
    p.dropout_seed = options.dropout_seed;
    weights[n].Attach(device, p);
    RETURN_IF_ERROR(backend_.Attend(p, context->stream));
  }
  if (c.output_projection) {
    RETURN_IF_ERROR(Linear(*context, attended, q_rows, c.AttentionWidth(), weights_.out_weight,
                           weights_.out_bias, c.output_dim, on_device(output_at), c.output_dim));
  }
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(staging + staged.output_offset, device + staged.output_offset,
                      staged.output_bytes, cudaMemcpyDeviceToHost, context->stream),
      "cudaMemcpyAsync(outputs)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(context->stream), "forward pass"));

  std::vector<AttentionResult> results(count);
  for (size_t n = 0; n < count; ++n) {
    const float* output = host(output_at);
    DeliverOutput(*inputs[n], output + q_row[n] * c.output_dim,
                  (q_row[n + 1] - q_row[n]) * c.output_dim, &results[n]);
    weights[n].CopyOut(staging, results[n].weights);
    FinishWeights(results[n], dims[n], inputs[n]->options.need_weights);
  }
  return results;
}

absl::StatusOr<AttentionResult> CudaBackend::ScaledDotProductAttention(const SdpaInput& in) const {
  const AttentionDims& d = in.dims;
  Arena arena;
  const int64_t q_at = arena.Add(in.query.size() * sizeof(float));
  const int64_t k_at = arena.Add(in.key.size() * sizeof(float));
  const int64_t v_at = arena.Add(in.value.size() * sizeof(float));
  StagedMask mask;
  mask.Plan(in.options, arena);
  Staged staged;
  staged.input_bytes = arena.size();
  StagedWeights weights;
  weights.PlanScratch(d, in.options.need_weights, arena);
  staged.output_offset = arena.Add(0);
  const int64_t output_count = d.batch * d.num_heads * d.q_len * d.v_head_dim;
  const int64_t output_at = arena.Add(output_count * sizeof(float));
  weights.PlanOutput(d, in.options.need_weights, arena);
  staged.output_bytes = arena.size() - staged.output_offset;

  ASSIGN_OR_RETURN(StreamContext* context, Context());
  ASSIGN_OR_RETURN(char* device, context->device.Reserve(arena.size()));
  ASSIGN_OR_RETURN(char* staging, context->staging.Reserve(arena.size()));
  std::memcpy(staging + q_at, in.query.data(), in.query.size() * sizeof(float));
  std::memcpy(staging + k_at, in.key.data(), in.key.size() * sizeof(float));
  std::memcpy(staging + v_at, in.value.data(), in.value.size() * sizeof(float));
  mask.Stage(in.options, staging);
  RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(device, staging, staged.input_bytes,
                                             cudaMemcpyHostToDevice, context->stream),
                             "cudaMemcpyAsync(inputs)"));
  DeviceAttentionProblem p;
  p.shape = ToShape(d);
  p.query = reinterpret_cast<const float*>(device + q_at);
  p.query_layout = ToDevice(HeadLayout::BatchHeadRow(d.num_heads, d.q_len, d.head_dim));
  p.key = reinterpret_cast<const float*>(device + k_at);
  p.key_layout = ToDevice(HeadLayout::BatchHeadRow(d.num_kv_heads, d.kv_len, d.head_dim));
  p.value = reinterpret_cast<const float*>(device + v_at);
  p.value_layout = ToDevice(HeadLayout::BatchHeadRow(d.num_kv_heads, d.kv_len, d.v_head_dim));
  p.output = reinterpret_cast<float*>(device + output_at);
  p.output_layout = ToDevice(HeadLayout::BatchHeadRow(d.num_heads, d.q_len, d.v_head_dim));
  p.mask = mask.View(in.options, d, device);
  p.scale = in.options.Scale(d);
  p.dropout_p = in.options.dropout_p;
  p.dropout_seed = in.options.dropout_seed;
  weights.Attach(device, p);
  RETURN_IF_ERROR(Attend(p, context->stream));
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(staging + staged.output_offset, device + staged.output_offset,
                      staged.output_bytes, cudaMemcpyDeviceToHost, context->stream),
      "cudaMemcpyAsync(outputs)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(context->stream), "attention"));
  AttentionResult result;
  const float* output = reinterpret_cast<const float*>(staging + output_at);
  result.output.assign(output, output + output_count);
  weights.CopyOut(staging, result.weights);
  FinishWeights(result, d, in.options.need_weights);
  return result;
}

absl::StatusOr<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error == cudaErrorNoDevice) return 0;
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear it, so later calls do not report it again
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA driver (", cudaGetErrorString(error), ")"));
  }
  return count;
}

absl::StatusOr<std::shared_ptr<const Backend>> OpenCudaBackend(int device) {
  cudaDeviceProp properties;
  const cudaError_t error = cudaGetDeviceProperties(&properties, device);
  if (error != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open cuda:", device, ": ", cudaGetErrorString(error)));
  }
  return std::shared_ptr<const Backend>(std::make_shared<CudaBackend>(device, properties));
}

}  // namespace
}  // namespace attention::core

extern "C" __attribute__((visibility("default"))) const attention::core::CudaPlugin*
AttentionCudaPlugin() {
  static const attention::core::CudaPlugin plugin = {&attention::core::CudaDeviceCount,
                                                     &attention::core::OpenCudaBackend};
  return &plugin;
}

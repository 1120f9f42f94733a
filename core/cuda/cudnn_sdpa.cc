#include "core/cuda/cudnn_sdpa.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/status_macros.h"

namespace attention::core::cuda {
namespace {

// The directory this plugin was loaded from, with its trailing '/'.
std::string PluginDirectory() {
  Dl_info info;
  if (::dladdr(reinterpret_cast<void*>(&LoadCudnnSdpa), &info) == 0 || info.dli_fname == nullptr) {
    return "";
  }
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash + 1);
}

struct Loaded {
  const CudnnSdpaLibrary* library = nullptr;
  std::string why_not;
};

Loaded Load() {
  Loaded loaded;
  if (const char* setting = std::getenv("ATTENTION_CUDNN_SDPA");
      setting != nullptr && std::strcmp(setting, "off") == 0) {
    loaded.why_not = "ATTENTION_CUDNN_SDPA=off";
    return loaded;
  }
  const std::string path = PluginDirectory() + kCudnnSdpaLibraryFile;
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // never closed
  if (handle == nullptr) {
    const char* error = ::dlerror();
    loaded.why_not = absl::StrCat("cannot load ", path, ": ", error == nullptr ? "" : error);
    return loaded;
  }
  auto entry = reinterpret_cast<CudnnSdpaEntry>(::dlsym(handle, kCudnnSdpaEntry));
  if (entry == nullptr) {
    loaded.why_not = absl::StrCat(path, " has no ", kCudnnSdpaEntry);
    return loaded;
  }
  loaded.library = entry();
  return loaded;
}

int64_t Aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

const CudnnSdpaLibrary* LoadCudnnSdpa(std::string* why_not) {
  static const Loaded loaded = Load();
  if (loaded.library == nullptr && why_not != nullptr) *why_not = loaded.why_not;
  return loaded.library;
}

std::string CudnnSdpaSummary(int sm_major) {
  std::string why_not;
  const CudnnSdpaLibrary* library = LoadCudnnSdpa(&why_not);
  if (library == nullptr) {
    return absl::StrCat("cuDNN SDPA off (", why_not, "); attention on this project's kernels");
  }
  CudnnSdpaCall probe;
  probe.shape = {1, 1, 1, 1, 1, 64, 64};
  probe.bf16_products = true;
  if (std::string why = CudnnSdpaIneligibleReason(probe, sm_major, library->version());
      !why.empty()) {
    return absl::StrCat("cuDNN SDPA off (", why, "); attention on this project's kernels");
  }
  return absl::StrCat(
      "cuDNN ", library->version(),
      " fused SDPA for bfloat16 attention: head sizes multiples of 8 up to ", kCudnnSdpaMaxHeadDim,
      ", GQA and MQA, no mask, causal (bottom-right), a sliding window or key lengths; "
      "float32, attention weights, dropout and other masks on this project's kernels");
}

CudnnSdpaCall CudnnSdpaCallOf(const DeviceAttentionProblem& problem) {
  CudnnSdpaCall call;
  call.shape = problem.shape;
  call.bf16_products = problem.bf16_products;
  call.weights = problem.weights != nullptr;
  call.dropout = problem.dropout_p > 0.0f;
  call.causal = problem.mask.causal;
  call.sliding_window = problem.mask.sliding_window;
  const bool prefix =
      (problem.host_key_lengths == nullptr && problem.host_key_padding_keep == nullptr) ||
      PrefixKeyLengths(problem.host_key_lengths, problem.host_key_padding_keep, problem.shape.batch,
                       problem.shape.kv_len, &call.key_lengths);
  call.other_masks = !prefix || problem.mask.attn_mask_keep != nullptr ||
                     problem.mask.attn_mask_bias != nullptr;
  return call;
}

absl::StatusOr<bool> AttendOnCudnn(const DeviceAttentionProblem& problem, int device, int sm_major,
                                   StreamContext& context) {
  const CudnnSdpaLibrary* library = LoadCudnnSdpa(nullptr);
  if (library == nullptr) return false;
  const CudnnSdpaCall call = CudnnSdpaCallOf(problem);
  if (!CudnnSdpaIneligibleReason(call, sm_major, library->version()).empty()) return false;
  if (context.cudnn == nullptr) {
    if (!context.cudnn_unavailable.empty()) return false;
    std::string error;
    context.cudnn.reset(library->create_runner(device, &error));
    if (context.cudnn == nullptr) {
      context.cudnn_unavailable = error;
      std::cerr << "attention-service: cuda:" << device
                << ": cuDNN SDPA off for this worker: " << error << std::endl;
      return false;
    }
  }
  const CudnnSdpaGraphKey key = CudnnSdpaKeyOf(call, problem.scale);
  int64_t workspace_bytes = 0;
  if (!context.cudnn->WorkspaceBytes(key, &workspace_bytes).empty()) return false;

  // One device allocation: Q, K, V, O packed in bf16, the lengths, cuDNN's workspace.
  const AttentionShape& s = call.shape;
  const int64_t q_elements =
      CudnnSdpaPackedElements(s.batch, s.num_heads, key.q_bucket, s.head_dim);
  const int64_t k_elements =
      CudnnSdpaPackedElements(s.batch, s.num_kv_heads, key.kv_bucket, s.head_dim);
  const int64_t v_elements =
      CudnnSdpaPackedElements(s.batch, s.num_kv_heads, key.kv_bucket, s.v_head_dim);
  const int64_t o_elements =
      CudnnSdpaPackedElements(s.batch, s.num_heads, key.q_bucket, s.v_head_dim);
  const int64_t q_at = 0;
  const int64_t k_at = q_at + Aligned(q_elements * 2);
  const int64_t v_at = k_at + Aligned(k_elements * 2);
  const int64_t o_at = v_at + Aligned(v_elements * 2);
  const int64_t lengths_at = o_at + Aligned(o_elements * 2);
  const int64_t workspace_at = lengths_at + Aligned(2 * s.batch * 4);
  const int64_t total = workspace_at + Aligned(workspace_bytes);
  const cudaStream_t stream = context.stream;
  void* scratch = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(&scratch, total, stream),
                             absl::StrCat("cudaMallocAsync(", total, " bytes for cuDNN SDPA)")));
  char* base = static_cast<char*>(scratch);
  auto bf16_at = [base](int64_t at) { return reinterpret_cast<uint16_t*>(base + at); };
  // The true lengths, q_len for every sequence then its keys' (pageable: copied before return).
  std::vector<int32_t> lengths(2 * s.batch, static_cast<int32_t>(s.q_len));
  for (int64_t b = 0; b < s.batch; ++b) {
    lengths[s.batch + b] = static_cast<int32_t>(
        call.key_lengths.empty() ? s.kv_len : call.key_lengths[b]);
  }
  absl::Status status =
      CudaStatus(cudaMemcpyAsync(base + lengths_at, lengths.data(),
                                 lengths.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
                 "cudaMemcpyAsync(cuDNN SDPA lengths)");
  if (status.ok()) {
    status =
        CudaStatus(LaunchPackBf16Rows(problem.query, problem.query_layout, s.batch, s.num_heads,
                                      s.q_len, key.q_bucket, s.head_dim, bf16_at(q_at), stream),
                   "cuDNN SDPA query packing");
  }
  if (status.ok()) {
    status =
        CudaStatus(LaunchPackBf16Rows(problem.key, problem.key_layout, s.batch, s.num_kv_heads,
                                      s.kv_len, key.kv_bucket, s.head_dim, bf16_at(k_at), stream),
                   "cuDNN SDPA key packing");
  }
  if (status.ok()) {
    status =
        CudaStatus(LaunchPackBf16Rows(problem.value, problem.value_layout, s.batch, s.num_kv_heads,
                                      s.kv_len, key.kv_bucket, s.v_head_dim, bf16_at(v_at), stream),
                   "cuDNN SDPA value packing");
  }
  if (status.ok()) {
    CudnnSdpaBuffers buffers;
    buffers.query = bf16_at(q_at);
    buffers.key = bf16_at(k_at);
    buffers.value = bf16_at(v_at);
    buffers.output = bf16_at(o_at);
    buffers.q_lengths = reinterpret_cast<const int32_t*>(base + lengths_at);
    buffers.kv_lengths = buffers.q_lengths + s.batch;
    if (std::string error = context.cudnn->Run(key, buffers, base + workspace_at, stream);
        !error.empty()) {
      status = absl::InternalError(absl::StrCat("cuda:", device, ": ", error));
    }
  }
  if (status.ok()) {
    status = CudaStatus(
        LaunchUnpackBf16Rows(bf16_at(o_at), s.batch, s.num_heads, s.q_len, key.q_bucket,
                             s.v_head_dim, problem.output, problem.output_layout, stream),
        "cuDNN SDPA output unpacking");
  }
  // Freed once the stream passes the work above, even after a failure.
  const absl::Status freed = CudaStatus(cudaFreeAsync(scratch, stream), "cudaFreeAsync");
  RETURN_IF_ERROR(status);
  RETURN_IF_ERROR(freed);
  return true;
}

}  // namespace attention::core::cuda

#include "core/cuda/cudnn_sdpa.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
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
  if (::dladdr(reinterpret_cast<void*>(&CudnnSdpaSummary), &info) == 0 ||
      info.dli_fname == nullptr) {
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

// The library, loaded once; null with `why_not` set when it cannot be.
const CudnnSdpaLibrary* LoadCudnnSdpa(std::string* why_not) {
  static const Loaded loaded = Load();
  if (loaded.library == nullptr && why_not != nullptr) *why_not = loaded.why_not;
  return loaded.library;
}

// The facts of `problem` that CudnnSdpaIneligibleReason judges.
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
  call.other_masks =
      !prefix || problem.mask.attn_mask_keep != nullptr || problem.mask.attn_mask_bias != nullptr;
  return call;
}

// Where a call's packed tensors, lengths and cuDNN's workspace sit in its one allocation.
struct CudnnScratch {
  int64_t query = 0, key = 0, value = 0, output = 0, lengths = 0, workspace = 0, total = 0;
};

CudnnScratch PlanScratch(const AttentionShape& s, const CudnnSdpaGraphKey& key,
                         int64_t workspace_bytes) {
  const auto bf16_bytes = [](int64_t elements) { return Aligned(elements * 2); };
  CudnnScratch at;
  at.key = at.query +
           bf16_bytes(CudnnSdpaPackedElements(s.batch, s.num_heads, key.q_bucket, s.head_dim));
  at.value = at.key + bf16_bytes(CudnnSdpaPackedElements(s.batch, s.num_kv_heads, key.kv_bucket,
                                                         s.head_dim));
  at.output = at.value + bf16_bytes(CudnnSdpaPackedElements(s.batch, s.num_kv_heads, key.kv_bucket,
                                                            s.v_head_dim));
  at.lengths = at.output + bf16_bytes(CudnnSdpaPackedElements(s.batch, s.num_heads, key.q_bucket,
                                                              s.v_head_dim));
  at.workspace = at.lengths + Aligned(2 * s.batch * static_cast<int64_t>(sizeof(int32_t)));
  at.total = at.workspace + Aligned(workspace_bytes);
  return at;
}

// Packs the call's Q, K and V, runs the graph of `key` and unpacks its output, on `stream`.
absl::Status EnqueueOnCudnn(const DeviceAttentionProblem& problem, const CudnnSdpaCall& call,
                            const CudnnSdpaGraphKey& key, const CudnnScratch& at, char* base,
                            int device, CudnnSdpaRunner& runner, cudaStream_t stream) {
  const AttentionShape& s = call.shape;
  auto bf16_at = [base](int64_t offset) { return reinterpret_cast<uint16_t*>(base + offset); };
  // The true lengths, q_len for every sequence then its keys' (pageable: copied before return).
  std::vector<int32_t> lengths(2 * s.batch, static_cast<int32_t>(s.q_len));
  for (int64_t b = 0; b < s.batch; ++b) {
    lengths[s.batch + b] =
        static_cast<int32_t>(call.key_lengths.empty() ? s.kv_len : call.key_lengths[b]);
  }
  RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(base + at.lengths, lengths.data(),
                                 lengths.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream),
                 "cudaMemcpyAsync(cuDNN SDPA lengths)"));
  struct Packed {
    const char* what;
    const float* source;
    const DeviceLayout& layout;
    int64_t heads, rows, bucket, dim, offset;
  };
  for (const Packed& t : {Packed{"query", problem.query, problem.query_layout, s.num_heads, s.q_len,
                                 key.q_bucket, s.head_dim, at.query},
                          Packed{"key", problem.key, problem.key_layout, s.num_kv_heads, s.kv_len,
                                 key.kv_bucket, s.head_dim, at.key},
                          Packed{"value", problem.value, problem.value_layout, s.num_kv_heads,
                                 s.kv_len, key.kv_bucket, s.v_head_dim, at.value}}) {
    RETURN_IF_ERROR(CudaStatus(LaunchPackBf16Rows(t.source, t.layout, s.batch, t.heads, t.rows,
                                                  t.bucket, t.dim, bf16_at(t.offset), stream),
                               absl::StrCat("cuDNN SDPA ", t.what, " packing")));
  }
  CudnnSdpaBuffers buffers;
  buffers.query = bf16_at(at.query);
  buffers.key = bf16_at(at.key);
  buffers.value = bf16_at(at.value);
  buffers.output = bf16_at(at.output);
  buffers.q_lengths = reinterpret_cast<const int32_t*>(base + at.lengths);
  buffers.kv_lengths = buffers.q_lengths + s.batch;
  if (std::string error = runner.Run(key, buffers, base + at.workspace, stream); !error.empty()) {
    return absl::InternalError(absl::StrCat("cuda:", device, ": ", error));
  }
  return CudaStatus(
      LaunchUnpackBf16Rows(bf16_at(at.output), s.batch, s.num_heads, s.q_len, key.q_bucket,
                           s.v_head_dim, problem.output, problem.output_layout, stream),
      "cuDNN SDPA output unpacking");
}

}  // namespace

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
      ", GQA and MQA, no mask, causal (bottom-right), a sliding window, key lengths or "
      "right-padded key masks; "
      "float32, attention weights, dropout and other masks on this project's kernels");
}

absl::StatusOr<bool> AttendOnCudnn(const DeviceAttentionProblem& problem, int device, int sm_major,
                                   StreamContext& context) {
  const CudnnSdpaLibrary* library = LoadCudnnSdpa(nullptr);
  if (library == nullptr) return false;
  const CudnnSdpaCall call = CudnnSdpaCallOf(problem);
  if (!CudnnSdpaIneligibleReason(call, sm_major, library->version()).empty()) return false;
  if (context.cudnn == nullptr) {
    if (context.cudnn_unavailable) return false;
    std::string error;
    context.cudnn.reset(library->create_runner(device, &error));
    if (context.cudnn == nullptr) {
      context.cudnn_unavailable = true;
      std::cerr << "attention-service: cuda:" << device
                << ": cuDNN SDPA off for this worker: " << error << std::endl;
      return false;
    }
  }
  const CudnnSdpaGraphKey key = CudnnSdpaKeyOf(call, problem.scale);
  int64_t workspace_bytes = 0;
  if (!context.cudnn->WorkspaceBytes(key, &workspace_bytes).empty()) return false;

  // One stream-ordered allocation: Q, K, V, O packed in bf16, the lengths, cuDNN's workspace.
  const CudnnScratch at = PlanScratch(call.shape, key, workspace_bytes);
  void* scratch = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(&scratch, at.total, context.stream),
                             absl::StrCat("cudaMallocAsync(", at.total, " bytes for cuDNN SDPA)")));
  const absl::Status status = EnqueueOnCudnn(problem, call, key, at, static_cast<char*>(scratch),
                                             device, *context.cudnn, context.stream);
  // Freed once the stream passes the work above, even after a failure.
  const absl::Status freed = CudaStatus(cudaFreeAsync(scratch, context.stream), "cudaFreeAsync");
  RETURN_IF_ERROR(status);
  RETURN_IF_ERROR(freed);
  return true;
}

}  // namespace attention::core::cuda

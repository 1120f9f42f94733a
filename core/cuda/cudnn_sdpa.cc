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
#include "core/half_bits.h"
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
  call.fp16_products = problem.fp16_products;
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
    RETURN_IF_ERROR(
        CudaStatus(LaunchPack16BitRows(t.source, t.layout, s.batch, t.heads, t.rows, t.bucket,
                                       t.dim, !key.fp16, bf16_at(t.offset), stream),
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
      LaunchUnpack16BitRows(bf16_at(at.output), s.batch, s.num_heads, s.q_len, key.q_bucket,
                            s.v_head_dim, !key.fp16, problem.output, problem.output_layout, stream),
      "cuDNN SDPA output unpacking");
}

// Makes `runner` on first use: false when it cannot be made (logged once, for `whom`).
bool MakeRunner(const CudnnSdpaLibrary& library, int device, const char* whom,
                std::unique_ptr<CudnnSdpaRunner>& runner, bool& unavailable) {
  if (runner != nullptr) return true;
  if (unavailable) return false;
  std::string error;
  runner.reset(library.create_runner(device, &error));
  if (runner == nullptr) {
    unavailable = true;
    std::cerr << "attention-service: cuda:" << device << ": cuDNN SDPA off for " << whom << ": "
              << error << std::endl;
    return false;
  }
  return true;
}

// The facts of a session step that CudnnPagedIneligibleReason judges.
CudnnPagedCall CudnnPagedCallOf(const PagedDecodeBatch& batch, bool shared_prefixes,
                                const char* pool) {
  CudnnPagedCall call;
  call.num_heads = batch.num_heads;
  call.num_kv_heads = batch.layout.num_kv_heads;
  call.head_dim = batch.layout.key_dim;
  call.v_head_dim = batch.layout.value_dim;
  call.bf16_kv = batch.layout.dtype == DType::kBFloat16;
  call.bf16_products = batch.bf16_products;
  call.shared_prefixes = shared_prefixes;
  call.tokens_per_block = batch.tokens_per_block;
  call.block_bytes = batch.storage.block_bytes;
  call.num_blocks = batch.storage.num_blocks;
  call.storage_address = reinterpret_cast<uint64_t>(pool);
  call.sliding_window = batch.sliding_window;
  for (const PagedDecodeSequence& s : batch.sequences) {
    call.lengths.push_back(s.length);
    call.num_queries.push_back(s.num_queries);
    call.log_sum_exp = call.log_sum_exp || s.log_sum_exp != nullptr;
  }
  return call;
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
      " fused SDPA for bfloat16 attention (and float16 scaled dot-product attention): head "
      "sizes multiples of 8 up to ",
      kCudnnSdpaMaxHeadDim,
      ", GQA and MQA, no mask, causal (bottom-right), a sliding window, key lengths or "
      "right-padded key masks; session steps of bfloat16 layers over bfloat16 KV on its paged "
      "SDPA (no log-sum-exps, no forks of one prefix in the step); "
      "float32, attention weights, dropout and other masks on this project's kernels");
}

absl::StatusOr<bool> AttendOnCudnn(const DeviceAttentionProblem& problem, int device, int sm_major,
                                   StreamContext& context) {
  const CudnnSdpaLibrary* library = LoadCudnnSdpa(nullptr);
  if (library == nullptr) return false;
  const CudnnSdpaCall call = CudnnSdpaCallOf(problem);
  if (!CudnnSdpaIneligibleReason(call, sm_major, library->version()).empty()) return false;
  if (!MakeRunner(*library, device, "this worker", context.cudnn, context.cudnn_unavailable)) {
    return false;
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

absl::StatusOr<bool> AttendPagedOnCudnn(const PagedDecodeBatch& batch, bool shared_prefixes,
                                        const char* pool, int device, int sm_major,
                                        CudnnPagedContext& context, cudaStream_t stream) {
  const CudnnSdpaLibrary* library = LoadCudnnSdpa(nullptr);
  if (library == nullptr) return false;
  const CudnnPagedCall call = CudnnPagedCallOf(batch, shared_prefixes, pool);
  if (!CudnnPagedIneligibleReason(call, sm_major, library->version()).empty()) return false;
  if (!MakeRunner(*library, device, "session steps", context.runner, context.unavailable)) {
    return false;
  }
  const CudnnSdpaGraphKey key = CudnnPagedKeyOf(call, batch.scale);
  int64_t workspace_bytes = 0;
  if (!context.runner->WorkspaceBytes(key, &workspace_bytes).empty()) return false;

  // The rows, lengths and page table go over in one copy; the answers come back in one.
  const int64_t h = key.num_heads, dk = key.head_dim, dv = key.v_head_dim;
  const int64_t query_rows = key.q_bucket * h * dk, output_rows = key.q_bucket * h * dv;
  Arena arena;
  const int64_t query_at = arena.Add(key.batch * query_rows * 2);
  const int64_t q_lengths_at = arena.Add(key.batch * 4);
  const int64_t kv_lengths_at = arena.Add(key.batch * 4);
  const int64_t table_at = arena.Add(key.batch * key.pages * 4);
  const int64_t inputs_end = arena.size();
  const int64_t output_at = arena.Add(key.batch * output_rows * 2);
  const int64_t outputs_end = arena.size();
  const int64_t workspace_at = arena.Add(workspace_bytes);
  ASSIGN_OR_RETURN(char* host, context.host.Reserve(outputs_end));
  ASSIGN_OR_RETURN(char* on_device, context.device.Reserve(arena.size()));
  auto* query = reinterpret_cast<uint16_t*>(host + query_at);
  std::fill(query, query + key.batch * query_rows, uint16_t{0});
  for (size_t b = 0; b < batch.sequences.size(); ++b) {
    const PagedDecodeSequence& s = batch.sequences[b];
    // A sequence's [n][H][dk] rows are its rows of the [batch][q_bucket][H][dk] queries.
    for (int64_t e = 0; e < s.num_queries * h * dk; ++e) {
      query[static_cast<int64_t>(b) * query_rows + e] = FloatToBFloat16Bits(s.query[e]);
    }
  }
  WriteCudnnPagedArrays(key, batch.sequences, reinterpret_cast<int32_t*>(host + q_lengths_at),
                        reinterpret_cast<int32_t*>(host + kv_lengths_at),
                        reinterpret_cast<int32_t*>(host + table_at));
  RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(on_device, host, inputs_end, cudaMemcpyHostToDevice, stream),
                 "cudaMemcpyAsync of the step's queries and page tables"));
  CudnnSdpaBuffers buffers;
  buffers.query = on_device + query_at;
  buffers.key = pool;
  buffers.value = pool + key.tokens_per_block * key.num_kv_heads * dk * 2;  // after the keys
  buffers.output = on_device + output_at;
  buffers.q_lengths = reinterpret_cast<const int32_t*>(on_device + q_lengths_at);
  buffers.kv_lengths = reinterpret_cast<const int32_t*>(on_device + kv_lengths_at);
  buffers.page_table = reinterpret_cast<const int32_t*>(on_device + table_at);
  if (std::string error = context.runner->Run(key, buffers, on_device + workspace_at, stream);
      !error.empty()) {
    cudaStreamSynchronize(stream);  // the staging is not reused while the copy in may run
    return absl::InternalError(absl::StrCat("cuda:", device, ": ", error));
  }
  RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(host + output_at, on_device + output_at, outputs_end - output_at,
                                 cudaMemcpyDeviceToHost, stream),
                 "cudaMemcpyAsync of the step's outputs"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "cuDNN paged SDPA"));
  const auto* output = reinterpret_cast<const uint16_t*>(host + output_at);
  for (size_t b = 0; b < batch.sequences.size(); ++b) {
    const PagedDecodeSequence& s = batch.sequences[b];
    for (int64_t e = 0; e < s.num_queries * h * dv; ++e) {
      s.output[e] = BFloat16BitsToFloat(output[static_cast<int64_t>(b) * output_rows + e]);
    }
  }
  return true;
}

}  // namespace attention::core::cuda

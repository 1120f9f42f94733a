// The CUDA plugin's door to cuDNN's fused SDPA: libattention_cudnn_sdpa.so, a second plugin
// beside libattention_cuda_backend.so that links cuDNN 9 and holds the cuDNN frontend's
// graphs. The backend plugin loads it with dlopen on first use, so a GPU machine without
// cuDNN's libraries keeps the backend and its own kernels (the reason is logged once).
//
// The backend packs a call's Q, K and V into dense bf16 buffers (cudnn_sdpa_plan.h says
// which calls and how they are padded), this library runs cuDNN's graph on them, and the
// backend unpacks the output.
#ifndef ATTENTION_CORE_CUDA_CUDNN_SDPA_LIBRARY_H_
#define ATTENTION_CORE_CUDA_CUDNN_SDPA_LIBRARY_H_

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "core/cuda/cudnn_sdpa_plan.h"

namespace attention::core::cuda {

// Device buffers of one call, dense and padded to the key's buckets (row-major) unless paged:
// query [B][H][q_bucket][dk], key [B][Hkv][kv_bucket][dk], value [B][Hkv][kv_bucket][dv],
// output [B][H][q_bucket][dv], all bf16; q_lengths and kv_lengths [B] int32 (cuDNN's padding
// sequence lengths: the true q_len and kv_len).
struct CudnnSdpaBuffers {
  const void* query = nullptr;
  const void* key = nullptr;
  const void* value = nullptr;
  void* output = nullptr;
  const int32_t* q_lengths = nullptr;
  const int32_t* kv_lengths = nullptr;
  // A paged graph (CudnnSdpaGraphKey::paged): query and output are [B][q_bucket][H][d] bf16,
  // key and value the pool's first block's key and value rows (containers of num_blocks
  // blocks, block_elements apart), and the page table [B][pages] int32.
  const int32_t* page_table = nullptr;
};

// A cuDNN handle and its graphs, for one stream (one batch worker thread).
class CudnnSdpaRunner {
 public:
  virtual ~CudnnSdpaRunner() = default;
  // Device workspace bytes the graph of `key` needs, building it first when it is not cached:
  // "" or why cuDNN refuses the graph (then the call runs on the project's kernels).
  virtual std::string WorkspaceBytes(const CudnnSdpaGraphKey& key, int64_t* bytes) = 0;
  // Enqueues the graph of `key` (WorkspaceBytes' first) on `stream`: "" or the error.
  virtual std::string Run(const CudnnSdpaGraphKey& key, const CudnnSdpaBuffers& buffers,
                          void* workspace, cudaStream_t stream) = 0;
};

// What the library offers; returned by its one exported C symbol, kCudnnSdpaEntry.
struct CudnnSdpaLibrary {
  int64_t (*version)();  // cudnnGetVersion() of the cuDNN loaded
  // A runner on GPU `device`; null with `error` set when cuDNN cannot start there.
  CudnnSdpaRunner* (*create_runner)(int device, std::string* error);
};
inline constexpr char kCudnnSdpaEntry[] = "AttentionCudnnSdpa";
inline constexpr char kCudnnSdpaLibraryFile[] = "libattention_cudnn_sdpa.so";
using CudnnSdpaEntry = const CudnnSdpaLibrary* (*)();

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_CUDNN_SDPA_LIBRARY_H_

// The paged decode kernels (paged_decode.cu), callable from host C++: plain structs only,
// read by g++ and nvcc alike. PagedDecodeCuda (paged_decode.h) validates and plans a batch,
// then launches these once per PagedLaunch of its plan.
#ifndef ATTENTION_CORE_CUDA_PAGED_DECODE_KERNELS_H_
#define ATTENTION_CORE_CUDA_PAGED_DECODE_KERNELS_H_

#include <cstdint>

#include <cuda_runtime.h>

#include "core/cuda/paged_decode_plan.h"

namespace attention::core::cuda {

// One sequence, device pointers; the plan's numbers the kernels need.
struct PagedDeviceSequence {
  const int32_t* block_table = nullptr;  // kv_cache::BlockId
  const float* query = nullptr;          // [n][H][dk]
  float* output = nullptr;               // [n][H][dv]
  float* log_sum_exp = nullptr;          // [n][H], or null
  int32_t length = 0;
  int32_t num_queries = 0;
  int32_t first_split = 0;
  int32_t run_splits = 0;
  int32_t row_chunks = 0;
  int32_t rows = 0;
  int64_t split_block_begin = 0;
  int64_t merge_block_begin = 0;
  int64_t state_offset = 0;
  // PagedSequencePlan's shared_* (0 outside a group of forks).
  int32_t shared_splits = 0;
  int32_t shared_rows = 0;
  int32_t shared_first_row = 0;
  int64_t shared_state_offset = 0;
};

// One launch's sequences: a kernel parameter (kCudaPagedSequencesPerLaunch * 104 bytes), so
// nothing is copied to the device before the kernels run.
struct PagedDeviceLaunch {
  const void* storage = nullptr;
  int64_t block_bytes = 0;
  int32_t num_blocks = 0;  // a block id outside [0, num_blocks) reads as NaN
  int32_t tokens_per_block = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t key_dim = 0;
  int32_t value_dim = 0;
  int32_t sliding_window = 0;
  int32_t count = 0;  // sequences below
  float scale = 1.0f;
  bool bfloat16 = false;
  float* states = nullptr;  // scratch, PagedDecodePlan::scratch_bytes
  PagedDeviceSequence sequences[kCudaPagedSequencesPerLaunch];
};

// The split kernel or the merge kernel of one launch on `stream` (nothing for no blocks);
// returns the launch error, if any. Every split launch of a plan goes before its first merge:
// a member's merge reads its group entry's states, which may be in a later launch.
cudaError_t LaunchPagedSplits(const PagedDeviceLaunch& launch, const PagedDecodePlan& plan,
                              const PagedLaunch& blocks, cudaStream_t stream);
cudaError_t LaunchPagedMerge(const PagedDeviceLaunch& launch, const PagedLaunch& blocks,
                             cudaStream_t stream);

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_PAGED_DECODE_KERNELS_H_

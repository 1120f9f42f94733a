// How the CUDA attention kernels tile a problem and are launched: pure host-side logic
// (plus the index decoding the kernels share), built into every configuration so that the
// CPU tests check it on machines without a GPU.
#ifndef ATTENTION_CORE_CUDA_LAUNCH_PLAN_H_
#define ATTENTION_CORE_CUDA_LAUNCH_PLAN_H_

#include <cstdint>
#include <string>

#include "core/host_device.h"

namespace attention::core::cuda {

// Sizes of one attention call (as core::AttentionDims, without absl).
struct AttentionShape {
  int64_t batch = 1, num_heads = 1, num_kv_heads = 1, q_len = 1, kv_len = 1, head_dim = 1,
          v_head_dim = 1;
};

// The flash kernel: each block owns kFlashRowsPerBlock query rows of one (sequence, head)
// and walks the keys in tiles of kFlashKeysPerTile held in shared memory; each of its
// kFlashWarps warps owns kFlashRowsPerBlock / kFlashWarps rows, one key per lane.
inline constexpr int kFlashRowsPerBlock = 32;
inline constexpr int kFlashKeysPerTile = 32;
inline constexpr int kFlashWarps = 4;
inline constexpr int kFlashRowsPerWarp = kFlashRowsPerBlock / kFlashWarps;
// Widest dk and dv: a lane accumulates dv / 32 output columns per row in registers.
inline constexpr int64_t kFlashMaxHeadDim = 256;
// Threads per block of the weights kernel (one weight each, grid-stride).
inline constexpr int kWeightThreads = 256;
// CUDA's limit on grid.x.
inline constexpr int64_t kMaxGridBlocks = (int64_t{1} << 31) - 1;

struct FlashLaunchPlan {
  int64_t query_blocks = 0;  // ceil(Nq / kFlashRowsPerBlock)
  int64_t blocks = 0;        // grid.x: query_blocks * H * B
  int threads = kFlashWarps * 32;
  // Output columns each lane accumulates per row, rounded up to 2, 4 or 8 (a template
  // argument of the kernel, so the accumulators stay in registers).
  int value_chunks = 2;
  // Dynamic shared memory: the block's Q rows, a K tile padded by one float per row (so
  // lanes reading different keys hit different banks), a V tile.
  int64_t shared_bytes = 0;
  int64_t weight_blocks = 0;  // 0 when no weights are returned
};

// Empty when the kernels can run `shape` with at most `max_shared_bytes` of shared memory
// per block; otherwise what they cannot do, naming the field and the limit.
std::string FlashUnsupportedReason(const AttentionShape& shape, int64_t max_shared_bytes);

// The launch of a shape FlashUnsupportedReason accepts.
FlashLaunchPlan PlanFlashAttention(const AttentionShape& shape, bool weights);

// The (sequence, head, first query row) of flash block `block`: query blocks vary fastest,
// then heads, then sequences.
struct FlashBlock {
  int64_t batch_index, head, first_row;
};
ATTENTION_HOST_DEVICE inline FlashBlock DecodeFlashBlock(int64_t block, int64_t query_blocks,
                                                         int64_t num_heads) {
  const int64_t query_block = block % query_blocks;
  const int64_t head_and_batch = block / query_blocks;
  return {head_and_batch / num_heads, head_and_batch % num_heads,
          query_block * kFlashRowsPerBlock};
}

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_LAUNCH_PLAN_H_

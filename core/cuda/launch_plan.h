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
ATTENTION_HOST_DEVICE inline FlashBlock DecodeFlashBlock(
    int64_t block, int64_t query_blocks, int64_t num_heads,
    int64_t rows_per_block = kFlashRowsPerBlock) {
  const int64_t query_block = block % query_blocks;
  const int64_t head_and_batch = block / query_blocks;
  return {head_and_batch / num_heads, head_and_batch % num_heads, query_block * rows_per_block};
}

// The tensor-core kernel of BFLOAT16 layers (issue 26): both products on mma (16 x 16 x 16
// bf16 tiles, float32 accumulation), softmax, masks and dropout in float32. Each block owns
// kMmaRowsPerBlock query rows of one (sequence, head), kMmaWarps warps of 16 rows each, and
// walks the keys in tiles of kMmaKeysPerTile. It takes head sizes that are multiples of 16
// up to kMmaMaxHeadDim and no attention weights (whose statistics the float32 kernel keeps);
// other calls of a bf16 layer run the float32 kernel (more accurate, so within the rule).
inline constexpr int kMmaRowsPerBlock = 64;
inline constexpr int kMmaKeysPerTile = 64;
inline constexpr int kMmaWarps = kMmaRowsPerBlock / 16;
inline constexpr int64_t kMmaMaxHeadDim = 128;

// Shared memory of the mma kernel, in bytes from its start; leading dimensions in elements.
// Rows are padded (8 bf16 or 4 floats) against bank conflicts, as mma's loads allow, and
// every region starts 128-byte aligned (a fragment load needs 32).
struct MmaSharedLayout {
  int64_t q_ld = 0, k_ld = 0, v_ld = 0;  // bf16 rows of Q [64][dk], K [64][dk], V [64][dv]
  int64_t scores_ld = 0, probabilities_ld = 0, output_ld = 0;  // per warp, 16 rows each
  int64_t q = 0, k = 0, v = 0;
  // Per warp w: region + w * per_warp_bytes.
  int64_t scores = 0, probabilities = 0, output = 0, row_state = 0;
  int64_t per_warp_bytes = 0;
  int64_t total_bytes = 0;
};
ATTENTION_HOST_DEVICE inline int64_t MmaAligned(int64_t bytes) { return (bytes + 127) / 128 * 128; }
ATTENTION_HOST_DEVICE inline MmaSharedLayout PlanMmaShared(int64_t head_dim, int64_t v_head_dim) {
  MmaSharedLayout l;
  l.q_ld = head_dim + 8;
  l.k_ld = head_dim + 8;
  l.v_ld = v_head_dim + 8;
  l.scores_ld = kMmaKeysPerTile + 4;
  l.probabilities_ld = kMmaKeysPerTile + 8;
  l.output_ld = v_head_dim + 4;
  l.q = 0;
  l.k = l.q + MmaAligned(kMmaRowsPerBlock * l.q_ld * 2);
  l.v = l.k + MmaAligned(kMmaKeysPerTile * l.k_ld * 2);
  const int64_t warps = l.v + MmaAligned(kMmaKeysPerTile * l.v_ld * 2);
  // Inside one warp's region: scores [16][scores_ld] floats, probabilities [16][ld] bf16,
  // output accumulators [16][output_ld] floats, then max, sum and correction per row.
  l.scores = warps;
  l.probabilities = l.scores + MmaAligned(16 * l.scores_ld * 4);
  l.output = l.probabilities + MmaAligned(16 * l.probabilities_ld * 2);
  l.row_state = l.output + MmaAligned(16 * l.output_ld * 4);
  l.per_warp_bytes = l.row_state + MmaAligned(3 * 16 * 4) - warps;
  l.total_bytes = warps + kMmaWarps * l.per_warp_bytes;
  return l;
}

struct MmaLaunchPlan {
  int64_t query_blocks = 0;  // ceil(Nq / kMmaRowsPerBlock)
  int64_t blocks = 0;        // grid.x: query_blocks * H * B
  int threads = kMmaWarps * 32;
  MmaSharedLayout shared;
};

// Whether the mma kernel computes this call: head sizes it tiles, no weights, shared memory
// and grid within the device's limits.
bool MmaKernelTakes(const AttentionShape& shape, bool weights, int64_t max_shared_bytes);
MmaLaunchPlan PlanMmaAttention(const AttentionShape& shape);

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_LAUNCH_PLAN_H_

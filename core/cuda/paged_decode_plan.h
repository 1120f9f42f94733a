// How the CUDA paged decode kernels (paged_decode.cu) cut a batch into thread blocks: pure
// host-side arithmetic (plus the index decoding the kernels share), built into every
// configuration so that machines without a GPU test it.
//
// The split kernel: one block of kCudaPagedThreads threads per (sequence, KV head, split of
// kCudaPagedSplitKeys absolute keys, chunk of kCudaPagedRowsPerBlock query rows). It reads the
// split's keys and values of its KV head once for every query row of the chunk (rows
// r = i * group + g: query i, head kv_head * group + g), so a GQA group's heads share one read.
// It writes one partial softmax state per row: max, sum of exp(score - max), and the values
// weighted by those exps. The merge kernel: one warp per output row (query, head), which folds
// the row's split states in split order. Every sum runs in an order fixed by the layout alone,
// so results are bitwise the same for any batch composition.
#ifndef ATTENTION_CORE_CUDA_PAGED_DECODE_PLAN_H_
#define ATTENTION_CORE_CUDA_PAGED_DECODE_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/host_device.h"

namespace attention::core::cuda {

// Keys per split. Fixed in absolute keys (key k is in split k / kCudaPagedSplitKeys whatever
// the batch), and small, so that one short sequence still fills a GPU: Llama-3-8B at 4096
// tokens is 8 KV heads * 32 splits = 256 blocks, two per SM of an H100. The merge reads
// (dv + 2) floats per row per split: 2% more than the 128 keys' float32 K and V it replaces.
inline constexpr int64_t kCudaPagedSplitKeys = 128;
// Four warps: small blocks, so that many of them (and their loads) are in flight per SM.
inline constexpr int kCudaPagedThreads = 128;
// Query rows per block: a lane keeps rows * (values per load) float accumulators. Decode
// (n = 1) with GQA groups up to 8 is one chunk; n * group rows beyond it take more chunks,
// each reading the split again (from L2, as chunks of one split are neighbours in the grid).
inline constexpr int kCudaPagedRowsPerBlock = 8;
// Lanes that share one key's dot product: they read 8 * 16 = 128 contiguous bytes (one
// cache line) per load, and reduce the rows' partial sums in three shuffles.
inline constexpr int kCudaPagedKeyLanes = 8;
// Sequences per launch: their descriptors travel as a kernel parameter (under 4 KiB), so a
// call copies nothing to the device but its results; larger batches take several launches.
inline constexpr int kCudaPagedSequencesPerLaunch = 32;
// Output rows per merge block: one warp each.
inline constexpr int kCudaPagedMergeRowsPerBlock = kCudaPagedThreads / 32;
// CUDA's limit on grid.x.
inline constexpr int64_t kCudaPagedMaxGridBlocks = (int64_t{1} << 31) - 1;

// The batch's shape, as the host sees it (PagedDecodeBatch without device pointers).
struct PagedDecodeDims {
  int64_t num_heads = 1;      // H
  int64_t num_kv_heads = 1;   // H_kv
  int64_t key_dim = 1;        // dk
  int64_t value_dim = 1;      // dv
  int64_t element_bytes = 4;  // 4: float32 KV, 2: bfloat16
  int64_t tokens_per_block = 1;
  int64_t block_bytes = 1;
  uint64_t storage_address = 0;  // for the alignment of vector loads
  int64_t sliding_window = 0;
};

struct PagedSequenceDims {
  int64_t length = 1;       // L
  int64_t num_queries = 1;  // n
};

// One sequence's blocks and states.
struct PagedSequencePlan {
  int64_t first_split = 0;   // splits before it lie wholly before the first query's window
  int64_t run_splits = 0;    // splits run: first_split .. ceil(L / split keys) - 1
  int64_t rows = 0;          // n * group
  int64_t row_chunks = 0;    // ceil(rows / kCudaPagedRowsPerBlock)
  int64_t split_blocks = 0;  // H_kv * run_splits * row_chunks
  int64_t merge_blocks = 0;  // ceil(n * H / kCudaPagedMergeRowsPerBlock)
  // Blocks of the sequences before it in its launch (prefix sums the kernels search).
  int64_t split_block_begin = 0;
  int64_t merge_block_begin = 0;
  int64_t state_offset = 0;  // floats into the scratch: [H_kv][run_splits][rows][dv + 2]
};

// Sequences [first, first + count) of the batch in one launch of each kernel.
struct PagedLaunch {
  int64_t first_sequence = 0, count = 0;
  int64_t split_blocks = 0, merge_blocks = 0;
};

struct PagedDecodePlan {
  // Elements per K and V load: 16 bytes' worth of K (4 float32, 8 bfloat16) and 4 values,
  // when every row starts 16-byte aligned; else 1 (scalar loads).
  int key_vector = 1;
  int value_vector = 1;
  // Lanes across one key's value columns (a power of two, 8..32, covering dv / value_vector
  // column vectors, looping when wider); the block's other lanes take other keys.
  int value_lanes = 32;
  int64_t shared_bytes = 0;   // dynamic shared memory of the split kernel
  int64_t scratch_bytes = 0;  // the split states, float32
  std::vector<PagedSequencePlan> sequences;
  std::vector<PagedLaunch> launches;
};

// Empty when the kernels can run `dims` with at most `max_shared_bytes` of shared memory per
// block; otherwise what they cannot do, naming the field and the limit.
std::string PagedDecodeUnsupportedReason(const PagedDecodeDims& dims,
                                         const std::vector<PagedSequenceDims>& sequences,
                                         int64_t max_shared_bytes);

// The plan of a batch that PagedDecodeUnsupportedReason accepts (and the CPU kernel's
// validation, which the caller runs first).
PagedDecodePlan PlanPagedDecode(const PagedDecodeDims& dims,
                                const std::vector<PagedSequenceDims>& sequences);

// The first key a query at `position` sees (CPU: FirstVisibleKey).
ATTENTION_HOST_DEVICE inline int64_t PagedFirstVisibleKey(int64_t position, int64_t window) {
  return window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
}

// A split block of one sequence: row chunks vary fastest (chunks of one split share its
// bytes in L2), then splits, then KV heads.
struct PagedSplitBlock {
  int64_t kv_head, split, row_chunk;  // split counts from the sequence's first_split
};
ATTENTION_HOST_DEVICE inline PagedSplitBlock DecodePagedSplitBlock(int64_t block,
                                                                   int64_t run_splits,
                                                                   int64_t row_chunks) {
  const int64_t row_chunk = block % row_chunks;
  const int64_t split_and_head = block / row_chunks;
  return {split_and_head / run_splits, split_and_head % run_splits, row_chunk};
}

// Floats of one row's state, and where a row's state is among a sequence's.
ATTENTION_HOST_DEVICE inline int64_t PagedStateFloats(int64_t value_dim) { return value_dim + 2; }
ATTENTION_HOST_DEVICE inline int64_t PagedStateIndex(int64_t kv_head, int64_t split, int64_t row,
                                                     int64_t run_splits, int64_t rows,
                                                     int64_t value_dim) {
  return ((kv_head * run_splits + split) * rows + row) * PagedStateFloats(value_dim);
}

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_PAGED_DECODE_PLAN_H_

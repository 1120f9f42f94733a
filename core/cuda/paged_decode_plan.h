// How the CUDA paged decode kernels (paged_decode.cu) cut a batch into thread blocks: pure
// host-side arithmetic (plus the index decoding the kernels share), built into every
// configuration so that machines without a GPU test it.
//
// The split kernel: one block of kCudaPagedWarps warps per (sequence, KV head, split of
// kCudaPagedSplitKeys absolute keys, chunk of kCudaPagedRowsPerBlock query rows). Rows are
// r = i * group + g: query i, head kv_head * group + g, so a GQA group's heads share one read
// of the split's keys and values. Warp w owns the split's keys [32 w, 32 w + 32) and streams
// them in tiles with an online softmax kept in registers: its lanes form groups of
// PagedDecodePlan::lanes lanes, one key per group at a time, each lane holding `chunks`
// vectors of `vector` elements of every row's query and value accumulator (and of the key
// and value rows it loads, 16 bytes per load). A key group keeps its own (max, sum, values)
// per row; the groups merge by shuffles at the end of the warp, the warps in warp order
// through shared memory, and the block writes one partial state per row: max, sum of
// exp(score - max), and the values weighted by those exps.
//
// The merge kernel: one block of kCudaPagedMergeThreads per (sequence, output row (query,
// head), chunk of kCudaPagedMergeColumns value columns); one thread per (column, part of the
// splits), the parts added in part order. Every sum runs in an order fixed by the layout
// alone, so results are bitwise the same for any batch composition.
//
// Forks of one prefix (issue 41): a group of sequences whose first S keys are the same
// blocks (FindSharedPrefixes, S a multiple of kCudaPagedSplitKeys) has its shared splits run
// once for all its members' rows, as one more entry after the batch's sequences: rows in
// member order (their queries contiguous), each placed so that it sees every shared key.
// Its row chunks of one split are neighbours in the grid, so the split's bytes come from
// memory once and from L2 for the others. Each member runs only its own splits, and its
// merge reads the shared splits' states from the group's entry: the same states, merged in
// the same order, so results are bitwise those without sharing.
#ifndef ATTENTION_CORE_CUDA_PAGED_DECODE_PLAN_H_
#define ATTENTION_CORE_CUDA_PAGED_DECODE_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/host_device.h"

namespace attention::core::cuda {

// Keys per split, fixed in absolute keys (key k is in split k / kCudaPagedSplitKeys whatever
// the batch): a constant, so that a sequence's results depend on nothing but itself. 256
// balances two needs. Filling the GPU: Llama-3-8B (8 KV heads) at 4096 tokens is 8 * 16 =
// 128 blocks of 8 warps, one per SM of an H100 / H200 (132), each with 32 KiB of loads in
// flight (see paged_decode.cu); 32768 tokens is 1024 blocks. The merge's cost: it reads
// (dv + 2) floats per row per split, 1.6% (float32) or 3.2% (bfloat16) of the split's K and
// V bytes for a GQA group of 4, each merge thread adding 1/8 of a row's splits (16 at 32768
// tokens).
inline constexpr int64_t kCudaPagedSplitKeys = 256;
// Warps of a split block; each owns 32 consecutive keys of the split (one per lane, for the
// block-table look-ups).
inline constexpr int kCudaPagedWarps = 8;
inline constexpr int kCudaPagedThreads = kCudaPagedWarps * 32;
inline constexpr int kCudaPagedWarpKeys = 32;
static_assert(kCudaPagedWarps * kCudaPagedWarpKeys == kCudaPagedSplitKeys);
// Query rows per split block: each lane keeps rows * chunks * vector float32 query elements
// and as many accumulators in registers. A GQA group of up to 4 at n = 1 is one chunk; more
// rows take more chunks, each reading the split again (from L2: chunks of one split are
// neighbours in the grid).
inline constexpr int kCudaPagedRowsPerBlock = 4;
// The widest key or value row the kernels take (registers: see PagedDecodePlan::chunks).
inline constexpr int64_t kCudaPagedMaxHeadDim = 512;
// Sequences per launch: their descriptors travel as a kernel parameter (under 4 KiB), so a
// call copies nothing to the device but its results; larger batches take several launches.
inline constexpr int kCudaPagedSequencesPerLaunch = 32;
// The merge kernel: blocks of kCudaPagedMergeParts warps, lane c of warp p adding column c of
// the block's chunk over splits p, p + parts, ...
inline constexpr int kCudaPagedMergeColumns = 32;
inline constexpr int kCudaPagedMergeParts = 8;
inline constexpr int kCudaPagedMergeThreads = kCudaPagedMergeColumns * kCudaPagedMergeParts;
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

// A group of forks whose keys [0, shared_keys) are the same blocks (SharedPrefixGroup).
struct PagedSharedGroupDims {
  std::vector<int64_t> members;  // indices of sequences, ascending, at least 2
  int64_t shared_keys = 0;       // a positive multiple of kCudaPagedSplitKeys
};

// One sequence's blocks and states.
struct PagedSequencePlan {
  int64_t first_split = 0;   // splits before it lie wholly before the first query's window
  int64_t run_splits = 0;    // splits run: first_split .. ceil(L / split keys) - 1
  int64_t rows = 0;          // n * group
  int64_t row_chunks = 0;    // ceil(rows / kCudaPagedRowsPerBlock)
  int64_t split_blocks = 0;  // H_kv * run_splits * row_chunks
  int64_t merge_blocks = 0;  // n * H * ceil(dv / kCudaPagedMergeColumns)
  // Blocks of the sequences before it in its launch (prefix sums the kernels search).
  int64_t split_block_begin = 0;
  int64_t merge_block_begin = 0;
  int64_t state_offset = 0;  // floats into the scratch: [H_kv][run_splits][rows][dv + 2]
  // A group's member: the first `shared_splits` splits' states are the group entry's (at
  // shared_state_offset, of shared_rows rows), its rows from shared_first_row on; 0 else.
  int64_t shared_splits = 0;
  int64_t shared_rows = 0;
  int64_t shared_first_row = 0;
  int64_t shared_state_offset = 0;
};

// Sequences [first, first + count) of the batch in one launch of each kernel.
struct PagedLaunch {
  int64_t first_sequence = 0, count = 0;
  int64_t split_blocks = 0, merge_blocks = 0;
};

struct PagedDecodePlan {
  // Elements per K and V load: 16 bytes' worth (4 float32, 8 bfloat16) when every row starts
  // 16-byte aligned; else 1 (scalar loads).
  int vector = 1;
  // Lanes across one key's row (a power of two up to 32: the fewest that cover the wider of
  // the key and value rows in vectors, or 32); a warp takes 32 / lanes keys at a time.
  int lanes = 32;
  // Vectors per lane per row (a kernel template argument: 1 or 4 for float32 vectors, 1 or 2
  // for bfloat16 vectors, 4 or 16 for scalars): lane l of a key group holds the row's vectors
  // l, l + lanes, ... Zero when the rows are wider than kCudaPagedMaxHeadDim.
  int chunks = 1;
  int64_t shared_bytes = 0;   // dynamic shared memory of the split kernel
  int64_t scratch_bytes = 0;  // the split states, float32
  // The batch's sequences, then one entry per shared group (split blocks only, no merge).
  std::vector<PagedSequencePlan> sequences;
  std::vector<PagedLaunch> launches;
};

// The position of a shared group's entry: its rows (n = the members' queries) sit at keys
// S - 1 .. S - 2 + n, so that each sees the S shared keys whole.
inline PagedSequenceDims PagedSharedGroupSequence(int64_t shared_keys, int64_t queries) {
  return {shared_keys - 1 + queries, queries};
}

// Empty when the kernels can run `dims` with at most `max_shared_bytes` of shared memory per
// block; otherwise what they cannot do, naming the field and the limit.
std::string PagedDecodeUnsupportedReason(const PagedDecodeDims& dims,
                                         const std::vector<PagedSequenceDims>& sequences,
                                         int64_t max_shared_bytes,
                                         const std::vector<PagedSharedGroupDims>& groups = {});

// Empty when `groups` are shared groups the kernels can run for `sequences`: each of at
// least 2 sequences, ascending, in no other group, every member's first query seeing the
// shared keys, a positive multiple of kCudaPagedSplitKeys, and no sliding window; otherwise
// what is wrong, naming the group and the values. (That the members' first blocks are the
// same and their queries contiguous is the caller's: the host cannot see device tables.)
std::string PagedSharedGroupsInvalidReason(const PagedDecodeDims& dims,
                                           const std::vector<PagedSequenceDims>& sequences,
                                           const std::vector<PagedSharedGroupDims>& groups);

// The plan of a batch that PagedDecodeUnsupportedReason accepts (and the CPU kernel's
// validation, which the caller runs first), with `groups` that
// PagedSharedGroupsInvalidReason accepts.
PagedDecodePlan PlanPagedDecode(const PagedDecodeDims& dims,
                                const std::vector<PagedSequenceDims>& sequences,
                                const std::vector<PagedSharedGroupDims>& groups = {});

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

// A merge block of one sequence: the output row (query i, head h as i * H + h), then the
// chunk of kCudaPagedMergeColumns columns, varying fastest.
struct PagedMergeBlock {
  int64_t out_row, column_chunk;
};
ATTENTION_HOST_DEVICE inline int64_t PagedMergeColumnChunks(int64_t value_dim) {
  return (value_dim + kCudaPagedMergeColumns - 1) / kCudaPagedMergeColumns;
}
ATTENTION_HOST_DEVICE inline PagedMergeBlock DecodePagedMergeBlock(int64_t block,
                                                                   int64_t value_dim) {
  const int64_t chunks = PagedMergeColumnChunks(value_dim);
  return {block / chunks, block % chunks};
}

// Floats of one row's state, and where a row's state is among a sequence's.
ATTENTION_HOST_DEVICE inline int64_t PagedStateFloats(int64_t value_dim) { return value_dim + 2; }
ATTENTION_HOST_DEVICE inline int64_t PagedStateIndex(int64_t kv_head, int64_t split, int64_t row,
                                                     int64_t run_splits, int64_t rows,
                                                     int64_t value_dim) {
  return ((kv_head * run_splits + split) * rows + row) * PagedStateFloats(value_dim);
}

// Where the merge finds split `split` (counted from the sequence's first split) of row `row`
// of a sequence: in the group entry's states for its shared splits, else in its own.
ATTENTION_HOST_DEVICE inline int64_t PagedMergeStateOffset(
    int64_t kv_head, int64_t split, int64_t row, int64_t rows, int64_t value_dim,
    int64_t state_offset, int64_t run_splits, int64_t shared_splits, int64_t shared_rows,
    int64_t shared_first_row, int64_t shared_state_offset) {
  if (split < shared_splits) {
    return shared_state_offset + PagedStateIndex(kv_head, split, shared_first_row + row,
                                                 shared_splits, shared_rows, value_dim);
  }
  return state_offset +
         PagedStateIndex(kv_head, split - shared_splits, row, run_splits, rows, value_dim);
}

// The split kernel's dynamic shared memory: every warp's key and value row offsets (two
// int64 per key), then every warp's per-row states to merge, [warps][rows][dv + 2] floats.
ATTENTION_HOST_DEVICE inline int64_t PagedSplitSharedBytes(int64_t value_dim) {
  return int64_t{kCudaPagedWarps} * kCudaPagedWarpKeys * 2 * 8 +
         int64_t{kCudaPagedWarps} * kCudaPagedRowsPerBlock * PagedStateFloats(value_dim) * 4;
}

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_PAGED_DECODE_PLAN_H_

// The paged decode kernels; see paged_decode_plan.h for the mapping of blocks, warps and
// lanes.
//
// Why the split kernel streams at the read roof: its warps never wait on each other before
// the end of the split, and each has a whole tile of keys and values in flight at a time:
// kUnroll steps of 32 / lanes keys, every lane loading 16 bytes of each key row and value
// row it covers (Llama-3-8B, float32: 4 steps * 1 key * 1 KiB of K and V = 4 KiB per warp;
// bfloat16: 4 steps * 2 keys * 512 bytes, the same). At 8 warps a block that is 32 KiB in
// flight per block, 64 KiB per SM at two blocks: by Little's law, at ~1 us of loaded DRAM
// latency, 32-64 GB/s per SM, against the 4.4-4.8 TB/s / 132 SMs = 34-36 GB/s each SM needs.
// The block-table look-ups are made once per key, up front, one key per lane. While a tile's
// loads wait, the warp also prefetches the next tile's rows into L2 (kPrefetchTiles), so that
// up to 2 tiles (8 KiB) per warp, 128 KiB per SM, are in flight from DRAM, 4 KiB of them
// through the whole tile (the compute included), and a tile's own loads mostly wait on L2
// rather than DRAM.
// Between tiles a warp computes, and nothing of its own is in flight, so the compute of a
// tile is kept short: the kRows * kUnroll dot products' shuffle reductions go one level at a
// time for all of them (their latencies overlap, rather than 5 shuffles waited on in turn per
// score), and no branch skips an expf (each would wait on the one before).
#include <cstdint>

#include "core/cuda/paged_decode_kernels.h"

namespace attention::core::cuda {
namespace {

constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kRows = kCudaPagedRowsPerBlock;
constexpr int kSplit = static_cast<int>(kCudaPagedSplitKeys);
constexpr int kWarps = kCudaPagedWarps;
constexpr int kWarpKeys = kCudaPagedWarpKeys;
constexpr int kDefaultSharedLimit = 48 << 10;
static_assert(kWarpKeys == 32, "one key of a warp's range per lane");

// The weight of a softmax state of max `max` in a merged state of max `merged` (>= max):
// exactly 1 when the max is unchanged (so states merge with nothing bitwise unchanged), and
// 0 for an empty state (max -inf) when the merged one is not empty. The test picks expf's
// argument rather than its result (expf(0) is exactly 1), so that no branch skips the expf:
// branches around expfs make them wait on one another.
__device__ inline float Weight(float max, float merged) {
  return expf(max == merged ? 0.0f : max - merged);
}

__device__ float WarpMax(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(kFullWarp, value, offset));
  }
  return value;
}

// The launch's sequence that block `block` belongs to: the last whose first block is at or
// before it. A sequence with no block of this kernel (a group entry's merge, a member whose
// splits are all shared) has the next one's first block, so it is never the last.
template <bool kMerge>
__device__ int FindSequence(const PagedDeviceLaunch& launch, int64_t block) {
  int low = 0, high = launch.count - 1;
  while (low < high) {
    const int middle = (low + high + 1) / 2;
    const PagedDeviceSequence& s = launch.sequences[middle];
    if ((kMerge ? s.merge_block_begin : s.split_block_begin) <= block) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  return low;
}

// N elements of a key or value row in one load of N * sizeof(Element) bytes, kept raw in
// registers until used (bfloat16 is the high half of a float32): Load, Zero (past the row's
// end), NaN (a block outside the storage), and At, element e as float32.
template <typename Element, int N>
struct Vec;
__device__ inline float Low(uint32_t word) { return __uint_as_float(word << 16); }
__device__ inline float High(uint32_t word) { return __uint_as_float(word & 0xffff0000u); }
template <>
struct Vec<float, 1> {
  using Raw = float;
  __device__ static Raw Load(const Raw* p) { return __ldg(p); }
  __device__ static Raw Zero() { return 0.0f; }
  __device__ static Raw NaN() { return __int_as_float(0x7fffffff); }
  __device__ static float At(const Raw& r, int) { return r; }
};
template <>
struct Vec<float, 4> {
  using Raw = float4;
  __device__ static Raw Load(const Raw* p) { return __ldg(p); }
  __device__ static Raw Zero() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
  __device__ static Raw NaN() {
    const float nan = __int_as_float(0x7fffffff);
    return make_float4(nan, nan, nan, nan);
  }
  __device__ static float At(const Raw& r, int e) {
    return e == 0 ? r.x : e == 1 ? r.y : e == 2 ? r.z : r.w;
  }
};
template <>
struct Vec<uint16_t, 1> {
  using Raw = uint16_t;
  __device__ static Raw Load(const Raw* p) { return __ldg(p); }
  __device__ static Raw Zero() { return 0; }
  __device__ static Raw NaN() { return 0x7fc0; }
  __device__ static float At(const Raw& r, int) { return Low(r); }
};
template <>
struct Vec<uint16_t, 8> {
  using Raw = uint4;
  __device__ static Raw Load(const Raw* p) { return __ldg(p); }
  __device__ static Raw Zero() { return make_uint4(0, 0, 0, 0); }
  __device__ static Raw NaN() { return make_uint4(0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0); }
  __device__ static float At(const Raw& r, int e) {
    const uint32_t word = e < 2 ? r.x : e < 4 ? r.y : e < 6 ? r.z : r.w;
    return e % 2 == 0 ? Low(word) : High(word);
  }
};

// Tiles a warp prefetches into L2 ahead of the one it loads (see PagedSplitKernel).
constexpr int kPrefetchTiles = 1;

__device__ inline void PrefetchL2(const void* address) {
  asm volatile("prefetch.L2 [%0];" : : "l"(address));
}

// Blocks per SM the split kernel is compiled for: two (at most 128 registers a thread) where
// each lane holds one 16-byte vector of a row, or four scalars; else one.
template <typename Element, int kVec, int kChunks>
constexpr int MinSplitBlocks() {
  return kChunks * kVec * static_cast<int>(sizeof(Element)) <= 16 ? 2 : 1;
}

// One (sequence, KV head, split, chunk of rows): see paged_decode_plan.h. kVec and kChunks
// are PagedDecodePlan::vector and chunks; `lanes` is PagedDecodePlan::lanes.
template <typename Element, int kVec, int kChunks>
__global__ void __launch_bounds__(kCudaPagedThreads, MinSplitBlocks<Element, kVec, kChunks>())
    PagedSplitKernel(const __grid_constant__ PagedDeviceLaunch launch, int lanes) {
  using V = Vec<Element, kVec>;
  using Raw = typename V::Raw;
  // Steps per tile: up to 16 registers of raw keys (and as many of values) per lane.
  constexpr int kWords = kChunks * static_cast<int>(sizeof(Raw) >= 4 ? sizeof(Raw) / 4 : 1);
  constexpr int kUnroll = kWords >= 16 ? 1 : (16 / kWords > 4 ? 4 : 16 / kWords);

  extern __shared__ __align__(16) unsigned char shared[];
  // [warps][32]: the byte offsets in the storage of each warp key's K row and V row (of this
  // KV head), -1 for a block outside the storage.
  long long* key_offsets = reinterpret_cast<long long*>(shared);
  long long* value_offsets = key_offsets + kWarps * kWarpKeys;
  // [warps][kRows][dv + 2]: each warp's states, to merge in warp order.
  float* warp_states = reinterpret_cast<float*>(value_offsets + kWarps * kWarpKeys);

  const int dk = launch.key_dim, dv = launch.value_dim;
  const int key_vectors = dk / kVec, value_vectors = dv / kVec;  // exact: see Plan::vector
  const int64_t block = blockIdx.x;
  const PagedDeviceSequence& sequence = launch.sequences[FindSequence<false>(launch, block)];
  const PagedSplitBlock work = DecodePagedSplitBlock(block - sequence.split_block_begin,
                                                     sequence.run_splits, sequence.row_chunks);
  const int kv_head = static_cast<int>(work.kv_head);
  const int group = launch.num_heads / launch.num_kv_heads;
  const int first_row = static_cast<int>(work.row_chunk) * kRows;
  const int rows = min(kRows, sequence.rows - first_row);
  const int n = sequence.num_queries, length = sequence.length;
  const int window = launch.sliding_window;
  // Keys are below length < 2^31; ends of key ranges may be 2^31, so they are int64.
  const int split_begin = (sequence.first_split + static_cast<int>(work.split)) * kSplit;

  // Bottom-right causal: row r's query, at position length - n + i, sees [first_key, position]
  // (rows past the chunk's end see nothing). The block reads the keys any of its rows sees.
  int position[kRows], first_key[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    position[r] = r < rows ? length - n + (first_row + r) / group : -1;
    first_key[r] = r < rows ? static_cast<int>(PagedFirstVisibleKey(position[r], window)) : 0;
  }
  const int key_begin = max(split_begin, first_key[0]);
  const int64_t key_end =
      min(int64_t{split_begin} + kSplit, int64_t{length} - n + (first_row + rows - 1) / group + 1);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_begin = split_begin + warp * kWarpKeys;
  // Lane `lane` looks up key warp_begin + lane.
  {
    const int key = warp_begin + lane;
    long long key_offset = -1, value_offset = -1;
    if (key >= key_begin && key < key_end) {
      const int tokens = launch.tokens_per_block;
      const int32_t id = __ldg(sequence.block_table + key / tokens);
      if (id >= 0 && id < launch.num_blocks) {
        const int64_t slot = key % tokens;
        const int64_t base = int64_t{id} * launch.block_bytes;
        const int64_t element = sizeof(Element);
        key_offset = base + (int64_t{kv_head} * tokens + slot) * dk * element;
        value_offset = base + (int64_t{tokens} * launch.num_kv_heads * dk +
                               (int64_t{kv_head} * tokens + slot) * dv) *
                                  element;
      }
    }
    key_offsets[warp * kWarpKeys + lane] = key_offset;
    value_offsets[warp * kWarpKeys + lane] = value_offset;
  }

  // Lanes: key group `key_group` takes key warp_begin + step * groups + key_group at each
  // step; lane `sub` of it holds vectors sub, sub + lanes, ... of the key, value and query
  // rows, chunk c being vector c * lanes + sub.
  const int key_group = lane / lanes, sub = lane % lanes;
  const int groups = 32 / lanes;
  const int steps = kWarpKeys / groups;
  float query[kRows][kChunks][kVec];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = first_row + r;
    const int64_t head = int64_t{kv_head} * group + row % group;
    const float* q = sequence.query + (int64_t{row / group} * launch.num_heads + head) * dk;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int vector = c * lanes + sub;
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        query[r][c][e] = r < rows && vector < key_vectors ? q[vector * kVec + e] : 0.0f;
      }
    }
  }
  // Each key group's online softmax state per row: max, sum of exps, weighted values.
  float row_max[kRows], row_sum[kRows], acc[kRows][kChunks][kVec];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[r][c][e] = 0.0f;
    }
  }
  __syncwarp();  // the offsets

  const char* storage = static_cast<const char*>(launch.storage);
  for (int tile = 0; tile < steps; tile += kUnroll) {
    // Tiles are fixed in absolute keys; one with none of the block's keys changes no state.
    const int64_t tile_begin = int64_t{warp_begin} + int64_t{tile} * groups;
    const int64_t tile_end = int64_t{warp_begin} + int64_t{min(tile + kUnroll, steps)} * groups;
    if (tile_end <= key_begin || tile_begin >= key_end) continue;  // uniform in the warp

    // Every load of the tile first.
    int key[kUnroll];
    bool live[kUnroll];
    Raw k[kUnroll][kChunks], v[kUnroll][kChunks];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int step = tile + u;
      const int index = step < steps ? step * groups + key_group : 0;
      key[u] = warp_begin + index;
      live[u] = step < steps && key[u] >= key_begin && key[u] < key_end;
      const long long key_offset = live[u] ? key_offsets[warp * kWarpKeys + index] : 0;
      const long long value_offset = live[u] ? value_offsets[warp * kWarpKeys + index] : 0;
      const Raw* key_row = reinterpret_cast<const Raw*>(storage + max(key_offset, 0ll));
      const Raw* value_row = reinterpret_cast<const Raw*>(storage + max(value_offset, 0ll));
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int vector = c * lanes + sub;
        k[u][c] = !live[u] || vector >= key_vectors ? V::Zero()
                  : key_offset < 0                  ? V::NaN()
                                                    : V::Load(key_row + vector);
        v[u][c] = !live[u] || vector >= value_vectors ? V::Zero()
                  : value_offset < 0                  ? V::NaN()
                                                      : V::Load(value_row + vector);
      }
    }

    // The next kPrefetchTiles tiles' rows, into L2 while this one waits and computes (a hint
    // that holds no register and changes no result): its loads then find them there, and
    // the warp has the next tile's bytes in flight from DRAM as well as this one's.
#pragma unroll
    for (int ahead = 1; ahead <= kPrefetchTiles; ++ahead) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int step = tile + ahead * kUnroll + u;
        const int index = step * groups + key_group;
        const int next_key = warp_begin + index;
        if (step >= steps || next_key < key_begin || next_key >= key_end) continue;
        const long long key_offset = key_offsets[warp * kWarpKeys + index];
        const long long value_offset = value_offsets[warp * kWarpKeys + index];
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int vector = c * lanes + sub;
          if (key_offset >= 0 && vector < key_vectors) {
            PrefetchL2(reinterpret_cast<const Raw*>(storage + key_offset) + vector);
          }
          if (value_offset >= 0 && vector < value_vectors) {
            PrefetchL2(reinterpret_cast<const Raw*>(storage + value_offset) + vector);
          }
        }
      }
    }

    // Scores: each lane's part of the dot products, added over the key group's lanes (offsets
    // lanes / 2, ..., 1), one level of shuffles at a time for all kRows * kUnroll of them, so
    // that their latencies overlap (a loop per score would wait on each shuffle in turn).
    float score[kRows][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float partial = 0.0f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) partial = fmaf(query[r][c][e], V::At(k[u][c], e), partial);
        }
        score[r][u] = partial;
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      if (offset >= lanes) continue;  // uniform in the warp
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          score[r][u] += __shfl_xor_sync(kFullWarp, score[r][u], offset);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) score[r][u] *= launch.scale;
    }

    // The online softmax over the tile's keys that each row sees.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      bool seen[kUnroll];
      float tile_max = -INFINITY;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        seen[u] = live[u] && key[u] <= position[r] && key[u] >= first_key[r];
        if (seen[u]) tile_max = fmaxf(tile_max, score[r][u]);
      }
      const float new_max = fmaxf(row_max[r], tile_max);
      const float rescale = Weight(row_max[r], new_max);
      row_sum[r] *= rescale;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[r][c][e] *= rescale;
      }
      // Every key's exp first, without branches (those of keys the row does not see are
      // dropped), so that they overlap; then the sums, in key order. A score of -inf weighs
      // expf(-inf) = 0, also when new_max is -inf.
      float p[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        p[u] = expf(score[r][u] == -INFINITY ? -INFINITY : score[r][u] - new_max);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        // Adding +0 leaves the sum as it was (it is never -0), and keeps the expf out of a
        // branch; the values are picked (a value the row does not see may be NaN).
        row_sum[r] += seen[u] ? p[u] : 0.0f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const float added = fmaf(p[u], V::At(v[u][c], e), acc[r][c][e]);
            acc[r][c][e] = seen[u] ? added : acc[r][c][e];
          }
        }
      }
      row_max[r] = new_max;
    }
  }

  // The warp's key groups, merged by shuffles (lanes of one sub across groups).
  for (int offset = lanes; offset < 32; offset <<= 1) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float other_max = __shfl_xor_sync(kFullWarp, row_max[r], offset);
      const float other_sum = __shfl_xor_sync(kFullWarp, row_sum[r], offset);
      const float new_max = fmaxf(row_max[r], other_max);
      const float mine = Weight(row_max[r], new_max), theirs = Weight(other_max, new_max);
      row_sum[r] = row_sum[r] * mine + other_sum * theirs;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const float other = __shfl_xor_sync(kFullWarp, acc[r][c][e], offset);
          acc[r][c][e] = acc[r][c][e] * mine + other * theirs;
        }
      }
      row_max[r] = new_max;
    }
  }
  const int state_floats = dv + 2;
  if (key_group == 0) {
    float* state = warp_states + warp * kRows * state_floats;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (sub == 0) {
        state[r * state_floats] = row_max[r];
        state[r * state_floats + 1] = row_sum[r];
      }
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int vector = c * lanes + sub;
        if (vector >= value_vectors) continue;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          state[r * state_floats + 2 + vector * kVec + e] = acc[r][c][e];
        }
      }
    }
  }
  __syncthreads();

  // The warps' states, merged in warp order: the block's state per row.
  float* states = launch.states + sequence.state_offset;
  for (int e = threadIdx.x; e < rows * dv; e += kCudaPagedThreads) {
    const int r = e / dv, column = e % dv;
    float new_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      new_max = fmaxf(new_max, warp_states[(w * kRows + r) * state_floats]);
    }
    float sum = 0.0f, total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float* state = warp_states + (w * kRows + r) * state_floats;
      const float weight = Weight(state[0], new_max);
      sum += state[1] * weight;
      total += state[2 + column] * weight;
    }
    float* out = states + PagedStateIndex(kv_head, work.split, first_row + r, sequence.run_splits,
                                          sequence.rows, dv);
    out[2 + column] = total;
    if (column == 0) {
      out[0] = new_max;
      out[1] = sum;
    }
  }
}

// One (output row, chunk of kCudaPagedMergeColumns columns) per block: warp p adds splits
// p, p + kCudaPagedMergeParts, ... of its lane's column, then the parts add up in part order.
// Split states of no key (max -inf, sum 0) weigh 0.
__global__ void __launch_bounds__(kCudaPagedMergeThreads)
    PagedMergeKernel(const __grid_constant__ PagedDeviceLaunch launch) {
  constexpr int kParts = kCudaPagedMergeParts, kColumns = kCudaPagedMergeColumns;
  static_assert(kColumns == 32, "one column per lane");
  __shared__ float part_max[kParts], part_sum[kParts], part_total[kParts][kColumns];
  const int64_t block = blockIdx.x;
  const PagedDeviceSequence& sequence = launch.sequences[FindSequence<true>(launch, block)];
  const int heads = launch.num_heads, dv = launch.value_dim;
  const PagedMergeBlock work = DecodePagedMergeBlock(block - sequence.merge_block_begin, dv);
  const int group = heads / launch.num_kv_heads;
  const int i = static_cast<int>(work.out_row / heads), h = static_cast<int>(work.out_row % heads);
  const int kv_head = h / group, row = i * group + h % group;
  const int part = threadIdx.x / 32, lane = threadIdx.x % 32;
  // A group's member: its shared splits first (the group entry's states), then its own.
  const int splits = sequence.shared_splits + sequence.run_splits;
  const auto state_of = [&](int split) {
    return launch.states +
           PagedMergeStateOffset(kv_head, split, row, sequence.rows, dv, sequence.state_offset,
                                 sequence.run_splits, sequence.shared_splits, sequence.shared_rows,
                                 sequence.shared_first_row, sequence.shared_state_offset);
  };

  float row_max = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += kCudaPagedMergeThreads) {
    row_max = fmaxf(row_max, state_of(s)[0]);
  }
  row_max = WarpMax(row_max);
  if (lane == 0) part_max[part] = row_max;
  __syncthreads();
#pragma unroll
  for (int p = 0; p < kParts; ++p) row_max = fmaxf(row_max, part_max[p]);

  const int column = static_cast<int>(work.column_chunk) * kColumns + lane;
  float sum = 0.0f, total = 0.0f;  // the sums are the same in every lane of the warp
#pragma unroll 8
  for (int s = part; s < splits; s += kParts) {
    const float* state = state_of(s);
    const float weight = Weight(state[0], row_max);
    sum += state[1] * weight;
    if (column < dv) total += state[2 + column] * weight;
  }
  if (lane == 0) part_sum[part] = sum;
  part_total[part][lane] = total;
  __syncthreads();
  if (part != 0 || column >= dv) return;
  sum = 0.0f, total = 0.0f;
#pragma unroll
  for (int p = 0; p < kParts; ++p) {
    sum += part_sum[p];
    total += part_total[p][lane];
  }
  sequence.output[work.out_row * dv + column] = total / sum;
  if (sequence.log_sum_exp != nullptr && column == 0) {
    sequence.log_sum_exp[work.out_row] = row_max + logf(sum);
  }
}

template <typename Element, int kVec, int kChunks>
cudaError_t LaunchSplit(const PagedDeviceLaunch& launch, const PagedDecodePlan& plan,
                        const PagedLaunch& blocks, cudaStream_t stream) {
  const auto kernel = PagedSplitKernel<Element, kVec, kChunks>;
  if (plan.shared_bytes > kDefaultSharedLimit) {
    const cudaError_t raised = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.shared_bytes));
    if (raised != cudaSuccess) return raised;
  }
  kernel<<<static_cast<unsigned>(blocks.split_blocks), kCudaPagedThreads,
           static_cast<size_t>(plan.shared_bytes), stream>>>(launch, plan.lanes);
  return cudaGetLastError();
}

// The kernels built: see PagedDecodePlan::chunks.
template <typename Element, int kVectorElements>
cudaError_t LaunchSplitOf(const PagedDeviceLaunch& launch, const PagedDecodePlan& plan,
                          const PagedLaunch& blocks, cudaStream_t stream) {
  constexpr bool kFloat = sizeof(Element) == 4;
  if (plan.vector == 1) {
    switch (plan.chunks) {
      case 4:
        return LaunchSplit<Element, 1, 4>(launch, plan, blocks, stream);
      case 16:
        return LaunchSplit<Element, 1, 16>(launch, plan, blocks, stream);
      default:
        return cudaErrorInvalidValue;
    }
  }
  switch (plan.chunks) {
    case 1:
      return LaunchSplit<Element, kVectorElements, 1>(launch, plan, blocks, stream);
    case kFloat ? 4:
      2 : return LaunchSplit < Element, kVectorElements,
          kFloat ? 4 : 2 > (launch, plan, blocks, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchPagedSplits(const PagedDeviceLaunch& launch, const PagedDecodePlan& plan,
                              const PagedLaunch& blocks, cudaStream_t stream) {
  if (blocks.split_blocks == 0) return cudaSuccess;  // every split shared (a grid of 0 fails)
  return launch.bfloat16 ? LaunchSplitOf<uint16_t, 8>(launch, plan, blocks, stream)
                         : LaunchSplitOf<float, 4>(launch, plan, blocks, stream);
}

cudaError_t LaunchPagedMerge(const PagedDeviceLaunch& launch, const PagedLaunch& blocks,
                             cudaStream_t stream) {
  if (blocks.merge_blocks == 0) return cudaSuccess;  // group entries only
  PagedMergeKernel<<<static_cast<unsigned>(blocks.merge_blocks), kCudaPagedMergeThreads, 0,
                     stream>>>(launch);
  return cudaGetLastError();
}

}  // namespace attention::core::cuda

// The paged decode kernels; see paged_decode_plan.h for the mapping of blocks and warps.
#include <cstdint>

#include "core/cuda/paged_decode_kernels.h"

namespace attention::core::cuda {
namespace {

constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kRows = kCudaPagedRowsPerBlock;
constexpr int kSplit = static_cast<int>(kCudaPagedSplitKeys);
constexpr int kKeyLanes = kCudaPagedKeyLanes;
constexpr int kKeyGroups = kCudaPagedThreads / kKeyLanes;
constexpr int kDefaultSharedLimit = 48 << 10;

__device__ float WarpMax(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = fmaxf(value, __shfl_xor_sync(kFullWarp, value, offset));
  }
  return value;
}

__device__ float WarpSum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    value += __shfl_xor_sync(kFullWarp, value, offset);
  }
  return value;
}

// The launch's sequence that block `block` belongs to: the last whose first block is at or
// before it (every sequence has at least one block of each kernel).
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

// N elements at `source` as float32, in one load of N * sizeof(Element) bytes (bfloat16 is
// the high half of a float32). The bytes are read once per block: through the read-only
// path, not kept in L1 beyond it.
template <typename Element, int N>
struct Widen;
template <>
struct Widen<float, 1> {
  __device__ static void Load(const float* source, float* out) { out[0] = __ldg(source); }
};
template <>
struct Widen<float, 4> {
  __device__ static void Load(const float* source, float* out) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(source));
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
};
__device__ inline float Low(uint32_t word) { return __uint_as_float(word << 16); }
__device__ inline float High(uint32_t word) { return __uint_as_float(word & 0xffff0000u); }
template <>
struct Widen<uint16_t, 1> {
  __device__ static void Load(const uint16_t* source, float* out) { out[0] = Low(__ldg(source)); }
};
template <>
struct Widen<uint16_t, 4> {
  __device__ static void Load(const uint16_t* source, float* out) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(source));
    out[0] = Low(v.x), out[1] = High(v.x), out[2] = Low(v.y), out[3] = High(v.y);
  }
};
template <>
struct Widen<uint16_t, 8> {
  __device__ static void Load(const uint16_t* source, float* out) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(source));
    out[0] = Low(v.x), out[1] = High(v.x), out[2] = Low(v.y), out[3] = High(v.y);
    out[4] = Low(v.z), out[5] = High(v.z), out[6] = Low(v.w), out[7] = High(v.w);
  }
};

// As Widen, but NaN from a block that is not in the storage (see LaunchPagedDecode).
template <typename Element, int N>
__device__ void LoadOrNaN(const Element* source, float* out) {
  if (source != nullptr) {
    Widen<Element, N>::Load(source, out);
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = __int_as_float(0x7fffffff);
  }
}

// Where key `key`'s keys (or values) of `kv_head` start: block_table[key / tokens_per_block],
// laid out as kv_cache::KeyOffset and ValueOffset; null for a block id outside the storage.
template <typename Element, bool kValue>
__device__ const Element* KvRow(const PagedDeviceLaunch& launch, const int32_t* block_table,
                                int32_t key, int32_t kv_head) {
  const int32_t block = __ldg(block_table + key / launch.tokens_per_block);
  if (block < 0 || block >= launch.num_blocks) return nullptr;
  const int64_t slot = key % launch.tokens_per_block;
  const int64_t tokens = launch.tokens_per_block;
  const int64_t offset = kValue ? tokens * launch.num_kv_heads * launch.key_dim +
                                      (kv_head * tokens + slot) * launch.value_dim
                                : (kv_head * tokens + slot) * launch.key_dim;
  return reinterpret_cast<const Element*>(static_cast<const char*>(launch.storage) +
                                          block * launch.block_bytes) +
         offset;
}

// One (sequence, KV head, split, chunk of rows): see paged_decode_plan.h. kKeyVector and
// kValueVector are the elements per load (PagedDecodePlan::key_vector, value_vector).
template <typename Element, int kKeyVector, int kValueVector>
__global__ void __launch_bounds__(kCudaPagedThreads)
    PagedSplitKernel(const __grid_constant__ PagedDeviceLaunch launch, int value_lanes) {
  extern __shared__ float shared[];
  const int dk = launch.key_dim, dv = launch.value_dim;
  float* queries = shared;                // [kRows][dk]
  float* scores = queries + kRows * dk;   // [kRows][kSplit]: scores, then their exps
  float* sums = scores + kRows * kSplit;  // [key groups][kRows][value_lanes * kValueVector]

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
  const int split_begin = (sequence.first_split + static_cast<int>(work.split)) * kSplit;

  // Bottom-right causal: row r's query, at position length - n + i, sees [lo, position].
  // The block reads the keys any of its rows sees.
  const int first_position = length - n + first_row / group;
  const int last_position = length - n + (first_row + rows - 1) / group;
  const int key_begin =
      max(split_begin, static_cast<int>(PagedFirstVisibleKey(first_position, window)));
  const int key_end = min(split_begin + kSplit, last_position + 1);

  for (int e = threadIdx.x; e < kRows * dk; e += blockDim.x) {
    const int r = e / dk, c = e % dk;
    float q = 0.0f;
    if (r < rows) {
      const int row = first_row + r;
      const int64_t head = kv_head * group + row % group;
      q = sequence.query[(static_cast<int64_t>(row / group) * launch.num_heads + head) * dk + c];
    }
    queries[e] = q;
  }
  for (int e = threadIdx.x; e < kRows * kSplit; e += blockDim.x) scores[e] = -INFINITY;
  __syncthreads();

  // Scores: groups of kKeyLanes lanes per key, key k of the split to group k % kKeyGroups
  // (a uniform trip count: the shuffles need every lane of the warp).
  {
    const int lane = threadIdx.x % kKeyLanes, key_group = threadIdx.x / kKeyLanes;
    const int key_vectors = dk / kKeyVector;  // exact: see PagedDecodePlan::key_vector
    for (int offset = key_group; offset < kSplit; offset += kKeyGroups) {
      const int key = split_begin + offset;
      const bool active = key >= key_begin && key < key_end;
      float partial[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) partial[r] = 0.0f;
      if (active) {
        const Element* k = KvRow<Element, false>(launch, sequence.block_table, key, kv_head);
#pragma unroll 2
        for (int v = lane; v < key_vectors; v += kKeyLanes) {
          float x[kKeyVector];
          LoadOrNaN<Element, kKeyVector>(k == nullptr ? nullptr : k + v * kKeyVector, x);
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (r >= rows) break;
            const float* q = queries + r * dk + v * kKeyVector;
#pragma unroll
            for (int e = 0; e < kKeyVector; ++e) partial[r] = fmaf(q[e], x[e], partial[r]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        for (int o = kKeyLanes / 2; o > 0; o >>= 1) {
          partial[r] += __shfl_xor_sync(kFullWarp, partial[r], o);
        }
      }
      if (active && lane < rows) {  // lane r writes row r's score, if row r sees the key
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r != lane) continue;
          const int position = length - n + (first_row + r) / group;
          if (key <= position && key >= PagedFirstVisibleKey(position, window)) {
            scores[r * kSplit + offset] = partial[r] * launch.scale;
          }
        }
      }
    }
  }
  __syncthreads();

  // Each row's softmax over the split: one warp per row. A row that sees none of the split's
  // keys keeps max -inf and sum 0, which the merge skips.
  const int64_t states = sequence.state_offset;
  const auto state_of = [&](int r) {
    return launch.states + states +
           PagedStateIndex(kv_head, work.split, first_row + r, sequence.run_splits, sequence.rows,
                           dv);
  };
  {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int r = warp; r < rows; r += kCudaPagedThreads / 32) {
      float* row_scores = scores + r * kSplit;
      float row_max = -INFINITY;
      for (int j = lane; j < kSplit; j += 32) row_max = fmaxf(row_max, row_scores[j]);
      row_max = WarpMax(row_max);
      float sum = 0.0f;
      for (int j = lane; j < kSplit; j += 32) {
        const float p = row_scores[j] == -INFINITY ? 0.0f : expf(row_scores[j] - row_max);
        row_scores[j] = p;
        sum += p;
      }
      sum = WarpSum(sum);
      if (lane == 0) {
        float* state = state_of(r);
        state[0] = row_max;
        state[1] = sum;
      }
    }
  }
  __syncthreads();

  // Values: value_lanes lanes across a key's columns, kValueVector each; the block's key
  // groups take keys k % groups, then add their sums in group order. Wider rows take passes.
  const int value_vectors = (dv + kValueVector - 1) / kValueVector;
  const int lane = threadIdx.x % value_lanes, key_group = threadIdx.x / value_lanes;
  const int groups = kCudaPagedThreads / value_lanes;
  const int width = value_lanes * kValueVector;  // columns per pass
  for (int pass = 0; pass < value_vectors; pass += value_lanes) {
    const int vector = pass + lane;
    float acc[kRows][kValueVector];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int e = 0; e < kValueVector; ++e) acc[r][e] = 0.0f;
    }
    if (vector < value_vectors) {
#pragma unroll 4
      for (int offset = key_group; offset < kSplit; offset += groups) {
        const int key = split_begin + offset;
        if (key < key_begin || key >= key_end) continue;
        const Element* v = KvRow<Element, true>(launch, sequence.block_table, key, kv_head);
        float x[kValueVector];
        LoadOrNaN<Element, kValueVector>(v == nullptr ? nullptr : v + vector * kValueVector, x);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r >= rows) break;
          const float p = scores[r * kSplit + offset];
#pragma unroll
          for (int e = 0; e < kValueVector; ++e) acc[r][e] = fmaf(p, x[e], acc[r][e]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int e = 0; e < kValueVector; ++e) {
        sums[(key_group * kRows + r) * width + lane * kValueVector + e] = acc[r][e];
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rows * width; e += blockDim.x) {
      const int r = e / width, column = pass * kValueVector + e % width;
      if (column >= dv) continue;
      float total = 0.0f;
      for (int g = 0; g < groups; ++g) total += sums[(g * kRows + r) * width + e % width];
      state_of(r)[2 + column] = total;
    }
    __syncthreads();  // before the next pass writes `sums`
  }
}

// One output row (query i, head h) per warp: the row's split states folded in split order,
// as the CPU kernel's MergeSplits.
__global__ void __launch_bounds__(kCudaPagedThreads)
    PagedMergeKernel(const __grid_constant__ PagedDeviceLaunch launch) {
  const int64_t block = blockIdx.x;
  const PagedDeviceSequence& sequence = launch.sequences[FindSequence<true>(launch, block)];
  const int64_t out_row =
      (block - sequence.merge_block_begin) * kCudaPagedMergeRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int heads = launch.num_heads, dv = launch.value_dim;
  if (out_row >= static_cast<int64_t>(sequence.num_queries) * heads) return;
  const int group = heads / launch.num_kv_heads;
  const int i = static_cast<int>(out_row / heads), h = static_cast<int>(out_row % heads);
  const int kv_head = h / group, row = i * group + h % group;
  const float* states = launch.states + sequence.state_offset;
  const auto state_of = [&](int split) {
    return states + PagedStateIndex(kv_head, split, row, sequence.run_splits, sequence.rows, dv);
  };
  float row_max = -INFINITY;
  for (int s = 0; s < sequence.run_splits; ++s) {
    const float* state = state_of(s);
    if (state[1] != 0.0f) row_max = fmaxf(row_max, state[0]);  // a sum of 0: the split saw no key
  }
  float sum = 0.0f;
  for (int s = 0; s < sequence.run_splits; ++s) {
    const float* state = state_of(s);
    if (state[1] != 0.0f) sum += state[1] * expf(state[0] - row_max);
  }
  float* out = sequence.output + out_row * dv;
  for (int c = lane; c < dv; c += 32) {
    float total = 0.0f;
#pragma unroll 4
    for (int s = 0; s < sequence.run_splits; ++s) {
      const float* state = state_of(s);
      if (state[1] != 0.0f) total += state[2 + c] * expf(state[0] - row_max);
    }
    out[c] = total / sum;
  }
  if (sequence.log_sum_exp != nullptr && lane == 0) {
    sequence.log_sum_exp[out_row] = row_max + logf(sum);
  }
}

template <typename Element, int kKeyVector, int kValueVector>
cudaError_t LaunchSplit(const PagedDeviceLaunch& launch, const PagedDecodePlan& plan,
                        const PagedLaunch& blocks, cudaStream_t stream) {
  const auto kernel = PagedSplitKernel<Element, kKeyVector, kValueVector>;
  if (plan.shared_bytes > kDefaultSharedLimit) {
    const cudaError_t raised = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.shared_bytes));
    if (raised != cudaSuccess) return raised;
  }
  kernel<<<static_cast<unsigned>(blocks.split_blocks), kCudaPagedThreads,
           static_cast<size_t>(plan.shared_bytes), stream>>>(launch, plan.value_lanes);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchPagedDecode(const PagedDeviceLaunch& launch, const PagedDecodePlan& plan,
                              const PagedLaunch& blocks, cudaStream_t stream) {
  const bool vector = plan.key_vector > 1;
  cudaError_t error = cudaSuccess;
  if (launch.bfloat16) {
    error = vector ? LaunchSplit<uint16_t, 8, 4>(launch, plan, blocks, stream)
                   : LaunchSplit<uint16_t, 1, 1>(launch, plan, blocks, stream);
  } else {
    error = vector ? LaunchSplit<float, 4, 4>(launch, plan, blocks, stream)
                   : LaunchSplit<float, 1, 1>(launch, plan, blocks, stream);
  }
  if (error != cudaSuccess) return error;
  PagedMergeKernel<<<static_cast<unsigned>(blocks.merge_blocks), kCudaPagedThreads, 0, stream>>>(
      launch);
  return cudaGetLastError();
}

}  // namespace attention::core::cuda

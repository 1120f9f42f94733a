#include "core/cuda/kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include "core/half_bits.h"

namespace attention::core::cuda {
namespace {

constexpr unsigned kFullWarp = 0xffffffffu;

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

__device__ int64_t Offset(const DeviceLayout& layout, int64_t b, int64_t h, int64_t i) {
  return b * layout.batch_stride + h * layout.head_stride + i * layout.row_stride;
}

// Scaled score of one query row against one key, plus its element masks; the dot product in
// channel order, so the weights kernel recomputes exactly the value the flash kernel used.
__device__ float MaskedScore(const DeviceAttentionProblem& p, const float* query_row,
                             const float* key_row, int64_t b, int64_t h, int64_t i, int64_t j) {
  float dot = 0.0f;
  for (int64_t c = 0; c < p.shape.head_dim; ++c) dot = fmaf(query_row[c], key_row[c], dot);
  float score = dot * p.scale;
  if (p.mask.HasElementMasks()) score += p.mask.ScoreBias(b, h, i, j);
  return score;
}

// Dropout of one probability, as the CPU backend: kept ones scaled by 1 / (1 - p).
__device__ float DropOut(const DeviceAttentionProblem& p, float probability, int64_t b,
                         int64_t h, int64_t i, int64_t j) {
  if (p.dropout_p <= 0.0f || probability == 0.0f) return probability;
  return DropoutKeeps(p.dropout_seed, p.dropout_p, b, h, i, j)
             ? probability / (1.0f - p.dropout_p)
             : 0.0f;
}

// See launch_plan.h for the tiling. kValueChunks = output columns per lane per row / 32.
template <int kValueChunks>
__global__ void __launch_bounds__(kFlashWarps * 32)
    FlashAttentionKernel(DeviceAttentionProblem p, int64_t query_blocks) {
  extern __shared__ float shared[];
  const AttentionShape& s = p.shape;
  const int64_t dk = s.head_dim, dv = s.v_head_dim;
  float* q_tile = shared;                                 // [rows][dk]
  float* k_tile = q_tile + kFlashRowsPerBlock * dk;       // [keys][dk + 1]
  float* v_tile = k_tile + kFlashKeysPerTile * (dk + 1);  // [keys][dv]
  const FlashBlock block = DecodeFlashBlock(blockIdx.x, query_blocks, s.num_heads);
  const int64_t b = block.batch_index, h = block.head, first_row = block.first_row;
  const int64_t hk = h / (s.num_heads / s.num_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rows = min(static_cast<int64_t>(kFlashRowsPerBlock), s.q_len - first_row);

  for (int64_t e = threadIdx.x; e < kFlashRowsPerBlock * dk; e += blockDim.x) {
    const int64_t r = e / dk, c = e % dk;
    q_tile[e] = r < rows ? p.query[Offset(p.query_layout, b, h, first_row + r) + c] : 0.0f;
  }
  // Keys past the last row's frontier are never attended: causal tiles are skipped.
  const int64_t key_count = p.mask.KeyLimit(b, first_row + rows - 1);

  float accumulator[kFlashRowsPerWarp][kValueChunks];
  OnlineSoftmaxRow softmax[kFlashRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kFlashRowsPerWarp; ++r) {
#pragma unroll
    for (int t = 0; t < kValueChunks; ++t) accumulator[r][t] = 0.0f;
  }

  for (int64_t first_key = 0; first_key < key_count; first_key += kFlashKeysPerTile) {
    __syncthreads();  // the Q rows are in, and every warp is done with the previous tile
    const int64_t keys = min(static_cast<int64_t>(kFlashKeysPerTile), key_count - first_key);
    for (int64_t e = threadIdx.x; e < kFlashKeysPerTile * dk; e += blockDim.x) {
      const int64_t j = e / dk, c = e % dk;
      k_tile[j * (dk + 1) + c] =
          j < keys ? p.key[Offset(p.key_layout, b, hk, first_key + j) + c] : 0.0f;
    }
    for (int64_t e = threadIdx.x; e < kFlashKeysPerTile * dv; e += blockDim.x) {
      const int64_t j = e / dv, c = e % dv;
      v_tile[e] = j < keys ? p.value[Offset(p.value_layout, b, hk, first_key + j) + c] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kFlashRowsPerWarp; ++r) {
      const int64_t row = warp * kFlashRowsPerWarp + r;
      const int64_t i = first_row + row;
      const int64_t j = first_key + lane;
      float score = -INFINITY;
      if (row < rows && lane < keys && j < p.mask.KeyLimit(b, i)) {
        score = MaskedScore(p, q_tile + row * dk, k_tile + lane * (dk + 1), b, h, i, j);
      }
      const float correction = softmax[r].Rescale(WarpMax(score));
      float probability = score == -INFINITY ? 0.0f : expf(score - softmax[r].max);
      softmax[r].sum += WarpSum(probability);  // the sum before dropout normalizes
      probability = DropOut(p, probability, b, h, i, j);
#pragma unroll
      for (int t = 0; t < kValueChunks; ++t) accumulator[r][t] *= correction;
      for (int64_t jj = 0; jj < keys; ++jj) {
        const float p_j = __shfl_sync(kFullWarp, probability, static_cast<int>(jj));
#pragma unroll
        for (int t = 0; t < kValueChunks; ++t) {
          const int64_t c = lane + 32 * t;
          if (c < dv) accumulator[r][t] = fmaf(p_j, v_tile[jj * dv + c], accumulator[r][t]);
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kFlashRowsPerWarp; ++r) {
    const int64_t row = warp * kFlashRowsPerWarp + r;
    if (row >= rows) continue;
    const int64_t i = first_row + row;
    // A fully masked row has sum 0 and an all-zero accumulator: it stays zeros.
    const float inverse_sum = softmax[r].InverseSum();
    float* out = p.output + Offset(p.output_layout, b, h, i);
#pragma unroll
    for (int t = 0; t < kValueChunks; ++t) {
      const int64_t c = lane + 32 * t;
      if (c < dv) out[c] = accumulator[r][t] * inverse_sum;
    }
    if (p.row_max != nullptr && lane == 0) {
      const int64_t stat = (b * s.num_heads + h) * s.q_len + i;
      p.row_max[stat] = softmax[r].max;
      p.row_sum[stat] = softmax[r].sum;
    }
  }
}

// See launch_plan.h (kMmaRowsPerBlock): warp w owns rows [16 w, 16 w + 16) of the block. Per
// key tile, each warp computes its scores on mma into shared memory, runs the online
// softmax there (two lanes a row, float32), writes the probabilities as bf16, rescales its
// output rows and adds P V on mma. Unnormalized probabilities are rounded (as the CPU's bf16
// path), the output divided by the row's sum at the end.
__global__ void __launch_bounds__(kMmaWarps * 32)
    MmaAttentionKernel(DeviceAttentionProblem p, int64_t query_blocks, MmaSharedLayout l) {
  namespace wmma = nvcuda::wmma;
  using Bf16 = __nv_bfloat16;
  extern __shared__ __align__(128) char shared_bytes[];
  const AttentionShape& s = p.shape;
  const int64_t dk = s.head_dim, dv = s.v_head_dim;
  const FlashBlock block =
      DecodeFlashBlock(blockIdx.x, query_blocks, s.num_heads, kMmaRowsPerBlock);
  const int64_t b = block.batch_index, h = block.head, first_row = block.first_row;
  const int64_t hk = h / (s.num_heads / s.num_kv_heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rows = min(static_cast<int64_t>(kMmaRowsPerBlock), s.q_len - first_row);
  Bf16* q_tile = reinterpret_cast<Bf16*>(shared_bytes + l.q);
  Bf16* k_tile = reinterpret_cast<Bf16*>(shared_bytes + l.k);
  Bf16* v_tile = reinterpret_cast<Bf16*>(shared_bytes + l.v);
  char* warp_region = shared_bytes + warp * l.per_warp_bytes;
  float* scores = reinterpret_cast<float*>(warp_region + l.scores);
  Bf16* probabilities = reinterpret_cast<Bf16*>(warp_region + l.probabilities);
  float* output = reinterpret_cast<float*>(warp_region + l.output);
  float* row_max = reinterpret_cast<float*>(warp_region + l.row_state);
  float* row_sum = row_max + 16;
  float* correction = row_sum + 16;

  for (int64_t e = threadIdx.x; e < kMmaRowsPerBlock * dk; e += blockDim.x) {
    const int64_t r = e / dk, c = e % dk;
    q_tile[r * l.q_ld + c] = __float2bfloat16_rn(
        r < rows ? p.query[Offset(p.query_layout, b, h, first_row + r) + c] : 0.0f);
  }
  for (int64_t e = lane; e < 16 * dv; e += 32) output[(e / dv) * l.output_ld + e % dv] = 0.0f;
  if (lane < 16) {
    row_max[lane] = -INFINITY;
    row_sum[lane] = 0.0f;
  }
  const int64_t warp_row = warp * 16;  // the warp's first row in the block
  const bool warp_has_rows = warp_row < rows;
  // Keys past the last row's frontier are never attended: causal tiles are skipped.
  const int64_t key_count = p.mask.KeyLimit(b, first_row + rows - 1);
  for (int64_t first_key = 0; first_key < key_count; first_key += kMmaKeysPerTile) {
    __syncthreads();  // the Q rows are in, and every warp is done with the previous tile
    const int64_t keys = min(static_cast<int64_t>(kMmaKeysPerTile), key_count - first_key);
    for (int64_t e = threadIdx.x; e < kMmaKeysPerTile * dk; e += blockDim.x) {
      const int64_t j = e / dk, c = e % dk;
      k_tile[j * l.k_ld + c] = __float2bfloat16_rn(
          j < keys ? p.key[Offset(p.key_layout, b, hk, first_key + j) + c] : 0.0f);
    }
    for (int64_t e = threadIdx.x; e < kMmaKeysPerTile * dv; e += blockDim.x) {
      const int64_t j = e / dv, c = e % dv;
      v_tile[j * l.v_ld + c] = __float2bfloat16_rn(
          j < keys ? p.value[Offset(p.value_layout, b, hk, first_key + j) + c] : 0.0f);
    }
    __syncthreads();
    if (!warp_has_rows) continue;

    // Scores [16 rows][64 keys] = Q K^T: K's rows are K^T's columns.
    for (int n = 0; n < kMmaKeysPerTile / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> dot;
      wmma::fill_fragment(dot, 0.0f);
      for (int64_t kk = 0; kk < dk; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::row_major> q_part;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::col_major> k_part;
        wmma::load_matrix_sync(q_part, q_tile + warp_row * l.q_ld + kk, l.q_ld);
        wmma::load_matrix_sync(k_part, k_tile + n * 16 * l.k_ld + kk, l.k_ld);
        wmma::mma_sync(dot, q_part, k_part, dot);
      }
      wmma::store_matrix_sync(scores + n * 16, dot, l.scores_ld, wmma::mem_row_major);
    }
    __syncwarp();

    {  // Online softmax: lanes 2r and 2r + 1 own row r, 32 keys each.
      const int r = lane / 2, half = lane % 2;
      const int64_t i = first_row + warp_row + r;
      const int64_t limit = warp_row + r < rows ? p.mask.KeyLimit(b, i) : 0;
      float values[32];
      float local_max = -INFINITY;
#pragma unroll
      for (int t = 0; t < 32; ++t) {
        const int col = half * 32 + t;
        const int64_t j = first_key + col;
        float score = -INFINITY;
        if (col < keys && j < limit) {
          score = scores[r * l.scores_ld + col] * p.scale;
          if (p.mask.HasElementMasks()) score += p.mask.ScoreBias(b, h, i, j);
        }
        values[t] = score;
        local_max = fmaxf(local_max, score);
      }
      const float tile_max = fmaxf(local_max, __shfl_xor_sync(kFullWarp, local_max, 1));
      const float old_max = row_max[r];
      const float new_max = fmaxf(old_max, tile_max);
      float local_sum = 0.0f;
#pragma unroll
      for (int t = 0; t < 32; ++t) {
        const int col = half * 32 + t;
        float probability = values[t] == -INFINITY ? 0.0f : expf(values[t] - new_max);
        local_sum += probability;  // the sum before dropout normalizes
        probability = DropOut(p, probability, b, h, i, first_key + col);
        probabilities[r * l.probabilities_ld + col] = __float2bfloat16_rn(probability);
      }
      const float tile_sum = local_sum + __shfl_xor_sync(kFullWarp, local_sum, 1);
      __syncwarp();  // both lanes of the row have read its maximum
      if (half == 0) {
        const float rescale = old_max == -INFINITY ? 0.0f : expf(old_max - new_max);
        correction[r] = rescale;
        row_sum[r] = row_sum[r] * rescale + tile_sum;
        row_max[r] = new_max;
      }
    }
    __syncwarp();

    // Output rows rescaled to the new maxima, then += P V.
    for (int64_t e = lane; e < 16 * dv; e += 32) {
      const int64_t r = e / dv;
      output[r * l.output_ld + e % dv] *= correction[r];
    }
    __syncwarp();
    for (int64_t n = 0; n < dv; n += 16) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> out;
      wmma::load_matrix_sync(out, output + n, l.output_ld, wmma::mem_row_major);
      for (int kk = 0; kk < kMmaKeysPerTile; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, Bf16, wmma::row_major> p_part;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, Bf16, wmma::row_major> v_part;
        wmma::load_matrix_sync(p_part, probabilities + kk, l.probabilities_ld);
        wmma::load_matrix_sync(v_part, v_tile + kk * l.v_ld + n, l.v_ld);
        wmma::mma_sync(out, p_part, v_part, out);
      }
      wmma::store_matrix_sync(output + n, out, l.output_ld, wmma::mem_row_major);
    }
    __syncwarp();
  }

  if (!warp_has_rows) return;
  __syncwarp();
  for (int64_t e = lane; e < 16 * dv; e += 32) {
    const int64_t r = e / dv, c = e % dv;
    if (warp_row + r >= rows) continue;
    // A fully masked row has sum 0 and an all-zero accumulator: it stays zeros.
    const float sum = row_sum[r];
    p.output[Offset(p.output_layout, b, h, first_row + warp_row + r) + c] =
        sum > 0.0f ? output[r * l.output_ld + c] * (1.0f / sum) : 0.0f;
  }
}

// One weight per thread (grid-stride) from the flash kernel's row statistics: the same
// score, normalised by the row's final maximum and sum, then dropped out.
__global__ void AttentionWeightsKernel(DeviceAttentionProblem p) {
  const AttentionShape& s = p.shape;
  const int64_t total = s.batch * s.num_heads * s.q_len * s.kv_len;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       index < total; index += stride) {
    const int64_t j = index % s.kv_len;
    const int64_t row = index / s.kv_len;  // (b * H + h) * Nq + i
    const int64_t i = row % s.q_len;
    const int64_t h = (row / s.q_len) % s.num_heads;
    const int64_t b = row / (s.q_len * s.num_heads);
    const int64_t hk = h / (s.num_heads / s.num_kv_heads);
    float weight = 0.0f;
    if (p.row_sum[row] > 0.0f && j < p.mask.KeyLimit(b, i)) {
      const float score = MaskedScore(p, p.query + Offset(p.query_layout, b, h, i),
                                      p.key + Offset(p.key_layout, b, hk, j), b, h, i, j);
      if (score != -INFINITY) {
        weight = DropOut(p, expf(score - p.row_max[row]) / p.row_sum[row], b, h, i, j);
      }
    }
    p.weights[index] = weight;
  }
}

template <int kValueChunks>
cudaError_t LaunchFlash(const DeviceAttentionProblem& p, const FlashLaunchPlan& plan,
                        cudaStream_t stream) {
  constexpr int64_t kDefaultSharedLimit = 48 << 10;
  if (plan.shared_bytes > kDefaultSharedLimit) {
    const cudaError_t raised =
        cudaFuncSetAttribute(FlashAttentionKernel<kValueChunks>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(plan.shared_bytes));
    if (raised != cudaSuccess) return raised;
  }
  FlashAttentionKernel<kValueChunks>
      <<<static_cast<unsigned>(plan.blocks), plan.threads, plan.shared_bytes, stream>>>(
          p, plan.query_blocks);
  return cudaGetLastError();
}

__global__ void HalfToFloatKernel(const uint16_t* in, float* out, int64_t count,
                                  bool bfloat16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += stride) {
    out[e] = bfloat16 ? BFloat16BitsToFloat(in[e]) : HalfBitsToFloat(in[e]);
  }
}

__global__ void FloatToBFloat16Kernel(const float* in, uint16_t* out, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += stride) {
    out[e] = FloatToBFloat16Bits(in[e]);
  }
}

// *first = min(*first, the index of the first element whose exponent bits, `exponent`, are
// all ones: NaN or an infinity). Each thread stops at its own first, the smallest it sees.
template <typename Bits>
__global__ void FindNonFiniteKernel(const Bits* values, int64_t count, Bits exponent,
                                    unsigned long long* first) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += stride) {
    if ((values[e] & exponent) == exponent) {
      atomicMin(first, static_cast<unsigned long long>(e));
      return;
    }
  }
}

// Element e of a dense [batch][heads][padded_rows][dim] tensor: its (b, h, row, column).
struct DenseIndex {
  int64_t b, h, row, column;
};
__device__ inline DenseIndex DenseAt(int64_t e, int64_t heads, int64_t padded_rows, int64_t dim) {
  const int64_t column = e % dim, row = e / dim % padded_rows,
                head_and_batch = e / dim / padded_rows;
  return {head_and_batch / heads, head_and_batch % heads, row, column};
}

// `value` rounded to nearest even as bf16 or, not `bfloat16`, IEEE half bits.
__device__ uint16_t To16Bits(float value, bool bfloat16) {
  return bfloat16 ? FloatToBFloat16Bits(value) : __half_as_ushort(__float2half_rn(value));
}

__global__ void Pack16BitRowsKernel(const float* src, DeviceLayout layout, int64_t count,
                                    int64_t heads, int64_t rows, int64_t padded_rows, int64_t dim,
                                    bool bfloat16, uint16_t* dst) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += stride) {
    const DenseIndex at = DenseAt(e, heads, padded_rows, dim);
    dst[e] = at.row < rows ? To16Bits(src[at.b * layout.batch_stride + at.h * layout.head_stride +
                                          at.row * layout.row_stride + at.column],
                                      bfloat16)
                           : 0;  // padding: zeros, so masked keys' values add nothing (0 * NaN)
  }
}

// `count` = batch * heads * rows * dim: every element of the true rows, none of the padding.
__global__ void Unpack16BitRowsKernel(const uint16_t* src, int64_t count, int64_t heads,
                                      int64_t rows, int64_t padded_rows, int64_t dim, bool bfloat16,
                                      float* dst, DeviceLayout layout) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += stride) {
    const DenseIndex at = DenseAt(e, heads, rows, dim);
    const uint16_t bits = src[((at.b * heads + at.h) * padded_rows + at.row) * dim + at.column];
    dst[at.b * layout.batch_stride + at.h * layout.head_stride + at.row * layout.row_stride +
        at.column] = bfloat16 ? BFloat16BitsToFloat(bits) : HalfBitsToFloat(bits);
  }
}

__global__ void AddBiasKernel(float* y, int64_t rows, int64_t width, int64_t row_stride,
                              const float* bias) {
  const int64_t total = rows * width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += stride) {
    y[(e / width) * row_stride + e % width] += bias[e % width];
  }
}

// Row r is at positions[r], or at r % seq_len when positions is null.
__global__ void RotaryKernel(float* data, int64_t rows, int64_t seq_len, const int64_t* positions,
                             int64_t heads, int64_t head_dim, double base, RopeScaling scaling,
                             int64_t row_stride) {
  const int64_t half = head_dim / 2;
  const int64_t total = rows * heads * half;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += stride) {
    const int64_t c = e % half;
    const int64_t h = (e / half) % heads;
    const int64_t r = e / (half * heads);
    float cos_a, sin_a;
    RotaryAngle(positions != nullptr ? positions[r] : r % seq_len, c, head_dim, base, scaling,
                &cos_a, &sin_a);
    float* x = data + r * row_stride + h * head_dim;
    const float x1 = x[c], x2 = x[c + half];
    x[c] = x1 * cos_a - x2 * sin_a;
    x[c + half] = x2 * cos_a + x1 * sin_a;
  }
}

// Blocks for a grid-stride loop over `total` elements of 256 threads each.
unsigned GridFor(int64_t total) {
  const int64_t blocks = (total + 255) / 256;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65536 ? 65536 : blocks));
}

}  // namespace

cudaError_t LaunchAttention(const DeviceAttentionProblem& p, const FlashLaunchPlan& plan,
                            cudaStream_t stream) {
  cudaError_t error = cudaSuccess;
  switch (plan.value_chunks) {
    case 2:
      error = LaunchFlash<2>(p, plan, stream);
      break;
    case 4:
      error = LaunchFlash<4>(p, plan, stream);
      break;
    default:
      error = LaunchFlash<8>(p, plan, stream);
  }
  if (error != cudaSuccess || p.weights == nullptr) return error;
  AttentionWeightsKernel<<<static_cast<unsigned>(plan.weight_blocks), kWeightThreads, 0,
                           stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchMmaAttention(const DeviceAttentionProblem& p, const MmaLaunchPlan& plan,
                               cudaStream_t stream) {
  const int64_t bytes = plan.shared.total_bytes;
  constexpr int64_t kDefaultSharedLimit = 48 << 10;
  if (bytes > kDefaultSharedLimit) {
    const cudaError_t raised = cudaFuncSetAttribute(
        MmaAttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (raised != cudaSuccess) return raised;
  }
  MmaAttentionKernel<<<static_cast<unsigned>(plan.blocks), plan.threads, bytes, stream>>>(
      p, plan.query_blocks, plan.shared);
  return cudaGetLastError();
}

cudaError_t LaunchHalfToFloat(const uint16_t* in, float* out, int64_t count, bool bfloat16,
                              cudaStream_t stream) {
  HalfToFloatKernel<<<GridFor(count), 256, 0, stream>>>(in, out, count, bfloat16);
  return cudaGetLastError();
}

cudaError_t LaunchFloatToBFloat16(const float* in, uint16_t* out, int64_t count,
                                  cudaStream_t stream) {
  FloatToBFloat16Kernel<<<GridFor(count), 256, 0, stream>>>(in, out, count);
  return cudaGetLastError();
}

cudaError_t LaunchFindNonFinite(const void* values, int64_t count, int element_bytes, bool bfloat16,
                                unsigned long long* first, cudaStream_t stream) {
  if (element_bytes == 4) {
    FindNonFiniteKernel<<<GridFor(count), 256, 0, stream>>>(static_cast<const uint32_t*>(values),
                                                            count, 0x7f800000u, first);
  } else {
    const uint16_t exponent = bfloat16 ? 0x7f80 : 0x7c00;
    FindNonFiniteKernel<<<GridFor(count), 256, 0, stream>>>(static_cast<const uint16_t*>(values),
                                                            count, exponent, first);
  }
  return cudaGetLastError();
}

cudaError_t LaunchPack16BitRows(const float* src, const DeviceLayout& layout, int64_t batch,
                                int64_t heads, int64_t rows, int64_t padded_rows, int64_t dim,
                                bool bfloat16, uint16_t* dst, cudaStream_t stream) {
  const int64_t count = batch * heads * padded_rows * dim;
  Pack16BitRowsKernel<<<GridFor(count), 256, 0, stream>>>(src, layout, count, heads, rows,
                                                          padded_rows, dim, bfloat16, dst);
  return cudaGetLastError();
}

cudaError_t LaunchUnpack16BitRows(const uint16_t* src, int64_t batch, int64_t heads, int64_t rows,
                                  int64_t padded_rows, int64_t dim, bool bfloat16, float* dst,
                                  const DeviceLayout& layout, cudaStream_t stream) {
  const int64_t count = batch * heads * rows * dim;
  Unpack16BitRowsKernel<<<GridFor(count), 256, 0, stream>>>(src, count, heads, rows, padded_rows,
                                                            dim, bfloat16, dst, layout);
  return cudaGetLastError();
}

cudaError_t LaunchAddBias(float* y, int64_t rows, int64_t width, int64_t row_stride,
                          const float* bias, cudaStream_t stream) {
  AddBiasKernel<<<GridFor(rows * width), 256, 0, stream>>>(y, rows, width, row_stride, bias);
  return cudaGetLastError();
}

cudaError_t LaunchRotary(float* data, int64_t rows, int64_t seq_len, int64_t heads,
                         int64_t head_dim, double base, const RopeScaling& scaling,
                         int64_t row_stride, cudaStream_t stream) {
  RotaryKernel<<<GridFor(rows * heads * (head_dim / 2)), 256, 0, stream>>>(
      data, rows, seq_len, nullptr, heads, head_dim, base, scaling, row_stride);
  return cudaGetLastError();
}

cudaError_t LaunchRotaryAt(float* data, int64_t rows, const int64_t* positions, int64_t heads,
                           int64_t head_dim, double base, const RopeScaling& scaling,
                           int64_t row_stride, cudaStream_t stream) {
  RotaryKernel<<<GridFor(rows * heads * (head_dim / 2)), 256, 0, stream>>>(
      data, rows, 1, positions, heads, head_dim, base, scaling, row_stride);
  return cudaGetLastError();
}

}  // namespace attention::core::cuda

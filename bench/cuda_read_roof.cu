#include "bench/cuda_read_roof.h"

namespace attention::bench {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    ReadRoofKernel(const float4* data, int64_t count, float* partial_sums) {
  __shared__ float warp_sums[kThreads / 32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float sum = 0.0f;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < count; i += 4 * stride) {
    const float4 a = __ldg(data + i), b = __ldg(data + i + stride),
                 c = __ldg(data + i + 2 * stride), d = __ldg(data + i + 3 * stride);
    sum += (a.x + a.y + a.z + a.w) + (b.x + b.y + b.z + b.w) + (c.x + c.y + c.z + c.w) +
           (d.x + d.y + d.z + d.w);
  }
  for (; i < count; i += stride) {
    const float4 a = __ldg(data + i);
    sum += a.x + a.y + a.z + a.w;
  }
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    partial_sums[blockIdx.x] = total;
  }
}

}  // namespace

cudaError_t LaunchReadRoof(const void* data, int64_t count, float* partial_sums, int blocks,
                           cudaStream_t stream) {
  ReadRoofKernel<<<blocks, kThreads, 0, stream>>>(static_cast<const float4*>(data), count,
                                                  partial_sums);
  return cudaGetLastError();
}

}  // namespace attention::bench

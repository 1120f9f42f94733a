// The device-memory read roof for bench/cuda_bench.cc: a kernel that only reads.
#ifndef ATTENTION_BENCH_CUDA_READ_ROOF_H_
#define ATTENTION_BENCH_CUDA_READ_ROOF_H_

#include <cstdint>

#include <cuda_runtime.h>

namespace attention::bench {

// partial_sums[block] = the sum of the block's share of `count` float4s (grid-stride, four
// 16-byte loads in flight per thread); `blocks` partial sums of float. A sum, so that no load
// is optimised away.
cudaError_t LaunchReadRoof(const void* data, int64_t count, float* partial_sums, int blocks,
                           cudaStream_t stream);

}  // namespace attention::bench

#endif  // ATTENTION_BENCH_CUDA_READ_ROOF_H_

// The layer's linear projections: cuBLASLt with the bias in the GEMM's epilogue (one pass
// over the output; ATTENTION_CUBLASLT=off, or a shape cuBLASLt offers no algorithm for, runs
// cuBLAS and a bias kernel instead).
#ifndef ATTENTION_CORE_CUDA_LINEAR_H_
#define ATTENTION_CORE_CUDA_LINEAR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/cuda/streams.h"

namespace attention::core::cuda {

// y[rows, out] (row stride ldy) = x[rows, in] * w[out, in]^T (+ bias), row-major, on the
// context's stream, float32 accumulation (never TF32); UNIMPLEMENTED past cuBLAS's int
// sizes.
absl::Status Linear(StreamContext& context, const float* x, int64_t rows, int64_t in,
                    const float* weight, const float* bias, int64_t out, float* y, int64_t ldy);

// The same with bfloat16 x and w (a BFLOAT16 layer's): tensor cores, float32 accumulation
// and output (CUBLAS_COMPUTE_32F).
absl::Status LinearBf16(StreamContext& context, const uint16_t* x, int64_t rows, int64_t in,
                        const uint16_t* weight, const float* bias, int64_t out, float* y,
                        int64_t ldy);

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_LINEAR_H_

#include "core/cuda/linear.h"

#include <climits>

#include "absl/strings/str_cat.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/kernels.h"
#include "core/status_macros.h"

namespace attention::core::cuda {
namespace {

bool FitsInt(int64_t value) { return value <= INT_MAX; }

// cuBLAS takes int sizes.
absl::Status CheckSizes(int64_t rows, int64_t in, int64_t out, int64_t ldy) {
  if (!FitsInt(rows) || !FitsInt(in) || !FitsInt(out) || !FitsInt(ldy)) {
    return absl::UnimplementedError(
        absl::StrCat("a GEMM of ", rows, " x ", in, " x ", out, " exceeds cuBLAS's int sizes"));
  }
  return absl::OkStatus();
}

}  // namespace

// Row-major y = x * w^T is the column-major product y^T = w * x^T.
absl::Status Linear(const StreamContext& context, const float* x, int64_t rows, int64_t in,
                    const float* weight, const float* bias, int64_t out, float* y, int64_t ldy) {
  if (rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckSizes(rows, in, out, ldy));
  const float one = 1.0f, zero = 0.0f;
  RETURN_IF_ERROR(CublasStatus(
      cublasSgemm(context.cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out),
                  static_cast<int>(rows), static_cast<int>(in), &one, weight, static_cast<int>(in),
                  x, static_cast<int>(in), &zero, y, static_cast<int>(ldy)),
      "cublasSgemm"));
  if (bias == nullptr) return absl::OkStatus();
  return CudaStatus(LaunchAddBias(y, rows, out, ldy, bias, context.stream), "bias kernel");
}

absl::Status LinearBf16(const StreamContext& context, const uint16_t* x, int64_t rows, int64_t in,
                        const uint16_t* weight, const float* bias, int64_t out, float* y,
                        int64_t ldy) {
  if (rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckSizes(rows, in, out, ldy));
  const float one = 1.0f, zero = 0.0f;
  RETURN_IF_ERROR(CublasStatus(
      cublasGemmEx(context.cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out),
                   static_cast<int>(rows), static_cast<int>(in), &one, weight, CUDA_R_16BF,
                   static_cast<int>(in), x, CUDA_R_16BF, static_cast<int>(in), &zero, y, CUDA_R_32F,
                   static_cast<int>(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx(bf16)"));
  if (bias == nullptr) return absl::OkStatus();
  return CudaStatus(LaunchAddBias(y, rows, out, ldy, bias, context.stream), "bias kernel");
}

}  // namespace attention::core::cuda

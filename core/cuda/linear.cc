#include "core/cuda/linear.h"

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

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

// cuBLASLt's workspace per stream: what its split-K and stream-K kernels of large
// projections ask for on Hopper.
constexpr int64_t kLtWorkspaceBytes = int64_t{32} << 20;

bool LtOff() {
  static const bool off = [] {
    const char* setting = std::getenv("ATTENTION_CUBLASLT");
    return setting != nullptr && std::strcmp(setting, "off") == 0;
  }();
  return off;
}

// The largest power of two up to 256 dividing `pointer`: cuBLASLt's heuristic assumes 256
// unless told, and an algorithm for wider alignment may fault on a narrower pointer.
uint32_t Alignment(const void* pointer) {
  uint32_t alignment = 256;
  while (reinterpret_cast<uintptr_t>(pointer) % alignment != 0) alignment /= 2;
  return alignment;
}

// The descriptors of one cuBLASLt call, destroyed with it.
struct LtCall {
  cublasLtMatmulDesc_t operation = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~LtCall() {
    if (preference != nullptr) cublasLtMatmulPreferenceDestroy(preference);
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (operation != nullptr) cublasLtMatmulDescDestroy(operation);
  }
};

// Row-major y = x w^T (+ bias, in the epilogue) on cuBLASLt, x and w of `type`, y float32,
// float32 accumulation (never TF32). False when cuBLASLt is off or offers no algorithm for
// the shape: the caller then runs cuBLAS and the bias kernel.
absl::StatusOr<bool> LtLinear(StreamContext& context, const void* x, const void* weight,
                              cudaDataType_t type, const float* bias, int64_t rows, int64_t in,
                              int64_t out, float* y, int64_t ldy) {
  if (context.cublas_lt == nullptr || LtOff()) return false;
  ASSIGN_OR_RETURN(char* workspace, context.lt_workspace.Reserve(kLtWorkspaceBytes));
  LtCall call;
  auto ok = [](cublasStatus_t status) { return status == CUBLAS_STATUS_SUCCESS; };
  const cublasOperation_t transpose = CUBLAS_OP_T, plain = CUBLAS_OP_N;
  if (!ok(cublasLtMatmulDescCreate(&call.operation, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
      !ok(cublasLtMatmulDescSetAttribute(call.operation, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                         sizeof(transpose))) ||
      !ok(cublasLtMatmulDescSetAttribute(call.operation, CUBLASLT_MATMUL_DESC_TRANSB, &plain,
                                         sizeof(plain)))) {
    return false;
  }
  if (bias != nullptr) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_32F;
    if (!ok(cublasLtMatmulDescSetAttribute(call.operation, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                           sizeof(epilogue))) ||
        !ok(cublasLtMatmulDescSetAttribute(call.operation, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                           sizeof(bias))) ||
        !ok(cublasLtMatmulDescSetAttribute(call.operation, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                           &bias_type, sizeof(bias_type)))) {
      return false;
    }
  }
  // Column-major: A is w^T's storage (in x out), B is x^T's (in x rows), D is y^T's
  // (out x rows, leading dimension ldy); D = A^T B.
  const uint64_t workspace_bytes = kLtWorkspaceBytes;
  const uint32_t weight_alignment = Alignment(weight), x_alignment = Alignment(x),
                 y_alignment = Alignment(y);
  auto prefer = [&](cublasLtMatmulPreferenceAttributes_t attribute, const void* value,
                    size_t size) {
    return ok(cublasLtMatmulPreferenceSetAttribute(call.preference, attribute, value, size));
  };
  if (!ok(cublasLtMatrixLayoutCreate(&call.a, type, in, out, in)) ||
      !ok(cublasLtMatrixLayoutCreate(&call.b, type, in, rows, in)) ||
      !ok(cublasLtMatrixLayoutCreate(&call.d, CUDA_R_32F, out, rows, ldy)) ||
      !ok(cublasLtMatmulPreferenceCreate(&call.preference)) ||
      !prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
              sizeof(workspace_bytes)) ||
      !prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &weight_alignment, sizeof(uint32_t)) ||
      !prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &x_alignment, sizeof(uint32_t)) ||
      !prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &y_alignment, sizeof(uint32_t)) ||
      !prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &y_alignment, sizeof(uint32_t))) {
    return false;
  }
  cublasLtMatmulHeuristicResult_t heuristic;
  int found = 0;
  if (!ok(cublasLtMatmulAlgoGetHeuristic(context.cublas_lt, call.operation, call.a, call.b, call.d,
                                         call.d, call.preference, 1, &heuristic, &found)) ||
      found == 0) {
    return false;
  }
  const float one = 1.0f, zero = 0.0f;
  RETURN_IF_ERROR(
      CublasStatus(cublasLtMatmul(context.cublas_lt, call.operation, &one, weight, call.a, x,
                                  call.b, &zero, y, call.d, y, call.d, &heuristic.algo, workspace,
                                  kLtWorkspaceBytes, context.stream),
                   "cublasLtMatmul"));
  return true;
}

}  // namespace

// Row-major y = x * w^T is the column-major product y^T = w * x^T.
absl::Status Linear(StreamContext& context, const float* x, int64_t rows, int64_t in,
                    const float* weight, const float* bias, int64_t out, float* y, int64_t ldy) {
  if (rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckSizes(rows, in, out, ldy));
  ASSIGN_OR_RETURN(const bool on_lt,
                   LtLinear(context, x, weight, CUDA_R_32F, bias, rows, in, out, y, ldy));
  if (on_lt) return absl::OkStatus();
  const float one = 1.0f, zero = 0.0f;
  RETURN_IF_ERROR(CublasStatus(
      cublasSgemm(context.cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out),
                  static_cast<int>(rows), static_cast<int>(in), &one, weight, static_cast<int>(in),
                  x, static_cast<int>(in), &zero, y, static_cast<int>(ldy)),
      "cublasSgemm"));
  if (bias == nullptr) return absl::OkStatus();
  return CudaStatus(LaunchAddBias(y, rows, out, ldy, bias, context.stream), "bias kernel");
}

absl::Status LinearBf16(StreamContext& context, const uint16_t* x, int64_t rows, int64_t in,
                        const uint16_t* weight, const float* bias, int64_t out, float* y,
                        int64_t ldy) {
  if (rows == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckSizes(rows, in, out, ldy));
  ASSIGN_OR_RETURN(const bool on_lt,
                   LtLinear(context, x, weight, CUDA_R_16BF, bias, rows, in, out, y, ldy));
  if (on_lt) return absl::OkStatus();
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

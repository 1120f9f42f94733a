// The CUDA backend's kernels, callable from host C++ (defined in kernels.cu). Plain structs
// only: this header is read by g++ and nvcc alike.
#ifndef ATTENTION_CORE_CUDA_KERNELS_H_
#define ATTENTION_CORE_CUDA_KERNELS_H_

#include <cstdint>

#include <cuda_runtime.h>

#include "core/attention_math.h"
#include "core/cuda/launch_plan.h"

namespace attention::core::cuda {

// Where row i of head h of sequence b lives: base + b*batch + h*head + i*row (in floats), as
// core::HeadLayout.
struct DeviceLayout {
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
  int64_t row_stride = 0;
};

// One attention call on device memory. `mask` points to device memory.
struct DeviceAttentionProblem {
  AttentionShape shape;
  const float* query = nullptr;  // rows of dk
  DeviceLayout query_layout;
  const float* key = nullptr;  // rows of dk, Hkv heads
  DeviceLayout key_layout;
  const float* value = nullptr;  // rows of dv, Hkv heads
  DeviceLayout value_layout;
  float* output = nullptr;  // rows of dv, H heads
  DeviceLayout output_layout;
  MaskView mask;
  float scale = 1.0f;
  float dropout_p = 0.0f;
  uint64_t dropout_seed = 0;
  // Null, or [B, H, Nq, Nk]: the attention weights after masking and dropout (a second
  // kernel, from the row statistics below).
  float* weights = nullptr;
  // [B * H * Nq] each when weights are asked for: each row's softmax maximum and sum.
  float* row_max = nullptr;
  float* row_sum = nullptr;
  // Host memory: mask.key_lengths' and mask.key_padding_keep's values, or null, for the
  // host's choices (cudnn_sdpa.h).
  const int64_t* host_key_lengths = nullptr;
  const uint8_t* host_key_padding_keep = nullptr;
  // A BFLOAT16 layer's call: Q, K, probabilities and V rounded to bf16 for the products
  // (float32 accumulation), where the mma kernel takes the shape (see MmaKernelTakes).
  bool bf16_products = false;
  // A FLOAT16 SDPA call: fp16 products on cuDNN where it takes the call; float32 here.
  bool fp16_products = false;
};

// Fused flash-style attention per `plan` (see PlanFlashAttention), then the weights when
// asked. Launches on `stream` and returns the launch error, if any.
cudaError_t LaunchAttention(const DeviceAttentionProblem& problem, const FlashLaunchPlan& plan,
                            cudaStream_t stream);

// The tensor-core kernel per `plan` (see PlanMmaAttention), for a call MmaKernelTakes.
cudaError_t LaunchMmaAttention(const DeviceAttentionProblem& problem, const MmaLaunchPlan& plan,
                               cudaStream_t stream);

// out[e] = the float32 value of 16-bit `in[e]` (IEEE half, or bfloat16 when `bfloat16`).
cudaError_t LaunchHalfToFloat(const uint16_t* in, float* out, int64_t count, bool bfloat16,
                              cudaStream_t stream);

// Rounds `count` floats to bfloat16 bits (to nearest even), as core::FloatToBFloat16.
cudaError_t LaunchFloatToBFloat16(const float* in, uint16_t* out, int64_t count,
                                  cudaStream_t stream);

// *first = min(*first, the index of the first NaN or infinity among `count` values of
// `element_bytes` (4: float32; 2: IEEE half, or bfloat16 when `bfloat16`)); unchanged when
// all are finite. `values` aligned to its element.
cudaError_t LaunchFindNonFinite(const void* values, int64_t count, int element_bytes, bool bfloat16,
                                unsigned long long* first, cudaStream_t stream);

// dst, dense [batch][heads][padded_rows][dim] 16-bit = src (at `layout`) rounded to bf16
// (or, not `bfloat16`, IEEE half), for rows < `rows`; zeros in the padding rows (cuDNN's SDPA
// inputs; see cudnn_sdpa_plan.h).
cudaError_t LaunchPack16BitRows(const float* src, const DeviceLayout& layout, int64_t batch,
                                int64_t heads, int64_t rows, int64_t padded_rows, int64_t dim,
                                bool bfloat16, uint16_t* dst, cudaStream_t stream);
// The reverse for the first `rows` rows of each head: dst (at `layout`) = src widened.
cudaError_t LaunchUnpack16BitRows(const uint16_t* src, int64_t batch, int64_t heads, int64_t rows,
                                  int64_t padded_rows, int64_t dim, bool bfloat16, float* dst,
                                  const DeviceLayout& layout, cudaStream_t stream);

// rows x width: y[r, c] += bias[c].
cudaError_t LaunchAddBias(float* y, int64_t rows, int64_t width, int64_t row_stride,
                          const float* bias, cudaStream_t stream);

// Rotary embedding in place on `rows` rows of `heads` heads of width dk (`row_stride` floats
// apart); row r is at position r % seq_len (see core::ApplyRotary).
cudaError_t LaunchRotary(float* data, int64_t rows, int64_t seq_len, int64_t heads,
                         int64_t head_dim, double base, const RopeScaling& scaling,
                         int64_t row_stride, cudaStream_t stream);
// The same with row r at the absolute position positions[r] (device memory): a session's
// decode rows (see core::ApplyRotaryAt).
cudaError_t LaunchRotaryAt(float* data, int64_t rows, const int64_t* positions, int64_t heads,
                           int64_t head_dim, double base, const RopeScaling& scaling,
                           int64_t row_stride, cudaStream_t stream);

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_KERNELS_H_

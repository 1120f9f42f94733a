// bfloat16 GEMMs of the CPU backend for BFLOAT16 layers: bf16 operands, float32
// accumulation and output, on weights packed once in pairs of depths for AVX512-BF16's
// `vdpbf16ps` (two bf16 products summed into each float32 lane). Hosts without it run a
// portable kernel with the same packing and float32 products of the same bf16 values (the
// CPU backend prefers its float32 microkernel there; see Bf16Kernel). Intel's Xeons since
// Sapphire Rapids multiply the same panels on AMX tiles (core/cpu/amx_tiles.h).
#ifndef ATTENTION_CORE_CPU_GEMM_BF16_H_
#define ATTENTION_CORE_CPU_GEMM_BF16_H_

#include <cstdint>
#include <cstdlib>
#include <memory>

#include "absl/types/span.h"
#include "core/cpu/gemm.h"
#include "core/cpu/thread_pool.h"

namespace attention::core {

// kAmx: the products on AMX tiles; rounding and packing with AVX512-BF16, as kAvx512Bf16.
enum class Bf16Kernel { kPortable, kAvx512Bf16, kAmx };

const char* Bf16KernelName(Bf16Kernel kernel);
// Whether this CPU runs `kernel` (kPortable: always).
bool CpuSupports(Bf16Kernel kernel);
// kAvx512Bf16 where the CPU has it, detected once (never kAmx: which multiplies faster is
// measured, see FastestBf16AttentionKernel).
Bf16Kernel BestBf16Kernel();

// bf16 elements of B [depth, columns] in bf16 panel layout: panel p holds columns
// [16p, 16p + 16) as ceil(depth / 2) rows of 32 elements, element (k, j) at row k / 2,
// position 2j + k % 2; zero past the last column and the last depth.
inline int64_t Bf16PanelElements(int64_t depth, int64_t columns) {
  return PanelCount(columns) * ((depth + 1) / 2) * 2 * kPanelWidth;
}

// Rounds `count` floats to bf16 (to nearest even, NaN stays NaN), with `kernel`'s
// instructions where it has them.
void RoundToBf16(const float* x, int64_t count, uint16_t* out,
                 Bf16Kernel kernel = BestBf16Kernel());

// Panels of B = W^T for bf16 W [columns, depth] with rows `ldw` elements apart (a Linear
// weight in PyTorch layout).
void PackBf16Transposed(const uint16_t* w, int64_t columns, int64_t depth, int64_t ldw,
                        uint16_t* panels);

// Panels of float32 B [depth, columns], element (k, j) at b[k * depth_stride + j *
// column_stride], rounded to bf16 as they are packed, with `kernel`'s instructions: keys
// (depth_stride 1, as PackTransposed) and values (column_stride 1, as PackRows) of
// attention's products.
void PackBf16Panels(const float* b, int64_t depth, int64_t columns, int64_t depth_stride,
                    int64_t column_stride, uint16_t* panels, Bf16Kernel kernel = BestBf16Kernel());
// The same for B already in bf16 (copied, not rounded): a BFLOAT16 layer's projected keys
// and values.
void PackBf16Panels(const uint16_t* b, int64_t depth, int64_t columns, int64_t depth_stride,
                    int64_t column_stride, uint16_t* panels, Bf16Kernel kernel = BestBf16Kernel());

// C[rows, columns of panels [first_panel, end_panel)] = alpha * A[rows, depth] * B + bias,
// as GemmPanels, with A in bf16 (rows `lda` elements apart) and B in bf16 panel layout.
// With `accumulate`, C += alpha * A * B instead (and `bias` must be null).
void GemmBf16Panels(Bf16Kernel kernel, const uint16_t* a, int64_t lda, int64_t rows,
                    const uint16_t* panels, int64_t depth, int64_t columns, int64_t first_panel,
                    int64_t end_panel, float alpha, const float* bias, float* c, int64_t ldc,
                    bool accumulate = false);
// The same with C written in bf16, each sum rounded to nearest even (no accumulation).
void GemmBf16PanelsToBf16(Bf16Kernel kernel, const uint16_t* a, int64_t lda, int64_t rows,
                          const uint16_t* panels, int64_t depth, int64_t columns,
                          int64_t first_panel, int64_t end_panel, float alpha, const float* bias,
                          uint16_t* c, int64_t ldc);

// A bf16 Linear weight W [out_features, in_features] packed for GemmBf16Panels, 64-byte
// aligned.
class PackedBf16Weight {
 public:
  PackedBf16Weight(absl::Span<const uint16_t> weight, int64_t out_features, int64_t in_features);

  const uint16_t* panels() const { return panels_.get(); }
  int64_t bytes() const { return Bf16PanelElements(in_features_, out_features_) * 2; }

 private:
  struct Free {
    void operator()(uint16_t* p) const { std::free(p); }
  };
  int64_t out_features_, in_features_;
  std::unique_ptr<uint16_t[], Free> panels_;
};

// Y[rows, N] = X[rows, K] * W[N, K]^T (+ bias[N]) for bf16 X and W (W packed), float32 Y,
// split across the pool as LinearForward splits it.
void LinearForwardBf16(ThreadPool& pool, const uint16_t* x, int64_t rows, int64_t in_features,
                       const PackedBf16Weight& weight, absl::Span<const float> bias,
                       int64_t out_features, float* y, Bf16Kernel kernel = BestBf16Kernel());
// The same with Y rounded to bf16 as it is written (what attention's bf16 products read).
void LinearForwardBf16(ThreadPool& pool, const uint16_t* x, int64_t rows, int64_t in_features,
                       const PackedBf16Weight& weight, absl::Span<const float> bias,
                       int64_t out_features, uint16_t* y, Bf16Kernel kernel = BestBf16Kernel());

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_GEMM_BF16_H_

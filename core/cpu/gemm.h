// The CPU backend's GEMMs: OpenBLAS for large ones, and a microkernel of its own on weights
// packed once (like ONNX Runtime's MlasGemmPackB) for few rows and for attention's tiny
// heads, where OpenBLAS would spend most of a call packing its operands. The microkernel is
// chosen at run time: AVX-512, AVX2+FMA, or portable C++ on any other CPU.
#ifndef ATTENTION_CORE_CPU_GEMM_H_
#define ATTENTION_CORE_CPU_GEMM_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>

#include "absl/functional/function_ref.h"
#include "absl/types/span.h"
#include "core/cpu/thread_pool.h"

namespace attention::core {

enum class SimdLevel { kPortable, kAvx2, kAvx512 };

const char* SimdLevelName(SimdLevel level);
// Whether this CPU runs `level`'s microkernel (kPortable: always).
bool CpuSupports(SimdLevel level);
// The widest level this CPU supports, detected once.
SimdLevel BestSimdLevel();

// Columns of B per panel: one AVX-512 register, two AVX2 registers.
inline constexpr int64_t kPanelWidth = 16;

inline int64_t PanelCount(int64_t columns) { return (columns + kPanelWidth - 1) / kPanelWidth; }

// Fetches a tile's output rows (`rows` rows of `row_bytes`, `stride` bytes apart) for writing
// as the tile starts, so that its stores at the end do not wait on memory: a projection's
// output is larger than the caches. Inlined into tiles built with `prfchw`, it is PREFETCHW.
inline void PrefetchForWriting(const void* first_row, int64_t stride, int rows, int64_t row_bytes) {
  const char* row = static_cast<const char*>(first_row);
  for (int r = 0; r < rows; ++r, row += stride) {
    for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(row + line, 1);
  }
}
// Floats of B [depth, columns] in panel layout: panel p holds columns [16p, 16p + 16) as
// `depth` rows of 16 contiguous floats, zero past the last column.
inline int64_t PanelFloats(int64_t depth, int64_t columns) {
  return PanelCount(columns) * depth * kPanelWidth;
}

// Panels of B [depth, columns] whose element (k, j) is b[k * depth_stride + j * column_stride],
// with `level`'s instructions.
void PackPanels(const float* b, int64_t depth, int64_t columns, int64_t depth_stride,
                int64_t column_stride, float* panels, SimdLevel level = BestSimdLevel());
// Panels of B = W^T for W [columns, depth] with rows `ldw` floats apart (the PyTorch layout of
// a Linear weight, or keys to take scores against).
inline void PackTransposed(const float* w, int64_t columns, int64_t depth, int64_t ldw,
                           float* panels, SimdLevel level = BestSimdLevel()) {
  PackPanels(w, depth, columns, 1, ldw, panels, level);
}
// Panels of B [depth, columns] with rows `ldb` floats apart (values).
inline void PackRows(const float* b, int64_t depth, int64_t columns, int64_t ldb, float* panels,
                     SimdLevel level = BestSimdLevel()) {
  PackPanels(b, depth, columns, ldb, 1, panels, level);
}

// C[rows, columns of panels [first_panel, end_panel)] = alpha * A[rows, depth] * B + bias,
// with B in panel layout (`columns` in all, which bounds the last panel). `bias` (may be
// null) is indexed by column; C's rows are `ldc` floats apart and its column 0 is at `c`.
// With `accumulate`, C += alpha * A * B instead (and `bias` must be null).
void GemmPanels(SimdLevel level, const float* a, int64_t lda, int64_t rows, const float* panels,
                int64_t depth, int64_t columns, int64_t first_panel, int64_t end_panel,
                float alpha, const float* bias, float* c, int64_t ldc, bool accumulate = false);

// A Linear weight W [out_features, in_features] packed for GemmPanels, 64-byte aligned.
class PackedWeight {
 public:
  PackedWeight(absl::Span<const float> weight, int64_t out_features, int64_t in_features);

  int64_t out_features() const { return out_features_; }
  int64_t in_features() const { return in_features_; }
  const float* panels() const { return panels_.get(); }
  int64_t bytes() const { return PanelFloats(in_features_, out_features_) * sizeof(float); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  int64_t out_features_, in_features_;
  std::unique_ptr<float[], Free> panels_;
};

// At most this many rows go through `level`'s packed microkernel; more go to OpenBLAS.
// attention_bench's BM_LinearCpu (E=768 QKV, per CPU second), microkernel / OpenBLAS:
// AVX2 (Zen 3): 1.5-1.7 at 16 rows, 1.03-1.07 at 256, 0.98-1.04 at 512, so 256;
// AVX-512 (Zen 4): 1.08-1.20 at 2048 rows too (S1, S2, S4 +2-5%), so every row count.
int64_t PackedLinearMaxRows(SimdLevel level);

// Whether LinearForward splits a projection of `rows` rows across `threads` by rows, or
// else by output columns (when the weights outweigh the rows).
bool SplitsLinearByRows(int64_t rows, int64_t out_features, int64_t threads);
// A projection on packed weights split across the pool as LinearForward splits it:
// `part(first_row, row_count, first_panel, end_panel)` once per non-empty part.
void ForEachPackedLinearPart(ThreadPool& pool, int64_t rows, int64_t out_features,
                             absl::FunctionRef<void(int64_t first_row, int64_t row_count,
                                                    int64_t first_panel, int64_t end_panel)>
                                 part);

// Y[rows, N] = X[rows, K] * W[N, K]^T (+ bias[N]), split across the pool: on `panels` (W
// packed by PackTransposed, may be null) with `level`'s microkernel when rows <=
// max_packed_rows (unset: PackedLinearMaxRows(level)), else OpenBLAS on `weight`.
void LinearForward(ThreadPool& pool, const float* x, int64_t rows, int64_t in_features,
                   absl::Span<const float> weight, absl::Span<const float> bias,
                   int64_t out_features, float* y, const float* panels,
                   SimdLevel level = BestSimdLevel(),
                   std::optional<int64_t> max_packed_rows = std::nullopt);

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_GEMM_H_

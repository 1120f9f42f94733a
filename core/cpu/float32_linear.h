// The projections of float32 layers, on one of two kernel sets for every row count, the
// faster at many rows, measured once per process (issue 39), or forced (--float32_kernels):
//   own     the project's packed microkernel (core/cpu/gemm.h);
//   onednn  Debian's oneDNN matmul in fixed blocks of rows (core/cpu/onednn_matmul.h),
//           reading the layer's weights in place (no copy).
// Each sums a row's products in an order that does not depend on the rows beside it, so an
// answer has the same bits alone or in any batch (issue 55). The two sets sum in different
// orders: each answers within the float32 rule, and the choice may change a layer's last bits.
#ifndef ATTENTION_CORE_CPU_FLOAT32_LINEAR_H_
#define ATTENTION_CORE_CPU_FLOAT32_LINEAR_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/cpu/thread_pool.h"

namespace attention::core {

enum class Float32Projection { kOwn, kOneDnn };

const char* Float32ProjectionName(Float32Projection projection);
// "own" or "onednn"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<Float32Projection> ParseFloat32Projection(absl::string_view name);

// The faster set: each projects 512 tokens of 768 -> 2304 features (a BERT-base layer's fused
// QKV) and one token (a decode step) on `threads` threads, best of four runs after warming
// up, once per process (the first caller's thread count; about 250 ms on 2 threads of a Zen
// 3); oneDNN must be 5% faster at both to be chosen. Measured when first asked, so that a
// process that never projects never pays for it.
Float32Projection FastestFloat32Projection(int threads);
// What that measurement found, for the start-up log, e.g.
// "onednn 131 GFLOPS (gemm:jit), own 125 (OpenBLAS Zen)"; measures if nothing has yet.
std::string Float32ProjectionReport(int threads);

class OneDnnMatmul;

// One Linear of a float32 layer: y[rows, out] = x[rows, in] * W^T + bias.
class Float32Linear {
 public:
  // `weight` W [out_features, in_features], `bias` (may be empty) and `panels` (W packed by
  // PackTransposed) are read in place and must outlive this. `projection`: forced, or unset
  // for the measured choice.
  Float32Linear(absl::Span<const float> weight, absl::Span<const float> bias, int64_t out_features,
                int64_t in_features, const float* panels,
                std::optional<Float32Projection> projection);
  ~Float32Linear();
  Float32Linear(const Float32Linear&) = delete;
  Float32Linear& operator=(const Float32Linear&) = delete;

  // On the pool's threads (oneDNN's OpenMP threads, as many, for its part).
  void Forward(ThreadPool& pool, const float* x, int64_t rows, float* y) const;

 private:
  const OneDnnMatmul& OneDnn() const;
  // The forced set, or the measured one.
  Float32Projection Projection(int threads) const;

  const absl::Span<const float> weight_, bias_;
  const int64_t out_features_, in_features_;
  const float* const panels_;
  const std::optional<Float32Projection> projection_;
  // Made on the first batch that runs on oneDNN.
  mutable std::once_flag onednn_made_;
  mutable std::unique_ptr<const OneDnnMatmul> onednn_;
};

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_FLOAT32_LINEAR_H_

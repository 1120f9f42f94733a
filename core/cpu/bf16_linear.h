// The projections of a BFLOAT16 layer (bf16 tokens and weights, float32 accumulation) on
// the fastest of the kernels this host has, measured once per process:
//   onednn       Debian's oneDNN matmul: AMX tiles on Intel Xeons that have them, else its
//                AVX512-BF16 or float32 kernels;
//   amx          this project's AMX tiles (core/cpu/amx_tiles.h) on the vdpbf16ps panels;
//   avx512_bf16  this project's vdpbf16ps panels (core/cpu/gemm_bf16.h);
//   float32      the same bf16 values widened to float32 panels (core/cpu/gemm.h).
// All of them multiply the same bf16 values exactly and sum in float32; only the order of the
// sums differs, so each answers within the bf16 rule.
#ifndef ATTENTION_CORE_CPU_BF16_LINEAR_H_
#define ATTENTION_CORE_CPU_BF16_LINEAR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/cpu/gemm.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cpu/thread_pool.h"

namespace attention::core {

enum class Bf16Projection { kOneDnn, kAvx512Bf16, kFloat32, kAmx };
inline constexpr Bf16Projection kBf16Projections[] = {Bf16Projection::kOneDnn, Bf16Projection::kAmx,
                                                      Bf16Projection::kAvx512Bf16,
                                                      Bf16Projection::kFloat32};

const char* Bf16ProjectionName(Bf16Projection projection);
// "onednn", "amx", "avx512_bf16" or "float32"; INVALID_ARGUMENT naming the choices otherwise.
absl::StatusOr<Bf16Projection> ParseBf16Projection(absl::string_view name);
// Whether this host runs `projection`: avx512_bf16 and amx need the instructions (amx the
// kernel's permission for the tile state too), onednn a bf16 matmul of oneDNN's for this
// CPU, float32 runs everywhere.
bool CpuSupports(Bf16Projection projection);

// The fastest projection kernel of this host: each candidate multiplies 256 tokens of
// 1024 -> 1024 features, and one token, a few times on one thread, once per process (about
// 20 ms), the best of three timings counting; the fastest at 256 tokens, but oneDNN only
// where it is also the fastest at one token (its fixed blocks pad a decode step to 32 rows).
Bf16Projection FastestBf16Projection();
// What that measurement found, for the start-up log, e.g.
// "onednn 612 GFLOPS (one row 177 us) (brg:avx512_core_amx_bf16), avx512_bf16 104 (one row
// 56 us), float32 131 (one row 144 us); fastest at one row: avx512_bf16" (and "amx N" where
// AMX runs).
std::string Bf16ProjectionReport();

class OneDnnMatmul;

// One Linear of a bf16 layer, its weight packed once for `projection`.
class Bf16Linear {
 public:
  Bf16Linear(absl::Span<const uint16_t> weight, int64_t out_features, int64_t in_features,
             Bf16Projection projection);
  ~Bf16Linear();
  Bf16Linear(Bf16Linear&&) noexcept;

  // y[rows, out_features] = x[rows, in_features] * W^T + bias, x in bf16, on the pool's
  // threads.
  void Forward(ThreadPool& pool, const uint16_t* x, int64_t rows, absl::Span<const float> bias,
               float* y) const;
  // The same, rounded to bf16 as written; only where WritesBf16().
  void Forward(ThreadPool& pool, const uint16_t* x, int64_t rows, absl::Span<const float> bias,
               uint16_t* y) const;
  // Whether Forward can write bf16 (float32 panels cannot).
  bool WritesBf16() const { return !widened_.has_value(); }
  int64_t bytes() const;

 private:
  int64_t out_features_, in_features_;
  std::optional<PackedBf16Weight> bf16_;
  Bf16Kernel bf16_kernel_ = Bf16Kernel::kAvx512Bf16;  // what multiplies bf16_
  std::optional<PackedWeight> widened_;
  std::unique_ptr<OneDnnMatmul> onednn_;
};

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_BF16_LINEAR_H_

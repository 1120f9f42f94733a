#include "core/cpu/float32_linear.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <random>
#include <vector>

#include <cblas.h>

#include "absl/strings/str_cat.h"
#include "core/cpu/gemm.h"
#include "core/cpu/onednn_matmul.h"

namespace attention::core {

const char* Float32ProjectionName(Float32Projection projection) {
  return projection == Float32Projection::kOneDnn ? "onednn" : "own";
}

absl::StatusOr<Float32Projection> ParseFloat32Projection(absl::string_view name) {
  for (const Float32Projection projection : {Float32Projection::kOwn, Float32Projection::kOneDnn}) {
    if (name == Float32ProjectionName(projection)) return projection;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("float32 kernel \"", name.substr(0, 64), "\" is not one of own, onednn"));
}

Float32Linear::Float32Linear(absl::Span<const float> weight, absl::Span<const float> bias,
                             int64_t out_features, int64_t in_features, const float* panels,
                             std::optional<Float32Projection> projection)
    : weight_(weight),
      bias_(bias),
      out_features_(out_features),
      in_features_(in_features),
      panels_(panels),
      projection_(projection) {}

Float32Linear::~Float32Linear() = default;

const OneDnnMatmul& Float32Linear::OneDnn() const {
  std::call_once(onednn_made_, [this] {
    onednn_ =
        std::make_unique<const OneDnnMatmul>(weight_.data(), DType::kFloat32, out_features_,
                                             in_features_, OneDnnMatmul::WeightCopy::kInPlace);
  });
  return *onednn_;
}

void Float32Linear::Forward(ThreadPool& pool, const float* x, int64_t rows, float* y) const {
  if (rows >= kOneDnnFloat32MinRows && Projection(pool.size()) == Float32Projection::kOneDnn) {
    OneDnn().Forward(x, rows, bias_, y, DType::kFloat32, pool.size());
    return;
  }
  LinearForward(pool, x, rows, in_features_, weight_, bias_, out_features_, y, panels_);
}

Float32Projection Float32Linear::Projection(int threads) const {
  // Not value_or: a forced set must not start the measurement (which runs both, forced).
  return projection_.has_value() ? *projection_ : FastestFloat32Projection(threads);
}

namespace {

struct Calibration {
  Float32Projection fastest = Float32Projection::kOwn;
  std::string report;
};

// Each set warms up and runs five times, own first: after a oneDNN call its OpenMP threads
// spin for a while, which halved the next OpenBLAS runs on 2 vCPUs (Zen 3) when the two
// alternated. The two often differ by a few percent only.
Calibration Calibrate(int threads) {
  constexpr int64_t kRows = 384, kFeatures = 1024;  // past the microkernel's 256 rows on AVX2
  constexpr int kRuns = 5;
  constexpr double kOneDnnMargin = 0.97;
  std::mt19937 rng(39);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> weight(kFeatures * kFeatures), x(kRows * kFeatures), y(kRows * kFeatures);
  for (float& w : weight) w = uniform(rng);
  for (float& v : x) v = uniform(rng);
  const PackedWeight packed(weight, kFeatures, kFeatures);
  ThreadPool pool(threads);
  const Float32Projection candidates[] = {Float32Projection::kOwn, Float32Projection::kOneDnn};
  double best_seconds[] = {std::numeric_limits<double>::max(), std::numeric_limits<double>::max()};
  for (int c = 0; c < 2; ++c) {
    const Float32Linear linear(weight, {}, kFeatures, kFeatures, packed.panels(), candidates[c]);
    for (int run = -1; run < kRuns; ++run) {  // run -1: primitives, threads, pages, caches
      const auto start = std::chrono::steady_clock::now();
      linear.Forward(pool, x.data(), kRows, y.data());
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (run >= 0) best_seconds[c] = std::min(best_seconds[c], seconds);
    }
  }
  const auto gflops = [&](int c) {
    return static_cast<int64_t>(2.0 * kRows * kFeatures * kFeatures / best_seconds[c] / 1e9);
  };
  Calibration calibration;
  // oneDNN only for a clear win: a change of kernels changes float32 layers' last bits.
  calibration.fastest =
      best_seconds[1] < kOneDnnMargin * best_seconds[0] ? candidates[1] : candidates[0];
  const std::string own_kernel = kRows > PackedLinearMaxRows(BestSimdLevel())
                                     ? absl::StrCat("OpenBLAS ", openblas_get_corename())
                                     : absl::StrCat(SimdLevelName(BestSimdLevel()), " microkernel");
  calibration.report = absl::StrCat("onednn ", gflops(1), " GFLOPS (",
                                    OneDnnMatmul(weight.data(), DType::kFloat32, kFeatures,
                                                 kFeatures, OneDnnMatmul::WeightCopy::kInPlace)
                                        .implementation(),
                                    "), own ", gflops(0), " (", own_kernel, ")");
  return calibration;
}

const Calibration& MeasuredOnce(int threads) {
  static const Calibration calibration = Calibrate(threads);
  return calibration;
}

}  // namespace

Float32Projection FastestFloat32Projection(int threads) { return MeasuredOnce(threads).fastest; }

std::string Float32ProjectionReport(int threads) { return MeasuredOnce(threads).report; }

}  // namespace attention::core

#include "core/cpu/float32_linear.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <random>
#include <vector>

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
  // One kernel set for every row count (issue 55): a decode step's single row gets the bits
  // it would get in a batch of hundreds.
  if (Projection(pool.size()) == Float32Projection::kOneDnn) {
    OneDnn().Forward(x, rows, bias_, y, DType::kFloat32, pool.size());
    return;
  }
  LinearForward(pool, x, rows, in_features_, weight_, bias_, out_features_, y, panels_,
                BestSimdLevel(), std::numeric_limits<int64_t>::max());
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

// Own runs first, after 100 ms of warming up (a process's first ~100 ms of work on both cores
// ran up to 2x slower on a 2-vCPU Zen 3 VM), so that oneDNN's OpenMP threads, which spin for a
// while after each call, never share the cores with its runs; then oneDNN, after two calls
// that make its primitive and threads. Best of four runs each, of a batch and of one row (a
// decode step, which oneDNN's fixed blocks of rows pad to a whole block).
Calibration Calibrate(int threads) {
  constexpr int64_t kRows = 512, kIn = 768, kOut = 2304;  // a BERT-base layer's fused QKV
  constexpr int kRuns = 4;
  constexpr std::chrono::milliseconds kWarmUp(100);
  std::mt19937 rng(39);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> weight(kOut * kIn), x(kRows * kIn), y(kRows * kOut);
  for (float& w : weight) w = uniform(rng);
  for (float& v : x) v = uniform(rng);
  const PackedWeight packed(weight, kOut, kIn);
  ThreadPool pool(threads);
  const Float32Projection candidates[] = {Float32Projection::kOwn, Float32Projection::kOneDnn};
  double best_seconds[] = {std::numeric_limits<double>::max(), std::numeric_limits<double>::max()};
  double one_row_seconds[] = {std::numeric_limits<double>::max(),
                              std::numeric_limits<double>::max()};
  for (int c = 0; c < 2; ++c) {
    const Float32Linear linear(weight, {}, kOut, kIn, packed.panels(), candidates[c]);
    const auto warm_up_start = std::chrono::steady_clock::now();
    for (int call = 0;
         call < 2 || (c == 0 && std::chrono::steady_clock::now() - warm_up_start < kWarmUp);
         ++call) {
      linear.Forward(pool, x.data(), kRows, y.data());
    }
    const auto timed = [&](int64_t rows, double& best) {
      const auto start = std::chrono::steady_clock::now();
      linear.Forward(pool, x.data(), rows, y.data());
      best = std::min(
          best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    };
    for (int run = 0; run < kRuns; ++run) {
      timed(kRows, best_seconds[c]);
      timed(1, one_row_seconds[c]);
    }
  }
  const auto gflops = [&](int c) {
    return static_cast<int64_t>(2.0 * kRows * kIn * kOut / best_seconds[c] / 1e9);
  };
  Calibration calibration;
  // oneDNN only for a clear win (5%) at both sizes, since one set serves every row count: a
  // change of kernels changes float32 layers' last bits, and its OpenMP threads share the
  // cores with the pool's.
  calibration.fastest =
      best_seconds[1] < 0.95 * best_seconds[0] && one_row_seconds[1] < 0.95 * one_row_seconds[0]
          ? candidates[1]
          : candidates[0];
  const std::string own_kernel = absl::StrCat(SimdLevelName(BestSimdLevel()), " microkernel");
  calibration.report = absl::StrCat(
      "onednn ", gflops(1), " GFLOPS (",
      OneDnnMatmul(weight.data(), DType::kFloat32, kOut, kIn, OneDnnMatmul::WeightCopy::kInPlace)
          .implementation(),
      "), own ", gflops(0), " (", own_kernel, "); one row: onednn ",
      static_cast<int64_t>(one_row_seconds[1] * 1e6), " us, own ",
      static_cast<int64_t>(one_row_seconds[0] * 1e6), " us");
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

#include "core/cpu/bf16_linear.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cpu/onednn_matmul.h"
#include "core/dtype.h"
#include "core/half_bits.h"

namespace attention::core {

const char* Bf16ProjectionName(Bf16Projection projection) {
  switch (projection) {
    case Bf16Projection::kOneDnn:
      return "onednn";
    case Bf16Projection::kAvx512Bf16:
      return "avx512_bf16";
    case Bf16Projection::kFloat32:
      return "float32";
    case Bf16Projection::kAmx:
      return "amx";
  }
  return "unknown";
}

absl::StatusOr<Bf16Projection> ParseBf16Projection(absl::string_view name) {
  for (const Bf16Projection projection : kBf16Projections) {
    if (name == Bf16ProjectionName(projection)) return projection;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "bf16 kernel \"", name.substr(0, 64), "\" is not one of onednn, amx, avx512_bf16, float32"));
}

namespace {

// Whether oneDNN implements a bf16 matmul on this CPU at all (2.6 has none for some
// pre-AVX-512 cores); asked once.
bool OneDnnHasBf16Matmul() {
  static const bool has = [] {
    try {
      using dnnl::memory;
      const memory::desc a({4, 64}, memory::data_type::bf16, memory::format_tag::ab);
      const memory::desc b({64, 16}, memory::data_type::bf16, memory::format_tag::any);
      const memory::desc c({4, 16}, memory::data_type::f32, memory::format_tag::ab);
      const dnnl::matmul::primitive_desc probe(dnnl::matmul::desc(a, b, c), OneDnnCpuEngine());
      return probe.get(/*allow_empty=*/true) != nullptr;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return has;
}

}  // namespace

bool CpuSupports(Bf16Projection projection) {
  switch (projection) {
    case Bf16Projection::kOneDnn:
      return OneDnnHasBf16Matmul();
    case Bf16Projection::kAvx512Bf16:
      return CpuSupports(Bf16Kernel::kAvx512Bf16);
    case Bf16Projection::kFloat32:
      return true;
    case Bf16Projection::kAmx:
      return CpuSupports(Bf16Kernel::kAmx);
  }
  return false;
}

Bf16Linear::Bf16Linear(absl::Span<const uint16_t> weight, int64_t out_features, int64_t in_features,
                       Bf16Projection projection)
    : out_features_(out_features), in_features_(in_features) {
  switch (projection) {
    case Bf16Projection::kOneDnn:
      onednn_ =
          std::make_unique<OneDnnMatmul>(weight.data(), DType::kBFloat16, out_features, in_features,
                                         OneDnnMatmul::WeightCopy::kPreferredLayout);
      return;
    case Bf16Projection::kAvx512Bf16:
    case Bf16Projection::kAmx:
      bf16_.emplace(weight, out_features, in_features);
      bf16_kernel_ =
          projection == Bf16Projection::kAmx ? Bf16Kernel::kAmx : Bf16Kernel::kAvx512Bf16;
      return;
    case Bf16Projection::kFloat32:
      break;
  }
  std::vector<float> widened(weight.size());
  for (size_t i = 0; i < weight.size(); ++i) widened[i] = BFloat16ToFloat(weight[i]);
  widened_.emplace(widened, out_features, in_features);
}

Bf16Linear::~Bf16Linear() = default;
Bf16Linear::Bf16Linear(Bf16Linear&&) noexcept = default;

void Bf16Linear::Forward(ThreadPool& pool, const uint16_t* x, int64_t rows,
                         absl::Span<const float> bias, float* y) const {
  if (onednn_ != nullptr) {
    onednn_->Forward(x, rows, bias, y, DType::kFloat32, pool.size());
    return;
  }
  if (bf16_.has_value()) {
    LinearForwardBf16(pool, x, rows, in_features_, *bf16_, bias, out_features_, y, bf16_kernel_);
    return;
  }
  thread_local std::vector<float> widened;
  widened.resize(rows * in_features_);
  // Inline bit shifts, which vectorize: the fallback widens every call's tokens.
  for (int64_t i = 0; i < rows * in_features_; ++i) widened[i] = BFloat16BitsToFloat(x[i]);
  // Always the packed microkernel: the layer holds no float32 weights for OpenBLAS.
  LinearForward(pool, widened.data(), rows, in_features_, {}, bias, out_features_, y,
                widened_->panels(), BestSimdLevel(), std::numeric_limits<int64_t>::max());
}

void Bf16Linear::Forward(ThreadPool& pool, const uint16_t* x, int64_t rows,
                         absl::Span<const float> bias, uint16_t* y) const {
  if (onednn_ != nullptr) {
    onednn_->Forward(x, rows, bias, y, DType::kBFloat16, pool.size());
    return;
  }
  LinearForwardBf16(pool, x, rows, in_features_, *bf16_, bias, out_features_, y, bf16_kernel_);
}

int64_t Bf16Linear::bytes() const {
  if (onednn_ != nullptr) return onednn_->bytes();
  return bf16_.has_value() ? bf16_->bytes() : widened_->bytes();
}

namespace {

struct Calibration {
  Bf16Projection fastest = Bf16Projection::kFloat32;
  std::string report;
};

// Times each kernel on 256 tokens of 1024 -> 1024 features and on one token (a decode step,
// which oneDNN's fixed blocks of rows pad to a whole block), one thread, best of three; the
// fastest at 256 tokens wins, oneDNN only where it is also the fastest at one token, since one
// kernel serves every row count.
Calibration Calibrate() {
  constexpr int64_t kRows = 256, kFeatures = 1024;
  std::mt19937 rng(39);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<uint16_t> weight(kFeatures * kFeatures), x(kRows * kFeatures);
  for (uint16_t& w : weight) w = FloatToBFloat16(uniform(rng));
  for (uint16_t& v : x) v = FloatToBFloat16(uniform(rng));
  std::vector<float> y(kRows * kFeatures);
  ThreadPool one_thread(1);
  Calibration calibration;
  double best_gflops = 0, best_own_gflops = 0;
  double best_one_row_seconds = std::numeric_limits<double>::max();
  Bf16Projection fastest_own = Bf16Projection::kFloat32, fastest_one_row = Bf16Projection::kFloat32;
  for (const Bf16Projection projection : kBf16Projections) {
    if (!CpuSupports(projection)) continue;
    const Bf16Linear linear(weight, kFeatures, kFeatures, projection);
    linear.Forward(one_thread, x.data(), kRows, {}, y.data());  // primitives, pages, caches
    double seconds = std::numeric_limits<double>::max();
    double one_row_seconds = std::numeric_limits<double>::max();
    const auto timed = [&](int64_t rows, double& best) {
      const auto start = std::chrono::steady_clock::now();
      linear.Forward(one_thread, x.data(), rows, {}, y.data());
      best = std::min(
          best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    };
    for (int run = 0; run < 3; ++run) {
      timed(kRows, seconds);
      timed(1, one_row_seconds);
    }
    if (one_row_seconds < best_one_row_seconds) {
      best_one_row_seconds = one_row_seconds;
      fastest_one_row = projection;
    }
    const double gflops = 2.0 * kRows * kFeatures * kFeatures / seconds / 1e9;
    absl::StrAppend(&calibration.report, calibration.report.empty() ? "" : ", ",
                    Bf16ProjectionName(projection), " ", static_cast<int64_t>(gflops),
                    calibration.report.empty() ? " GFLOPS" : "", " (one row ",
                    static_cast<int64_t>(one_row_seconds * 1e6), " us)");
    if (projection == Bf16Projection::kOneDnn) {
      absl::StrAppend(&calibration.report, " (",
                      OneDnnMatmul(weight.data(), DType::kBFloat16, kFeatures, kFeatures,
                                   OneDnnMatmul::WeightCopy::kPreferredLayout)
                          .implementation(),
                      ")");
    }
    if (gflops > best_gflops) {
      best_gflops = gflops;
      calibration.fastest = projection;
    }
    if (projection != Bf16Projection::kOneDnn && gflops > best_own_gflops) {
      best_own_gflops = gflops;
      fastest_own = projection;
    }
  }
  if (calibration.fastest == Bf16Projection::kOneDnn &&
      fastest_one_row != Bf16Projection::kOneDnn) {
    calibration.fastest = fastest_own;
  }
  absl::StrAppend(&calibration.report,
                  "; fastest at one row: ", Bf16ProjectionName(fastest_one_row));
  return calibration;
}

const Calibration& MeasuredOnce() {
  static const Calibration calibration = Calibrate();
  return calibration;
}

}  // namespace

Bf16Projection FastestBf16Projection() { return MeasuredOnce().fastest; }

std::string Bf16ProjectionReport() { return MeasuredOnce().report; }

}  // namespace attention::core

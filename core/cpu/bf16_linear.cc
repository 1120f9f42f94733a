#include "core/cpu/bf16_linear.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/half_bits.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attention::core {

using dnnl::memory;

namespace {

dnnl::engine& CpuEngine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

}  // namespace

// y = x * W^T + bias by oneDNN's matmul primitive, the weight reordered once into the
// blocked layout the primitive prefers. Primitives are made per row count and output type
// (creating one takes about a millisecond) and kept, up to kMaxPrimitives.
class OneDnnBf16Matmul {
 public:
  OneDnnBf16Matmul(absl::Span<const uint16_t> weight, int64_t out_features, int64_t in_features)
      : out_features_(out_features), in_features_(in_features) {
    // W [out][in] row-major is B [in][out] in the "ba" layout.
    const memory::desc plain({in_features, out_features}, memory::data_type::bf16,
                             memory::format_tag::ba);
    weights_desc_ =
        memory::desc({in_features, out_features}, memory::data_type::bf16, memory::format_tag::any);
    const dnnl::matmul::primitive_desc typical = Describe(kTypicalRows, memory::data_type::f32);
    weights_desc_ = typical.weights_desc();
    implementation_ = typical.impl_info_str();
    weights_ = memory(weights_desc_, CpuEngine());
    memory source(plain, CpuEngine(), const_cast<uint16_t*>(weight.data()));
    dnnl::stream stream(CpuEngine());
    dnnl::reorder(source, weights_).execute(stream, source, weights_);
    stream.wait();
  }

  // `y` float32 or bf16 ([rows, out_features]), on `threads` threads.
  void Forward(const uint16_t* x, int64_t rows, absl::Span<const float> bias, void* y,
               memory::data_type y_type, int threads) const {
    if (rows == 0) return;
    const std::shared_ptr<const Cached> cached = Primitive(rows, y_type);
    memory source({{rows, in_features_}, memory::data_type::bf16, memory::format_tag::ab},
                  CpuEngine(), const_cast<uint16_t*>(x));
    memory destination({{rows, out_features_}, y_type, memory::format_tag::ab}, CpuEngine(), y);
    // Without a bias the primitive adds zeros: one primitive per shape serves both.
    thread_local std::vector<float> zeros;
    if (bias.empty()) zeros.resize(out_features_);
    memory bias_memory({{1, out_features_}, memory::data_type::f32, memory::format_tag::ab},
                       CpuEngine(), const_cast<float*>(bias.empty() ? zeros.data() : bias.data()));
    // oneDNN's OpenMP threads: as many as the caller's pool has (one for a group of a batch
    // that runs on one thread).
    omp_set_num_threads(threads);
    // The scratchpad is the caller's: the library's own is shared by concurrent executions.
    thread_local std::vector<std::byte> scratch;
    scratch.resize(cached->scratchpad.get_size());
    memory scratchpad(cached->scratchpad, CpuEngine(), scratch.data());
    thread_local dnnl::stream stream(CpuEngine());
    cached->matmul.execute(stream, {{DNNL_ARG_SRC, source},
                                    {DNNL_ARG_WEIGHTS, weights_},
                                    {DNNL_ARG_BIAS, bias_memory},
                                    {DNNL_ARG_DST, destination},
                                    {DNNL_ARG_SCRATCHPAD, scratchpad}});
    stream.wait();
  }

  int64_t bytes() const { return static_cast<int64_t>(weights_desc_.get_size()); }
  const std::string& implementation() const { return implementation_; }

 private:
  static constexpr int64_t kTypicalRows = 512;
  static constexpr size_t kMaxPrimitives = 64;

  struct Cached {
    dnnl::matmul matmul;
    memory::desc scratchpad;
  };

  dnnl::matmul::primitive_desc Describe(int64_t rows, memory::data_type y_type) const {
    const memory::desc source({rows, in_features_}, memory::data_type::bf16,
                              memory::format_tag::ab);
    const memory::desc bias({1, out_features_}, memory::data_type::f32, memory::format_tag::ab);
    const memory::desc destination({rows, out_features_}, y_type, memory::format_tag::ab);
    dnnl::primitive_attr attributes;
    attributes.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    return dnnl::matmul::primitive_desc(
        dnnl::matmul::desc(source, weights_desc_, bias, destination), attributes, CpuEngine());
  }

  // Shared: a primitive evicted while another thread executes it lives until that ends.
  std::shared_ptr<const Cached> Primitive(int64_t rows, memory::data_type y_type) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto key = std::make_pair(rows, y_type);
    auto found = primitives_.find(key);
    if (found != primitives_.end()) return found->second;
    if (primitives_.size() >= kMaxPrimitives) primitives_.erase(primitives_.begin());
    const dnnl::matmul::primitive_desc description = Describe(rows, y_type);
    auto cached = std::make_shared<const Cached>(
        Cached{dnnl::matmul(description), description.scratchpad_desc()});
    primitives_.emplace(key, cached);
    return cached;
  }

  int64_t out_features_, in_features_;
  memory::desc weights_desc_;
  memory weights_;
  std::string implementation_;
  mutable std::mutex mu_;
  mutable std::map<std::pair<int64_t, memory::data_type>, std::shared_ptr<const Cached>>
      primitives_;
};

const char* Bf16ProjectionName(Bf16Projection projection) {
  switch (projection) {
    case Bf16Projection::kOneDnn:
      return "onednn";
    case Bf16Projection::kAvx512Bf16:
      return "avx512_bf16";
    case Bf16Projection::kFloat32:
      return "float32";
  }
  return "unknown";
}

absl::StatusOr<Bf16Projection> ParseBf16Projection(absl::string_view name) {
  for (const Bf16Projection projection :
       {Bf16Projection::kOneDnn, Bf16Projection::kAvx512Bf16, Bf16Projection::kFloat32}) {
    if (name == Bf16ProjectionName(projection)) return projection;
  }
  return absl::InvalidArgumentError(absl::StrCat("bf16 kernel \"", name.substr(0, 64),
                                                 "\" is not one of onednn, avx512_bf16, float32"));
}

namespace {

// Whether oneDNN implements a bf16 matmul on this CPU at all (2.6 has none for some
// pre-AVX-512 cores); asked once.
bool OneDnnHasBf16Matmul() {
  static const bool has = [] {
    try {
      const memory::desc a({4, 64}, memory::data_type::bf16, memory::format_tag::ab);
      const memory::desc b({64, 16}, memory::data_type::bf16, memory::format_tag::any);
      const memory::desc c({4, 16}, memory::data_type::f32, memory::format_tag::ab);
      const dnnl::matmul::primitive_desc probe(dnnl::matmul::desc(a, b, c), CpuEngine());
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
  }
  return false;
}

Bf16Linear::Bf16Linear(absl::Span<const uint16_t> weight, int64_t out_features, int64_t in_features,
                       Bf16Projection projection)
    : out_features_(out_features), in_features_(in_features) {
  switch (projection) {
    case Bf16Projection::kOneDnn:
      onednn_ = std::make_unique<OneDnnBf16Matmul>(weight, out_features, in_features);
      return;
    case Bf16Projection::kAvx512Bf16:
      bf16_.emplace(weight, out_features, in_features);
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
    onednn_->Forward(x, rows, bias, y, memory::data_type::f32, pool.size());
    return;
  }
  if (bf16_.has_value()) {
    LinearForwardBf16(pool, x, rows, in_features_, *bf16_, bias, out_features_, y);
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
    onednn_->Forward(x, rows, bias, y, memory::data_type::bf16, pool.size());
    return;
  }
  LinearForwardBf16(pool, x, rows, in_features_, *bf16_, bias, out_features_, y);
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

// Times each kernel on 256 tokens of 1024 -> 1024 features, one thread, best of three.
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
  double best_gflops = 0;
  for (const Bf16Projection projection :
       {Bf16Projection::kOneDnn, Bf16Projection::kAvx512Bf16, Bf16Projection::kFloat32}) {
    if (!CpuSupports(projection)) continue;
    const Bf16Linear linear(weight, kFeatures, kFeatures, projection);
    linear.Forward(one_thread, x.data(), kRows, {}, y.data());  // primitives, pages, caches
    double seconds = std::numeric_limits<double>::max();
    for (int run = 0; run < 3; ++run) {
      const auto start = std::chrono::steady_clock::now();
      linear.Forward(one_thread, x.data(), kRows, {}, y.data());
      seconds = std::min(
          seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    const double gflops = 2.0 * kRows * kFeatures * kFeatures / seconds / 1e9;
    absl::StrAppend(&calibration.report, calibration.report.empty() ? "" : ", ",
                    Bf16ProjectionName(projection), " ", static_cast<int64_t>(gflops),
                    calibration.report.empty() ? " GFLOPS" : "");
    if (projection == Bf16Projection::kOneDnn) {
      absl::StrAppend(&calibration.report, " (",
                      OneDnnBf16Matmul(weight, kFeatures, kFeatures).implementation(), ")");
    }
    if (gflops > best_gflops) {
      best_gflops = gflops;
      calibration.fastest = projection;
    }
  }
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

// FlashAttention's fidelity rule for a fast path (issue 23): its largest error against a
// float64 oracle must stay within twice the largest error of a plain float32 evaluation of
// the same inputs (the textbook loops, in order) plus a floor:
//   max|fast - oracle| <= 2 * max|textbook - oracle| + kFidelityFloor.
// A fixed tolerance would hide a kernel that lost precision; this one moves with the
// problem. FidelityStats also keeps the ratios, so a drift shows in the log before it fails.
#ifndef ATTENTION_TESTS_CORE_FIDELITY_H_
#define ATTENTION_TESTS_CORE_FIDELITY_H_

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "gtest/gtest.h"

namespace attention::core::testing {

inline constexpr double kFidelityFloor = 1e-6;
// bf16's floor as a fraction of the largest value (about one bf16 ulp), and fp16's.
inline constexpr double kBf16FloorFraction = 4e-3;
inline constexpr double kFp16FloorFraction = 5e-4;

// max |values - oracle|; infinity when the sizes differ or a value is not finite where the
// oracle is.
template <typename T>
double MaxError(absl::Span<const T> values, absl::Span<const double> oracle) {
  constexpr double kInfinity = std::numeric_limits<double>::infinity();
  if (values.size() != oracle.size()) return kInfinity;
  double error = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const double difference = std::abs(static_cast<double>(values[i]) - oracle[i]);
    if (std::isnan(difference)) return kInfinity;
    error = std::max(error, difference);
  }
  return error;
}

// Checks the rule on each compared tensor and keeps fast / textbook error ratios.
class FidelityStats {
 public:
  explicit FidelityStats(std::string name) : name_(std::move(name)) {}
  // Prints the ratios' summary, so every run logs where the margin stands.
  ~FidelityStats() { std::printf("%s\n", Summary().c_str()); }

  ::testing::AssertionResult Check(absl::Span<const float> fast, absl::Span<const float> textbook,
                                   absl::Span<const double> oracle) {
    if (fast.empty() && oracle.empty()) return ::testing::AssertionSuccess();  // not asked for
    const double fast_error = MaxError(fast, oracle);
    const double textbook_error = MaxError(textbook, oracle);
    if (textbook_error > 0) ratios_.push_back(fast_error / textbook_error);  // 0: exact answers
    if (fast_error <= 2 * textbook_error + kFidelityFloor) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "max|fast - float64| = " << fast_error << " > 2 * max|float32 textbook - float64| ("
           << textbook_error << ") + " << kFidelityFloor << " over " << oracle.size()
           << " values";
  }

  // Issue 26's rule for bf16: the reference is the same computation in bf16 (PyTorch's
  // bf16 modules, or MhaLayer::ForwardBf16Textbook), and the floor is one bf16 unit in the
  // last place of the largest value, which rounding a correct answer to bf16 costs:
  //   max|fast - oracle| <= 2 * max|reference - oracle| + 4e-3 * max|oracle|.
  ::testing::AssertionResult CheckBf16(absl::Span<const float> fast,
                                       absl::Span<const float> reference,
                                       absl::Span<const double> oracle) {
    return CheckHalf(fast, reference, oracle, core::DType::kBFloat16);
  }
  // The same rule for `dtype`, kBFloat16 or kFloat16 (PyTorch's fp16 computation as the
  // reference, one fp16 unit as the floor).
  ::testing::AssertionResult CheckHalf(absl::Span<const float> fast,
                                       absl::Span<const float> reference,
                                       absl::Span<const double> oracle, core::DType dtype) {
    const double floor_fraction =
        dtype == core::DType::kBFloat16 ? kBf16FloorFraction : kFp16FloorFraction;
    if (fast.empty() && oracle.empty()) return ::testing::AssertionSuccess();
    double largest = 0;
    for (double value : oracle) largest = std::max(largest, std::abs(value));
    const double fast_error = MaxError(fast, oracle);
    const double reference_error = MaxError(reference, oracle);
    if (reference_error > 0) ratios_.push_back(fast_error / reference_error);
    const double allowed = 2 * reference_error + floor_fraction * largest;
    if (fast_error <= allowed) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "max|fast - float64| = " << fast_error << " > 2 * max|" << core::DTypeName(dtype)
           << " reference - float64| (" << reference_error << ") + " << floor_fraction
           << " * max|float64| (" << largest << ") over " << oracle.size() << " values";
  }

  // "name: N tensors, fast/textbook error ratio median M, p99 P, max X".
  std::string Summary() const {
    if (ratios_.empty()) return name_ + ": no tensors compared";
    std::vector<double> sorted = ratios_;
    std::sort(sorted.begin(), sorted.end());
    const auto at = [&sorted](double q) {
      return sorted[std::min(sorted.size() - 1, static_cast<size_t>(q * sorted.size()))];
    };
    return absl::StrFormat("%s: %d tensors, fast/textbook error ratio median %.2f, p99 %.2f, max %.2f",
                           name_, sorted.size(), at(0.5), at(0.99), sorted.back());
  }

 private:
  std::string name_;
  std::vector<double> ratios_;
};

}  // namespace attention::core::testing

#endif  // ATTENTION_TESTS_CORE_FIDELITY_H_

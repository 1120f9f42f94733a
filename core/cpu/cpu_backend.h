// The CPU backend: projections on its own microkernel over weights packed once
// (core/cpu/gemm.h) or on oneDNN, one kernel set per process at every row count, where it
// measured fastest (core/cpu/float32_linear.h, core/cpu/bf16_linear.h), and the blocked
// attention kernel, on a thread pool it owns.
#ifndef ATTENTION_CORE_CPU_CPU_BACKEND_H_
#define ATTENTION_CORE_CPU_CPU_BACKEND_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/cpu/attention_cpu.h"
#include "core/cpu/bf16_linear.h"
#include "core/cpu/float32_linear.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cpu/paged_attention_cpu.h"
#include "core/cpu/thread_pool.h"

namespace attention::core {

// Kernels forced instead of measured (flags, tests and benchmarks); each unset one is the
// host's fastest, measured once per process.
struct CpuKernelChoice {
  // How BFLOAT16 layers multiply attention's products (kPortable: in float32) and project
  // (--bf16_attention_kernels, --bf16_kernels).
  std::optional<Bf16Kernel> bf16_products;
  std::optional<Bf16Projection> bf16_projection;
  // How float32 layers project, at every row count (--float32_kernels).
  std::optional<Float32Projection> float32_projection;
  // How forks of one prefix stepping together in a session step attend what they share
  // (--shared_prefix_products: kAsProducts, which gives up batch invariance for speed).
  SharedPrefixes shared_prefixes = SharedPrefixes::kReadOnce;
  // Where both bf16 choices are float32, bf16 layers run as float32 layers
  // (Bf16ComputesInFloat32); tests turn this off to reach the bf16 layer's own path on
  // every host.
  bool bf16_layers_as_float32 = true;
};

// Thread-safe. Every layer and SDPA call of the backend shares its pool: `num_threads`
// compute threads per forward pass, OpenBLAS single-threaded inside them (see ThreadPool).
class CpuBackend final : public Backend {
 public:
  // num_threads >= 1.
  explicit CpuBackend(int num_threads, const CpuKernelChoice& forced = {})
      : pool_(num_threads),
        bf16_kernel_(forced.bf16_products.value_or(FastestBf16Products())),
        bf16_projection_(forced.bf16_projection.value_or(FastestBf16Projection())),
        float32_projection_(forced.float32_projection),
        shared_prefixes_(forced.shared_prefixes),
        bf16_layers_as_float32_(forced.bf16_layers_as_float32) {}

  const std::string& name() const override { return name_; }
  // Every config and option.
  absl::Status Supports(const MhaConfig& config, const AttentionOptions& options) const override {
    return absl::OkStatus();
  }
  // Packs a copy of the projection weights for few-row batches (counted in the layer's
  // DeviceWeightBytes); large batches compute from the host weights in place.
  absl::StatusOr<std::unique_ptr<PreparedLayer>> Prepare(
      const MhaConfig& config, const MhaWeightsView& weights) const override;
  absl::StatusOr<AttentionResult> ScaledDotProductAttention(const SdpaInput& input) const override;

  int num_threads() const { return pool_.size(); }
  // The compute threads, shared with the decode steps of KV-cache sessions.
  ThreadPool& pool() const { return pool_; }
  // The kernel set OpenBLAS chose for this CPU (or OPENBLAS_CORETYPE forced), e.g.
  // "Haswell", "SkylakeX", "Cooperlake".
  static std::string BlasCore();
  // How this backend's BFLOAT16 layers multiply (for the start-up log): the projection
  // kernel and what the start-up measurement found, then attention's products.
  std::string Bf16Path() const;
  // How float32 layers project (for the start-up log): the kernel set, forced or measured
  // (measuring now if nothing has yet), and what was measured.
  std::string Float32Path() const;
  // Whether BFLOAT16 layers run as float32 layers on their bf16 values: where both the
  // projections and attention's products are fastest on float32 kernels (hosts without
  // bf16 arithmetic), so that a bf16 layer is never slower than a float32 one.
  bool Bf16ComputesInFloat32() const {
    return bf16_layers_as_float32_ && bf16_projection_ == Bf16Projection::kFloat32 &&
           bf16_kernel_ == Bf16Kernel::kPortable;
  }
  // The products of shared prefixes over bf16 KV in KV-cache sessions (PagedDecodeCpu): the
  // kernel of BFLOAT16 layers' attention products, unset where those are float32.
  std::optional<Bf16Kernel> SessionBf16Products() const {
    return SharedPrefixBf16Products(bf16_kernel_);
  }
  // How sessions' forks attend their shared prefixes (PagedDecodeCpu).
  SharedPrefixes SessionSharedPrefixes() const { return shared_prefixes_; }

 private:
  const std::string name_ = "cpu";
  // ParallelFor is thread-safe; mutable because computing does not change the backend.
  mutable ThreadPool pool_;
  const Bf16Kernel bf16_kernel_;
  const Bf16Projection bf16_projection_;
  // Unset: measured when a layer first projects.
  const std::optional<Float32Projection> float32_projection_;
  const SharedPrefixes shared_prefixes_;
  const bool bf16_layers_as_float32_;
};

// cos and sin of the rotary angles of a list of positions, each row head_dim / 2 channels.
class RotaryAngles {
 public:
  RotaryAngles(absl::Span<const int64_t> positions, int64_t head_dim, double base,
               const RopeScaling& scaling);
  // Positions 0 .. count - 1: what every sequence of a batch starts from.
  static RotaryAngles FirstPositions(int64_t count, int64_t head_dim, double base,
                                     const RopeScaling& scaling);

  const float* cos(int64_t row, int64_t half) const { return cos_.data() + row * half; }
  const float* sin(int64_t row, int64_t half) const { return sin_.data() + row * half; }
  double base() const { return base_; }

 private:
  double base_;
  std::vector<float> cos_, sin_;
};

// Rotary position embedding, rotate-half layout (Hugging Face Llama), in place on `rows`
// rows (`row_stride` floats apart) of `heads` heads of width dk; row r is at sequence
// position r % seq_len. `base` comes from RotaryBase (theta unless scaling is dynamic).
void ApplyRotary(float* data, int64_t rows, int64_t seq_len, int64_t heads, int64_t head_dim,
                 double base, int64_t row_stride, const RopeScaling& scaling = {});
// The same with the angles of positions 0 .. seq_len - 1 (at least) given, and with a
// `pool`, rows rotated on its threads.
void ApplyRotary(float* data, int64_t rows, int64_t seq_len, int64_t heads, int64_t head_dim,
                 const RotaryAngles& angles, int64_t row_stride, ThreadPool* pool);
// The same with row r at absolute position positions[r] (a session's new tokens).
void ApplyRotaryAt(float* data, absl::Span<const int64_t> positions, int64_t heads,
                   int64_t head_dim, double base, int64_t row_stride,
                   const RopeScaling& scaling = {});

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_CPU_BACKEND_H_

#include "core/cpu/onednn_matmul.h"

#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>

namespace attention::core {

using dnnl::memory;

dnnl::engine& OneDnnCpuEngine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

namespace {

memory::data_type OneDnnType(DType type) {
  return type == DType::kBFloat16 ? memory::data_type::bf16 : memory::data_type::f32;
}

}  // namespace

OneDnnMatmul::OneDnnMatmul(const void* weight, DType type, int64_t out_features,
                           int64_t in_features, WeightCopy copy)
    : out_features_(out_features),
      in_features_(in_features),
      type_(OneDnnType(type)),
      row_block_(type == DType::kBFloat16 ? kBf16RowBlock : kFloat32RowBlock),
      copy_(copy) {
  // W [out][in] row-major is B [in][out] in the "ba" layout.
  const memory::desc plain({in_features, out_features}, type_, memory::format_tag::ba);
  weights_desc_ = copy == WeightCopy::kInPlace
                      ? plain
                      : memory::desc({in_features, out_features}, type_, memory::format_tag::any);
  const dnnl::matmul::primitive_desc typical = Describe(row_block_, memory::data_type::f32);
  weights_desc_ = typical.weights_desc();
  implementation_ = typical.impl_info_str();
  memory source(plain, OneDnnCpuEngine(), const_cast<void*>(weight));
  if (copy == WeightCopy::kInPlace) {
    weights_ = source;
    return;
  }
  weights_ = memory(weights_desc_, OneDnnCpuEngine());
  dnnl::stream stream(OneDnnCpuEngine());
  dnnl::reorder(source, weights_).execute(stream, source, weights_);
  stream.wait();
}

void OneDnnMatmul::Forward(const void* x, int64_t rows, absl::Span<const float> bias, void* y,
                           DType y_type, int threads) const {
  const int64_t x_bytes = in_features_ * (type_ == memory::data_type::bf16 ? 2 : 4);
  const int64_t y_bytes = out_features_ * (y_type == DType::kBFloat16 ? 2 : 4);
  const auto* x_rows = static_cast<const std::byte*>(x);
  auto* y_rows = static_cast<std::byte*>(y);
  for (int64_t first = 0; first < rows; first += row_block_) {
    const int64_t block = std::min(row_block_, rows - first);
    if (block == row_block_) {
      ForwardBlock(x_rows + first * x_bytes, bias, y_rows + first * y_bytes, y_type, threads);
      continue;
    }
    // The last rows, zero-padded to a whole block: the same primitive computes them.
    thread_local std::vector<std::byte> x_padded, y_padded;
    x_padded.assign(row_block_ * x_bytes, std::byte{0});
    y_padded.resize(row_block_ * y_bytes);
    std::memcpy(x_padded.data(), x_rows + first * x_bytes, block * x_bytes);
    ForwardBlock(x_padded.data(), bias, y_padded.data(), y_type, threads);
    std::memcpy(y_rows + first * y_bytes, y_padded.data(), block * y_bytes);
  }
}

void OneDnnMatmul::ForwardBlock(const void* x, absl::Span<const float> bias, void* y, DType y_type,
                                int threads) const {
  const memory::data_type y_data_type = OneDnnType(y_type);
  const std::shared_ptr<const Cached> cached = Primitive(y_data_type);
  memory source({{row_block_, in_features_}, type_, memory::format_tag::ab}, OneDnnCpuEngine(),
                const_cast<void*>(x));
  memory destination({{row_block_, out_features_}, y_data_type, memory::format_tag::ab},
                     OneDnnCpuEngine(), y);
  // Without a bias the primitive adds zeros: one primitive per shape serves both.
  thread_local std::vector<float> zeros;
  if (bias.empty() && zeros.size() < static_cast<size_t>(out_features_)) {
    zeros.assign(out_features_, 0.0f);
  }
  memory bias_memory({{1, out_features_}, memory::data_type::f32, memory::format_tag::ab},
                     OneDnnCpuEngine(),
                     const_cast<float*>(bias.empty() ? zeros.data() : bias.data()));
  // oneDNN's OpenMP threads: as many as the caller's pool has.
  omp_set_num_threads(threads);
  // The scratchpad is the caller's: the library's own is shared by concurrent executions.
  thread_local std::vector<std::byte> scratch;
  scratch.resize(cached->scratchpad.get_size());
  memory scratchpad(cached->scratchpad, OneDnnCpuEngine(), scratch.data());
  thread_local dnnl::stream stream(OneDnnCpuEngine());
  cached->matmul.execute(stream, {{DNNL_ARG_SRC, source},
                                  {DNNL_ARG_WEIGHTS, weights_},
                                  {DNNL_ARG_BIAS, bias_memory},
                                  {DNNL_ARG_DST, destination},
                                  {DNNL_ARG_SCRATCHPAD, scratchpad}});
  stream.wait();
}

int64_t OneDnnMatmul::bytes() const {
  return copy_ == WeightCopy::kInPlace ? 0 : static_cast<int64_t>(weights_desc_.get_size());
}

dnnl::matmul::primitive_desc OneDnnMatmul::Describe(int64_t rows, memory::data_type y_type) const {
  const memory::desc source({rows, in_features_}, type_, memory::format_tag::ab);
  const memory::desc bias({1, out_features_}, memory::data_type::f32, memory::format_tag::ab);
  const memory::desc destination({rows, out_features_}, y_type, memory::format_tag::ab);
  dnnl::primitive_attr attributes;
  attributes.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(source, weights_desc_, bias, destination),
                                      attributes, OneDnnCpuEngine());
}

std::shared_ptr<const OneDnnMatmul::Cached> OneDnnMatmul::Primitive(
    memory::data_type y_type) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = primitives_.find(y_type);
  if (found != primitives_.end()) return found->second;
  const dnnl::matmul::primitive_desc description = Describe(row_block_, y_type);
  auto cached = std::make_shared<const Cached>(
      Cached{dnnl::matmul(description), description.scratchpad_desc()});
  primitives_.emplace(y_type, cached);
  return cached;
}

}  // namespace attention::core

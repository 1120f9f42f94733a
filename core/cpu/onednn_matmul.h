// One Linear (y = x * W^T + bias) on Debian's oneDNN matmul primitive, on oneDNN's OpenMP
// threads: the projections of bf16 layers (AMX tiles where the Xeon has them) and, where it
// measured faster than the project's own kernels, of float32 layers (core/cpu/float32_linear.h).
#ifndef ATTENTION_CORE_CPU_ONEDNN_MATMUL_H_
#define ATTENTION_CORE_CPU_ONEDNN_MATMUL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/types/span.h"
#include "core/dtype.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attention::core {

// The process's oneDNN CPU engine, made once.
dnnl::engine& OneDnnCpuEngine();

class OneDnnMatmul {
 public:
  // Rows of the one shape every call runs: oneDNN picks kernels, blockings and thread splits
  // by shape, so a primitive per row count gave a token other bits beside more tokens (and a
  // runtime row count did too). Against a primitive per row count, on a Xeon with AMX (model
  // 167): float32 layers ran at 0.89-1.00 in blocks of 256 rows (0.64-0.74 in blocks of 32);
  // bf16 layers, whose groups of 64+ rows each pad their last block, at 0.79-0.88 in blocks of
  // 32 (0.4 in blocks of 256; 64 ran faster but raised SIGILL, a tile load in oneDNN 2.6's AMX
  // kernel, on small bf16 layers run in groups).
  static constexpr int64_t kFloat32RowBlock = 256;
  static constexpr int64_t kBf16RowBlock = 32;

  // Where the weight lives: copied once into the blocked layout the primitive prefers, or
  // read where the caller keeps it (no memory of its own; the weight must outlive this).
  enum class WeightCopy { kPreferredLayout, kInPlace };

  // `weight`: W [out_features][in_features] row-major, of `type` (kFloat32 or kBFloat16);
  // the tokens x are of `type` too.
  OneDnnMatmul(const void* weight, DType type, int64_t out_features, int64_t in_features,
               WeightCopy copy);

  // y [rows, out_features] of `y_type` (kFloat32, or kBFloat16 rounded as written) = x *
  // W^T + bias (empty: none), on `threads` OpenMP threads. Batch-invariant: every block of
  // row_block() rows runs on the one primitive of that shape (the last block zero-padded), so
  // a row's bits never depend on how many rows came with it.
  void Forward(const void* x, int64_t rows, absl::Span<const float> bias, void* y, DType y_type,
               int threads) const;

  // kFloat32RowBlock or kBf16RowBlock, by the weight's type.
  int64_t row_block() const { return row_block_; }
  // The weight's copy (0 in place).
  int64_t bytes() const;
  // The implementation oneDNN picked for this CPU, e.g. "brg:avx512_core_amx_bf16" or
  // "gemm:jit".
  const std::string& implementation() const { return implementation_; }

 private:
  struct Cached {
    dnnl::matmul matmul;
    dnnl::memory::desc scratchpad;
  };

  dnnl::matmul::primitive_desc Describe(int64_t rows, dnnl::memory::data_type y_type) const;
  // The primitive of row_block() rows for an output type, made on first use (about a
  // millisecond) and kept.
  std::shared_ptr<const Cached> Primitive(dnnl::memory::data_type y_type) const;
  // One block of row_block() rows.
  void ForwardBlock(const void* x, absl::Span<const float> bias, void* y, DType y_type,
                    int threads) const;

  const int64_t out_features_, in_features_;
  const dnnl::memory::data_type type_;
  const int64_t row_block_;
  const WeightCopy copy_;
  dnnl::memory::desc weights_desc_;
  dnnl::memory weights_;
  std::string implementation_;
  mutable std::mutex mu_;
  mutable std::map<dnnl::memory::data_type, std::shared_ptr<const Cached>> primitives_;
};

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_ONEDNN_MATMUL_H_

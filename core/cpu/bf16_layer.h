// BFLOAT16 layers on the CPU backend (MhaConfig::compute_dtype): the projections multiply
// bf16 tokens by bf16 weights with float32 accumulation (core/cpu/bf16_linear.h); RoPE,
// softmax and attention run in float32 as in float32 layers.
#ifndef ATTENTION_CORE_CPU_BF16_LAYER_H_
#define ATTENTION_CORE_CPU_BF16_LAYER_H_

#include <memory>

#include "core/backend.h"
#include "core/cpu/bf16_linear.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cpu/thread_pool.h"

namespace attention::core {

// Packs the bf16 weights of `weights` (MhaWeightsView::bf16) for `projection`
// (core/cpu/bf16_linear.h); attention's products run on `kernel` (bf16 dot products for
// kAvx512Bf16, float32 products of the same bf16 values for kPortable). `weights` must
// outlive the layer.
std::unique_ptr<PreparedLayer> PrepareBf16Layer(const MhaConfig& config,
                                                const MhaWeightsView& weights, ThreadPool& pool,
                                                Bf16Kernel kernel, Bf16Projection projection);

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_BF16_LAYER_H_

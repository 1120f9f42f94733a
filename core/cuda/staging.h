// How one call's arrays travel: laid out in an Arena so that its inputs go host -> device in
// one copy and its outputs come back in one, with the masks and attention weights of each
// attention problem placed beside them.
#ifndef ATTENTION_CORE_CUDA_STAGING_H_
#define ATTENTION_CORE_CUDA_STAGING_H_

#include <cstdint>
#include <vector>

#include "core/attention_kernels.h"
#include "core/attention_options.h"
#include "core/cuda/device_buffer.h"
#include "core/cuda/kernels.h"

namespace attention::core::cuda {

// The two copies of one call: its inputs sit at the start of the staging and device buffers
// and go over in one copy; its outputs sit together at the end and come back in one.
struct Staged {
  int64_t input_bytes = 0;    // [0, input_bytes) is copied host -> device
  int64_t output_offset = 0;  // [output_offset, output_offset + output_bytes) comes back
  int64_t output_bytes = 0;
};

// The masks of `options`, to be copied into staging at the given offsets.
struct StagedMask {
  int64_t key_lengths = -1, key_padding = -1, mask_keep = -1, mask_bias = -1;

  void Plan(const AttentionOptions& o, Arena& arena);
  void Stage(const AttentionOptions& o, char* staging) const;
  // The options' masks with pointers into the device copy at `device`.
  MaskView View(const AttentionOptions& o, const AttentionDims& dims, char* device) const;
};

// The attention weights and row statistics of one problem, when asked.
struct StagedWeights {
  int64_t weights = -1, row_max = -1, row_sum = -1;
  int64_t count = 0;

  void PlanOutput(const AttentionDims& d, NeedWeights need, Arena& arena);
  void PlanScratch(const AttentionDims& d, NeedWeights need, Arena& arena);
  void Attach(char* device, DeviceAttentionProblem& problem) const;
  void CopyOut(const char* staging, std::vector<float>& out) const;
};

// `problem` (its arrays already in device memory) for the kernels, with its staged mask and
// weights at `device`.
DeviceAttentionProblem ToDeviceProblem(const AttentionProblem& problem, const StagedMask& mask,
                                       const StagedWeights& weights, char* device);

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_STAGING_H_

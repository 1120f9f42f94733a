// Scaled dot-product attention of one request on the GPU: its tensors (by several host
// threads) and masks copied in at once, the attention kernel, the output and weights copied
// back at once.
#include <cuda_runtime.h>

#include "core/attention_kernels.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/device_backend.h"
#include "core/cuda/staging.h"
#include "core/status_macros.h"

namespace attention::core::cuda {

absl::StatusOr<AttentionResult> CudaBackend::ScaledDotProductAttention(const SdpaInput& in) const {
  const AttentionDims& d = in.dims;
  Arena arena;
  const int64_t q_at = arena.Add(in.query.size() * sizeof(float));
  const int64_t k_at = arena.Add(in.key.size() * sizeof(float));
  const int64_t v_at = arena.Add(in.value.size() * sizeof(float));
  StagedMask mask;
  mask.Plan(in.options, arena);
  Staged staged;
  staged.input_bytes = arena.size();
  StagedWeights weights;
  weights.PlanScratch(d, in.options.need_weights, arena);
  staged.output_offset = arena.Add(0);
  const int64_t output_count = d.batch * d.num_heads * d.q_len * d.v_head_dim;
  const int64_t output_at = arena.Add(output_count * sizeof(float));
  weights.PlanOutput(d, in.options.need_weights, arena);
  staged.output_bytes = arena.size() - staged.output_offset;

  ASSIGN_OR_RETURN(StreamContext * context, Context());
  ASSIGN_OR_RETURN(char* device, context->device.Reserve(arena.size()));
  ASSIGN_OR_RETURN(char* staging, context->staging.Reserve(arena.size()));
  ParallelCopy(host_copies_, staging + q_at, in.query.data(), in.query.size() * sizeof(float));
  ParallelCopy(host_copies_, staging + k_at, in.key.data(), in.key.size() * sizeof(float));
  ParallelCopy(host_copies_, staging + v_at, in.value.data(), in.value.size() * sizeof(float));
  mask.Stage(in.options, staging);
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(device, staging, staged.input_bytes, cudaMemcpyHostToDevice, context->stream),
      "cudaMemcpyAsync(inputs)"));
  auto on_device = [device](int64_t at) { return reinterpret_cast<float*>(device + at); };
  const AttentionProblem problem = SdpaProblem<float>(
      in, on_device(q_at), on_device(k_at), on_device(v_at), on_device(output_at), nullptr);
  RETURN_IF_ERROR(Attend(ToDeviceProblem(problem, mask, weights, device), *context));
  RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(staging + staged.output_offset, device + staged.output_offset,
                                 staged.output_bytes, cudaMemcpyDeviceToHost, context->stream),
                 "cudaMemcpyAsync(outputs)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(context->stream), "attention"));
  AttentionResult result;
  const float* output = reinterpret_cast<const float*>(staging + output_at);
  result.output.assign(output, output + output_count);
  weights.CopyOut(staging, result.weights);
  FinishWeights(result, d, in.options.need_weights);
  return result;
}

}  // namespace attention::core::cuda

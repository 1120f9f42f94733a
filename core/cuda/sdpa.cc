// Scaled dot-product attention of one request on the GPU: its tensors (by several host
// threads) and masks copied in at once, the attention kernel, the output and weights copied
// back at once. A call that moves many megabytes runs as chunks of whole sequences on two
// streams (copy_overlap_plan.h), so that one chunk's copies overlap another's compute.
#include <array>
#include <optional>
#include <vector>

#include <cuda_runtime.h>

#include "core/attention_kernels.h"
#include "core/cuda/copy_overlap_plan.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/device_backend.h"
#include "core/cuda/staging.h"
#include "core/mha_layer.h"
#include "core/status_macros.h"

namespace attention::core::cuda {
namespace {

// One call (or chunk of one) enqueued on a stream: where its answers arrive in staging.
struct SdpaFlight {
  StreamContext* context = nullptr;
  const char* staging = nullptr;
  StagedWeights weights;
  int64_t output_at = 0;
  int64_t output_count = 0;
};

// Stages `in`, copies it to the device, attends and copies the answers back, all on
// `context`'s stream; nothing waits for the stream.
absl::StatusOr<SdpaFlight> EnqueueSdpa(const CudaBackend& backend, const SdpaInput& in,
                                       StreamContext& context) {
  const AttentionDims& d = in.dims;
  Arena arena;
  const int64_t q_at = arena.Add(in.query.size() * sizeof(float));
  const int64_t k_at = arena.Add(in.key.size() * sizeof(float));
  const int64_t v_at = arena.Add(in.value.size() * sizeof(float));
  StagedMask mask;
  mask.Plan(in.options, arena);
  Staged staged;
  staged.input_bytes = arena.size();
  SdpaFlight flight;
  flight.context = &context;
  flight.weights.PlanScratch(d, in.options.need_weights, arena);
  staged.output_offset = arena.Add(0);
  flight.output_count = d.batch * d.num_heads * d.q_len * d.v_head_dim;
  flight.output_at = arena.Add(flight.output_count * sizeof(float));
  flight.weights.PlanOutput(d, in.options.need_weights, arena);
  staged.output_bytes = arena.size() - staged.output_offset;

  ASSIGN_OR_RETURN(char* device, context.device.Reserve(arena.size()));
  ASSIGN_OR_RETURN(char* staging, context.staging.Reserve(arena.size()));
  flight.staging = staging;
  ThreadPool& copiers = backend.host_copies();
  ParallelCopy(copiers, staging + q_at, in.query.data(), in.query.size() * sizeof(float));
  ParallelCopy(copiers, staging + k_at, in.key.data(), in.key.size() * sizeof(float));
  ParallelCopy(copiers, staging + v_at, in.value.data(), in.value.size() * sizeof(float));
  mask.Stage(in.options, staging);
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(device, staging, staged.input_bytes, cudaMemcpyHostToDevice, context.stream),
      "cudaMemcpyAsync(inputs)"));
  auto on_device = [device](int64_t at) { return reinterpret_cast<float*>(device + at); };
  const AttentionProblem problem = SdpaProblem<float>(
      in, on_device(q_at), on_device(k_at), on_device(v_at), on_device(flight.output_at), nullptr);
  RETURN_IF_ERROR(backend.Attend(ToDeviceProblem(problem, mask, flight.weights, device), context));
  RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(staging + staged.output_offset, device + staged.output_offset,
                                 staged.output_bytes, cudaMemcpyDeviceToHost, context.stream),
                 "cudaMemcpyAsync(outputs)"));
  return flight;
}

// Waits for `flight`: its output_count floats of output are then at the pointer returned.
absl::StatusOr<const float*> ReceiveSdpa(const SdpaFlight& flight) {
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(flight.context->stream), "attention"));
  return reinterpret_cast<const float*>(flight.staging + flight.output_at);
}

}  // namespace

absl::StatusOr<AttentionResult> CudaBackend::ScaledDotProductAttention(const SdpaInput& in) const {
  const AttentionDims& d = in.dims;
  AttentionResult result;
  ASSIGN_OR_RETURN(StreamContext * first_lane, Context(0));
  const std::vector<size_t> chunks =
      CopyOverlapEnabled() ? PlanCopyOverlap(SdpaOverlapPartBytes(in)) : std::vector<size_t>{0};
  if (chunks.size() == 1) {
    ASSIGN_OR_RETURN(const SdpaFlight flight, EnqueueSdpa(*this, in, *first_lane));
    ASSIGN_OR_RETURN(const float* output, ReceiveSdpa(flight));
    result.output.assign(output, output + flight.output_count);
    flight.weights.CopyOut(flight.staging, result.weights);
    FinishWeights(result, d, in.options.need_weights);
    return result;
  }
  // Chunks of whole sequences alternate between two streams, as a layer's forward pass does
  // (prepared_layer.cc): chunk i + 1 is staged and copied in while chunk i computes.
  ASSIGN_OR_RETURN(StreamContext * second_lane, Context(1));
  const std::array<StreamContext*, 2> lanes = {first_lane, second_lane};
  const int64_t sequence_output = d.num_heads * d.q_len * d.v_head_dim;
  result.output.resize(d.batch * sequence_output);
  std::vector<std::optional<SdpaFlight>> flights(chunks.size());
  const absl::Status status = RunOverlappedChunks(
      chunks.size(),
      [&](size_t chunk, int lane) -> absl::Status {
        const auto first = static_cast<int64_t>(chunks[chunk]);
        const int64_t end =
            chunk + 1 < chunks.size() ? static_cast<int64_t>(chunks[chunk + 1]) : d.batch;
        ASSIGN_OR_RETURN(flights[chunk],
                         EnqueueSdpa(*this, SdpaSequences(in, first, end - first), *lanes[lane]));
        return absl::OkStatus();
      },
      [&](size_t chunk) -> absl::Status {
        ASSIGN_OR_RETURN(const float* output, ReceiveSdpa(*flights[chunk]));
        ParallelCopy(host_copies_,
                     result.output.data() + static_cast<int64_t>(chunks[chunk]) * sequence_output,
                     output, flights[chunk]->output_count * sizeof(float));
        flights[chunk].reset();
        return absl::OkStatus();
      });
  if (!status.ok()) {
    // Nothing of this call may still run once it returns.
    for (StreamContext* lane : lanes) cudaStreamSynchronize(lane->stream);
    return status;
  }
  return result;
}

}  // namespace attention::core::cuda

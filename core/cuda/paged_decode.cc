#include "core/cuda/paged_decode.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda/paged_decode_kernels.h"
#include "core/cuda/paged_decode_plan.h"

namespace attention::core::cuda {
namespace {

// As cuda_status.h's CudaStatus (not linked here: that file also needs cuBLAS).
absl::Status Cuda(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat("paged decode: ", what, ": ", cudaGetErrorString(error));
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

PagedDecodeDims Dims(const PagedDecodeBatch& batch) {
  PagedDecodeDims d;
  d.num_heads = batch.num_heads;
  d.num_kv_heads = batch.layout.num_kv_heads;
  d.key_dim = batch.layout.key_dim;
  d.value_dim = batch.layout.value_dim;
  d.element_bytes = batch.layout.ElementBytes();
  d.tokens_per_block = batch.tokens_per_block;
  d.block_bytes = batch.storage.block_bytes;
  d.storage_address = reinterpret_cast<uintptr_t>(batch.storage.data);
  d.sliding_window = batch.sliding_window;
  return d;
}

std::vector<PagedSequenceDims> SequenceDims(const PagedDecodeBatch& batch) {
  std::vector<PagedSequenceDims> dims;
  dims.reserve(batch.sequences.size());
  for (const PagedDecodeSequence& s : batch.sequences) dims.push_back({s.length, s.num_queries});
  return dims;
}

// Validation, then the plan; INVALID_ARGUMENT for what the kernels cannot run.
absl::StatusOr<PagedDecodePlan> Plan(const PagedDecodeBatch& batch) {
  // Block ids live on the device: one outside the storage reads as NaN (see the header).
  if (absl::Status status = ValidatePagedDecodeBatch(batch, /*check_block_ids=*/false);
      !status.ok()) {
    return status;
  }
  int device = 0, max_shared = 0;
  if (absl::Status status = Cuda(cudaGetDevice(&device), "cudaGetDevice"); !status.ok()) {
    return status;
  }
  if (absl::Status status =
          Cuda(cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "cudaDeviceGetAttribute");
      !status.ok()) {
    return status;
  }
  const PagedDecodeDims dims = Dims(batch);
  const std::vector<PagedSequenceDims> sequences = SequenceDims(batch);
  if (std::string why = PagedDecodeUnsupportedReason(dims, sequences, max_shared); !why.empty()) {
    return absl::InvalidArgumentError(why);
  }
  return PlanPagedDecode(dims, sequences);
}

absl::Status Launch(const PagedDecodeBatch& batch, const PagedDecodePlan& plan, float* states,
                    cudaStream_t stream) {
  constexpr int64_t kInt32Max = (int64_t{1} << 31) - 1;
  PagedDeviceLaunch launch;
  launch.storage = batch.storage.data;
  launch.block_bytes = batch.storage.block_bytes;
  launch.num_blocks = static_cast<int32_t>(std::min(batch.storage.num_blocks, kInt32Max));
  launch.tokens_per_block = static_cast<int32_t>(std::min(batch.tokens_per_block, kInt32Max));
  launch.num_heads = static_cast<int32_t>(batch.num_heads);
  launch.num_kv_heads = static_cast<int32_t>(batch.layout.num_kv_heads);
  launch.key_dim = static_cast<int32_t>(batch.layout.key_dim);
  launch.value_dim = static_cast<int32_t>(batch.layout.value_dim);
  // A window at least as long as any sequence (< 2^31 keys) hides nothing.
  launch.sliding_window =
      static_cast<int32_t>(batch.sliding_window > kInt32Max - 1 ? 0 : batch.sliding_window);
  launch.scale = batch.scale;
  launch.bfloat16 = batch.layout.dtype == DType::kBFloat16;
  launch.states = states;
  for (const PagedLaunch& blocks : plan.launches) {
    launch.count = static_cast<int32_t>(blocks.count);
    for (int64_t k = 0; k < blocks.count; ++k) {
      const int64_t b = blocks.first_sequence + k;
      const PagedDecodeSequence& s = batch.sequences[b];
      const PagedSequencePlan& p = plan.sequences[b];
      PagedDeviceSequence& d = launch.sequences[k];
      d.block_table = s.block_table.data();
      d.query = s.query;
      d.output = s.output;
      d.log_sum_exp = s.log_sum_exp;
      d.length = static_cast<int32_t>(s.length);
      d.num_queries = static_cast<int32_t>(s.num_queries);
      d.first_split = static_cast<int32_t>(p.first_split);
      d.run_splits = static_cast<int32_t>(p.run_splits);
      d.row_chunks = static_cast<int32_t>(p.row_chunks);
      d.rows = static_cast<int32_t>(p.rows);
      d.split_block_begin = p.split_block_begin;
      d.merge_block_begin = p.merge_block_begin;
      d.state_offset = p.state_offset;
    }
    if (absl::Status status =
            Cuda(LaunchPagedDecode(launch, plan, blocks, stream), "kernel launch");
        !status.ok()) {
      return status;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> PagedDecodeCudaScratchBytes(const PagedDecodeBatch& batch) {
  absl::StatusOr<PagedDecodePlan> plan = Plan(batch);
  if (!plan.ok()) return plan.status();
  return plan->scratch_bytes;
}

absl::Status PagedDecodeCuda(const PagedDecodeBatch& batch, void* scratch, int64_t scratch_bytes,
                             cudaStream_t stream) {
  absl::StatusOr<PagedDecodePlan> plan = Plan(batch);
  if (!plan.ok()) return plan.status();
  if (plan->scratch_bytes > scratch_bytes || (plan->scratch_bytes > 0 && scratch == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("paged decode: scratch_bytes ", scratch_bytes,
                                                   " < the ", plan->scratch_bytes, " needed"));
  }
  if (batch.sequences.empty()) return absl::OkStatus();
  return Launch(batch, *plan, static_cast<float*>(scratch), stream);
}

absl::Status PagedDecodeCuda(const PagedDecodeBatch& batch, cudaStream_t stream) {
  absl::StatusOr<PagedDecodePlan> plan = Plan(batch);
  if (!plan.ok()) return plan.status();
  if (batch.sequences.empty()) return absl::OkStatus();
  void* scratch = nullptr;
  if (absl::Status status = Cuda(cudaMallocAsync(&scratch, plan->scratch_bytes, stream),
                                 absl::StrCat("cudaMallocAsync(", plan->scratch_bytes, " bytes)"));
      !status.ok()) {
    return status;
  }
  absl::Status status = Launch(batch, *plan, static_cast<float*>(scratch), stream);
  // Freed once the stream passes the kernels, even after a failed launch.
  const absl::Status freed = Cuda(cudaFreeAsync(scratch, stream), "cudaFreeAsync");
  return status.ok() ? freed : status;
}

}  // namespace attention::core::cuda

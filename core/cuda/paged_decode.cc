#include "core/cuda/paged_decode.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/cuda/paged_decode_kernels.h"
#include "core/cuda/paged_decode_plan.h"
#include "core/status_macros.h"

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

std::vector<PagedSharedGroupDims> GroupDims(absl::Span<const SharedPrefixGroup> shared) {
  std::vector<PagedSharedGroupDims> groups;
  groups.reserve(shared.size());
  for (const SharedPrefixGroup& g : shared) groups.push_back({g.sequences, g.shared_keys});
  return groups;
}

// INVALID_ARGUMENT unless each group's members' queries follow one another in device memory.
absl::Status CheckContiguousQueries(const PagedDecodeBatch& batch,
                                    absl::Span<const SharedPrefixGroup> shared) {
  const int64_t row_floats = batch.num_heads * batch.layout.key_dim;
  for (size_t g = 0; g < shared.size(); ++g) {
    const std::vector<int64_t>& members = shared[g].sequences;
    for (size_t m = 1; m < members.size(); ++m) {
      const PagedDecodeSequence& before = batch.sequences[members[m - 1]];
      if (batch.sequences[members[m]].query != before.query + before.num_queries * row_floats) {
        return absl::InvalidArgumentError(
            absl::StrCat("paged decode: shared group ", g, ": the queries of sequence ", members[m],
                         " do not follow those of sequence ", members[m - 1]));
      }
    }
  }
  return absl::OkStatus();
}

// Validation, then the plan; INVALID_ARGUMENT for what the kernels cannot run.
absl::StatusOr<PagedDecodePlan> Plan(const PagedDecodeBatch& batch,
                                     absl::Span<const SharedPrefixGroup> shared) {
  // Block ids live on the device: one outside the storage reads as NaN (see the header).
  RETURN_IF_ERROR(ValidatePagedDecodeBatch(batch, /*check_block_ids=*/false));
  const PagedDecodeDims dims = Dims(batch);
  const std::vector<PagedSequenceDims> sequences = SequenceDims(batch);
  const std::vector<PagedSharedGroupDims> groups = GroupDims(shared);
  if (std::string why = PagedSharedGroupsInvalidReason(dims, sequences, groups); !why.empty()) {
    return absl::InvalidArgumentError(why);
  }
  RETURN_IF_ERROR(CheckContiguousQueries(batch, shared));
  int device = 0, max_shared = 0;
  RETURN_IF_ERROR(Cuda(cudaGetDevice(&device), "cudaGetDevice"));
  RETURN_IF_ERROR(
      Cuda(cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
           "cudaDeviceGetAttribute"));
  if (std::string why = PagedDecodeUnsupportedReason(dims, sequences, max_shared, groups);
      !why.empty()) {
    return absl::InvalidArgumentError(why);
  }
  return PlanPagedDecode(dims, sequences, groups);
}

absl::Status Launch(const PagedDecodeBatch& batch, absl::Span<const SharedPrefixGroup> shared,
                    const PagedDecodePlan& plan, float* states, cudaStream_t stream) {
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
  const int64_t num_sequences = static_cast<int64_t>(batch.sequences.size());
  // The entries of `blocks` into the launch's parameter.
  const auto fill = [&](const PagedLaunch& blocks) {
    launch.count = static_cast<int32_t>(blocks.count);
    for (int64_t k = 0; k < blocks.count; ++k) {
      const int64_t b = blocks.first_sequence + k;
      const PagedSequencePlan& p = plan.sequences[b];
      PagedDeviceSequence& d = launch.sequences[k];
      d = PagedDeviceSequence{};
      if (b < num_sequences) {
        const PagedDecodeSequence& s = batch.sequences[b];
        d.block_table = s.block_table.data();
        d.query = s.query;
        d.output = s.output;
        d.log_sum_exp = s.log_sum_exp;
        d.length = static_cast<int32_t>(s.length);
        d.num_queries = static_cast<int32_t>(s.num_queries);
      } else {  // a group entry: its first member's blocks, every member's queries from there
        const SharedPrefixGroup& group = shared[b - num_sequences];
        const PagedDecodeSequence& first = batch.sequences[group.sequences.front()];
        const int64_t queries = p.rows / (batch.num_heads / batch.layout.num_kv_heads);
        const PagedSequenceDims dims = PagedSharedGroupSequence(group.shared_keys, queries);
        d.block_table = first.block_table.data();
        d.query = first.query;
        d.length = static_cast<int32_t>(dims.length);
        d.num_queries = static_cast<int32_t>(dims.num_queries);
      }
      d.first_split = static_cast<int32_t>(p.first_split);
      d.run_splits = static_cast<int32_t>(p.run_splits);
      d.row_chunks = static_cast<int32_t>(p.row_chunks);
      d.rows = static_cast<int32_t>(p.rows);
      d.split_block_begin = p.split_block_begin;
      d.merge_block_begin = p.merge_block_begin;
      d.state_offset = p.state_offset;
      d.shared_splits = static_cast<int32_t>(p.shared_splits);
      d.shared_rows = static_cast<int32_t>(p.shared_rows);
      d.shared_first_row = static_cast<int32_t>(p.shared_first_row);
      d.shared_state_offset = p.shared_state_offset;
    }
  };
  // Every split first: a member's merge reads its group entry's states.
  for (const PagedLaunch& blocks : plan.launches) {
    fill(blocks);
    RETURN_IF_ERROR(Cuda(LaunchPagedSplits(launch, plan, blocks, stream), "split kernel launch"));
  }
  for (const PagedLaunch& blocks : plan.launches) {
    fill(blocks);
    RETURN_IF_ERROR(Cuda(LaunchPagedMerge(launch, blocks, stream), "merge kernel launch"));
  }
  if (batch.stats != nullptr) {  // as PagedDecodeCpu counts them
    for (const SharedPrefixGroup& group : shared) {
      batch.stats->shared_blocks +=
          (group.shared_keys + batch.tokens_per_block - 1) / batch.tokens_per_block;
      batch.stats->keys_not_reread +=
          group.shared_keys * static_cast<int64_t>(group.sequences.size() - 1);
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> PagedDecodeCudaScratchBytes(const PagedDecodeBatch& batch,
                                                    absl::Span<const SharedPrefixGroup> shared) {
  absl::StatusOr<PagedDecodePlan> plan = Plan(batch, shared);
  if (!plan.ok()) return plan.status();
  return plan->scratch_bytes;
}

absl::Status PagedDecodeCuda(const PagedDecodeBatch& batch, void* scratch, int64_t scratch_bytes,
                             cudaStream_t stream, absl::Span<const SharedPrefixGroup> shared) {
  absl::StatusOr<PagedDecodePlan> plan = Plan(batch, shared);
  if (!plan.ok()) return plan.status();
  if (plan->scratch_bytes > scratch_bytes || (plan->scratch_bytes > 0 && scratch == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("paged decode: scratch_bytes ", scratch_bytes,
                                                   " < the ", plan->scratch_bytes, " needed"));
  }
  if (batch.sequences.empty()) return absl::OkStatus();
  return Launch(batch, shared, *plan, static_cast<float*>(scratch), stream);
}

absl::Status PagedDecodeCuda(const PagedDecodeBatch& batch, cudaStream_t stream,
                             absl::Span<const SharedPrefixGroup> shared) {
  absl::StatusOr<PagedDecodePlan> plan = Plan(batch, shared);
  if (!plan.ok()) return plan.status();
  if (batch.sequences.empty()) return absl::OkStatus();
  void* scratch = nullptr;
  if (absl::Status status = Cuda(cudaMallocAsync(&scratch, plan->scratch_bytes, stream),
                                 absl::StrCat("cudaMallocAsync(", plan->scratch_bytes, " bytes)"));
      !status.ok()) {
    return status;
  }
  absl::Status status = Launch(batch, shared, *plan, static_cast<float*>(scratch), stream);
  // Freed once the stream passes the kernels, even after a failed launch.
  const absl::Status freed = Cuda(cudaFreeAsync(scratch, stream), "cudaFreeAsync");
  return status.ok() ? freed : status;
}

}  // namespace attention::core::cuda

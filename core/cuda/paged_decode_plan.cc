#include "core/cuda/paged_decode_plan.h"

#include <algorithm>

namespace attention::core::cuda {
namespace {

constexpr int64_t kVectorBytes = 16;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Vector loads need every key row and value row, and the block starts, 16-byte aligned.
bool VectorAligned(const PagedDecodeDims& d) {
  return d.storage_address % kVectorBytes == 0 && d.block_bytes % kVectorBytes == 0 &&
         d.key_dim * d.element_bytes % kVectorBytes == 0 &&
         d.value_dim * d.element_bytes % kVectorBytes == 0;
}

int Vector(const PagedDecodeDims& d) {
  return VectorAligned(d) ? static_cast<int>(kVectorBytes / d.element_bytes) : 1;
}

// Vectors of the wider row.
int64_t RowVectors(const PagedDecodeDims& d, int vector) {
  return CeilDiv(std::max(d.key_dim, d.value_dim), vector);
}

int Lanes(int64_t vectors) {
  int lanes = 1;
  while (lanes < 32 && lanes < vectors) lanes *= 2;
  return lanes;
}

// The kernels instantiated (paged_decode.cu): the fewest chunks of those that cover the row.
int Chunks(const PagedDecodeDims& d, int vector, int lanes) {
  const int64_t needed = CeilDiv(RowVectors(d, vector), lanes);
  std::vector<int> built;
  if (vector == 1) {
    built = {4, 16};
  } else if (d.element_bytes == 4) {
    built = {1, 4};
  } else {
    built = {1, 2};
  }
  for (const int chunks : built) {
    if (needed <= chunks) return chunks;
  }
  return 0;
}

}  // namespace

std::string PagedDecodeUnsupportedReason(const PagedDecodeDims& d,
                                         const std::vector<PagedSequenceDims>& sequences,
                                         int64_t max_shared_bytes) {
  if (std::max(d.key_dim, d.value_dim) > kCudaPagedMaxHeadDim) {
    return "paged decode: key_dim " + std::to_string(d.key_dim) + " and value_dim " +
           std::to_string(d.value_dim) + ": the CUDA kernel takes rows of at most " +
           std::to_string(kCudaPagedMaxHeadDim) + " elements";
  }
  if (PagedSplitSharedBytes(d.value_dim) > max_shared_bytes) {
    return "paged decode: value_dim " + std::to_string(d.value_dim) + " needs " +
           std::to_string(PagedSplitSharedBytes(d.value_dim)) +
           " bytes of shared memory per block; the device has " + std::to_string(max_shared_bytes);
  }
  // Key indices are 32-bit in the kernels' inner loops.
  constexpr int64_t kMaxLength = (int64_t{1} << 31) - 1;
  for (size_t b = 0; b < sequences.size(); ++b) {
    if (sequences[b].length > kMaxLength) {
      return "paged decode: sequence " + std::to_string(b) + " has length " +
             std::to_string(sequences[b].length) + "; the CUDA kernel takes at most 2^31 - 1";
    }
  }
  const PagedDecodePlan plan = PlanPagedDecode(d, sequences);
  for (const PagedLaunch& launch : plan.launches) {
    if (launch.split_blocks > kCudaPagedMaxGridBlocks ||
        launch.merge_blocks > kCudaPagedMaxGridBlocks) {
      return "paged decode: sequences " + std::to_string(launch.first_sequence) + ".." +
             std::to_string(launch.first_sequence + launch.count - 1) + " need " +
             std::to_string(std::max(launch.split_blocks, launch.merge_blocks)) +
             " blocks, more than a CUDA grid holds";
    }
  }
  return "";
}

PagedDecodePlan PlanPagedDecode(const PagedDecodeDims& d,
                                const std::vector<PagedSequenceDims>& sequences) {
  PagedDecodePlan plan;
  plan.vector = Vector(d);
  plan.lanes = Lanes(RowVectors(d, plan.vector));
  plan.chunks = Chunks(d, plan.vector, plan.lanes);
  plan.shared_bytes = PagedSplitSharedBytes(d.value_dim);
  const int64_t group = d.num_heads / d.num_kv_heads;
  int64_t state_floats = 0;
  for (size_t b = 0; b < sequences.size(); ++b) {
    const PagedSequenceDims& s = sequences[b];
    if (b % kCudaPagedSequencesPerLaunch == 0) {
      plan.launches.push_back({static_cast<int64_t>(b), 0, 0, 0});
    }
    PagedLaunch& launch = plan.launches.back();
    PagedSequencePlan p;
    p.first_split =
        PagedFirstVisibleKey(s.length - s.num_queries, d.sliding_window) / kCudaPagedSplitKeys;
    p.run_splits = CeilDiv(s.length, kCudaPagedSplitKeys) - p.first_split;
    p.rows = s.num_queries * group;
    p.row_chunks = CeilDiv(p.rows, kCudaPagedRowsPerBlock);
    p.split_blocks = d.num_kv_heads * p.run_splits * p.row_chunks;
    p.merge_blocks = s.num_queries * d.num_heads * PagedMergeColumnChunks(d.value_dim);
    p.split_block_begin = launch.split_blocks;
    p.merge_block_begin = launch.merge_blocks;
    p.state_offset = state_floats;
    state_floats += d.num_kv_heads * p.run_splits * p.rows * PagedStateFloats(d.value_dim);
    launch.count += 1;
    launch.split_blocks += p.split_blocks;
    launch.merge_blocks += p.merge_blocks;
    plan.sequences.push_back(p);
  }
  plan.scratch_bytes = state_floats * static_cast<int64_t>(sizeof(float));
  return plan;
}

}  // namespace attention::core::cuda

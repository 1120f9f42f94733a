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
                                         int64_t max_shared_bytes,
                                         const std::vector<PagedSharedGroupDims>& groups) {
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
  const PagedDecodePlan plan = PlanPagedDecode(d, sequences, groups);
  for (const PagedLaunch& launch : plan.launches) {
    if (launch.split_blocks > kCudaPagedMaxGridBlocks ||
        launch.merge_blocks > kCudaPagedMaxGridBlocks) {
      return "paged decode: entries " + std::to_string(launch.first_sequence) + ".." +
             std::to_string(launch.first_sequence + launch.count - 1) + " need " +
             std::to_string(std::max(launch.split_blocks, launch.merge_blocks)) +
             " blocks, more than a CUDA grid holds";
    }
  }
  return "";
}

std::string PagedSharedGroupsInvalidReason(const PagedDecodeDims& d,
                                           const std::vector<PagedSequenceDims>& sequences,
                                           const std::vector<PagedSharedGroupDims>& groups) {
  std::vector<bool> grouped(sequences.size(), false);
  for (size_t g = 0; g < groups.size(); ++g) {
    const PagedSharedGroupDims& group = groups[g];
    const std::string name = "paged decode: shared group " + std::to_string(g);
    if (d.sliding_window > 0) {
      return name + ": sliding_window " + std::to_string(d.sliding_window) +
             " (a window's sequences share no whole prefix)";
    }
    if (group.members.size() < 2) {
      return name + " has " + std::to_string(group.members.size()) + " members; at least 2";
    }
    if (group.shared_keys < 1 || group.shared_keys % kCudaPagedSplitKeys != 0) {
      return name + ": shared_keys " + std::to_string(group.shared_keys) +
             " is not a positive multiple of " + std::to_string(kCudaPagedSplitKeys);
    }
    for (size_t m = 0; m < group.members.size(); ++m) {
      const int64_t b = group.members[m];
      if (b < 0 || b >= static_cast<int64_t>(sequences.size()) ||
          (m > 0 && b <= group.members[m - 1]) || grouped[b]) {
        return name + ": member " + std::to_string(b) +
               " is not a sequence in ascending order outside every other group (" +
               std::to_string(sequences.size()) + " sequences)";
      }
      grouped[b] = true;
      const PagedSequenceDims& s = sequences[b];
      if (s.length - s.num_queries + 1 < group.shared_keys) {
        return name + ": member " + std::to_string(b) + " (length " + std::to_string(s.length) +
               ", " + std::to_string(s.num_queries) + " queries) does not see shared_keys " +
               std::to_string(group.shared_keys) + " from its first query";
      }
    }
  }
  return "";
}

PagedDecodePlan PlanPagedDecode(const PagedDecodeDims& d,
                                const std::vector<PagedSequenceDims>& sequences,
                                const std::vector<PagedSharedGroupDims>& groups) {
  PagedDecodePlan plan;
  plan.vector = Vector(d);
  plan.lanes = Lanes(RowVectors(d, plan.vector));
  plan.chunks = Chunks(d, plan.vector, plan.lanes);
  plan.shared_bytes = PagedSplitSharedBytes(d.value_dim);
  const int64_t group = d.num_heads / d.num_kv_heads;
  // The entries: the sequences, then each group's rows over its shared keys.
  std::vector<PagedSequenceDims> entries = sequences;
  std::vector<int64_t> shared_keys(sequences.size(), 0);
  for (const PagedSharedGroupDims& g : groups) {
    int64_t queries = 0;
    for (const int64_t b : g.members) {
      shared_keys[b] = g.shared_keys;
      queries += sequences[b].num_queries;
    }
    entries.push_back(PagedSharedGroupSequence(g.shared_keys, queries));
    shared_keys.push_back(0);
  }
  int64_t state_floats = 0;
  for (size_t b = 0; b < entries.size(); ++b) {
    const PagedSequenceDims& s = entries[b];
    const bool group_entry = b >= sequences.size();
    if (b % kCudaPagedSequencesPerLaunch == 0) {
      plan.launches.push_back({static_cast<int64_t>(b), 0, 0, 0});
    }
    PagedLaunch& launch = plan.launches.back();
    PagedSequencePlan p;
    // A member's own splits start after the shared ones; a group entry runs only those.
    p.first_split =
        std::max(PagedFirstVisibleKey(s.length - s.num_queries, d.sliding_window), shared_keys[b]) /
        kCudaPagedSplitKeys;
    p.run_splits = group_entry ? groups[b - sequences.size()].shared_keys / kCudaPagedSplitKeys
                               : CeilDiv(s.length, kCudaPagedSplitKeys) - p.first_split;
    p.rows = s.num_queries * group;
    p.row_chunks = CeilDiv(p.rows, kCudaPagedRowsPerBlock);
    p.split_blocks = d.num_kv_heads * p.run_splits * p.row_chunks;
    p.merge_blocks =
        group_entry ? 0 : s.num_queries * d.num_heads * PagedMergeColumnChunks(d.value_dim);
    p.split_block_begin = launch.split_blocks;
    p.merge_block_begin = launch.merge_blocks;
    p.state_offset = state_floats;
    state_floats += d.num_kv_heads * p.run_splits * p.rows * PagedStateFloats(d.value_dim);
    launch.count += 1;
    launch.split_blocks += p.split_blocks;
    launch.merge_blocks += p.merge_blocks;
    plan.sequences.push_back(p);
  }
  // Each member's shared splits are its group entry's.
  for (size_t g = 0; g < groups.size(); ++g) {
    const PagedSequencePlan& entry = plan.sequences[sequences.size() + g];
    int64_t first_row = 0;
    for (const int64_t b : groups[g].members) {
      PagedSequencePlan& member = plan.sequences[b];
      member.shared_splits = entry.run_splits;
      member.shared_rows = entry.rows;
      member.shared_first_row = first_row;
      member.shared_state_offset = entry.state_offset;
      first_row += member.rows;
    }
  }
  plan.scratch_bytes = state_floats * static_cast<int64_t>(sizeof(float));
  return plan;
}

}  // namespace attention::core::cuda

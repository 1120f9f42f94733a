#include "core/cuda/launch_plan.h"

#include <algorithm>

namespace attention::core::cuda {
namespace {

int64_t SharedBytes(const AttentionShape& s) {
  const int64_t floats = kFlashRowsPerBlock * s.head_dim +        // Q rows
                         kFlashKeysPerTile * (s.head_dim + 1) +   // K tile, padded
                         kFlashKeysPerTile * s.v_head_dim;        // V tile
  return floats * static_cast<int64_t>(sizeof(float));
}

}  // namespace

std::string FlashUnsupportedReason(const AttentionShape& s, int64_t max_shared_bytes) {
  if (s.head_dim > kFlashMaxHeadDim) {
    return "config.head_dim = " + std::to_string(s.head_dim) + " exceeds the CUDA kernel's " +
           std::to_string(kFlashMaxHeadDim);
  }
  if (s.v_head_dim > kFlashMaxHeadDim) {
    return "config.v_head_dim = " + std::to_string(s.v_head_dim) + " exceeds the CUDA kernel's " +
           std::to_string(kFlashMaxHeadDim);
  }
  if (SharedBytes(s) > max_shared_bytes) {
    return "head_dim " + std::to_string(s.head_dim) + " and v_head_dim " +
           std::to_string(s.v_head_dim) + " need " + std::to_string(SharedBytes(s)) +
           " bytes of shared memory per block; the device has " + std::to_string(max_shared_bytes);
  }
  const int64_t query_blocks = (s.q_len + kFlashRowsPerBlock - 1) / kFlashRowsPerBlock;
  if (query_blocks > kMaxGridBlocks / std::max<int64_t>(1, s.num_heads * s.batch)) {
    return "B * H * ceil(Nq / 32) = " + std::to_string(s.batch) + " * " +
           std::to_string(s.num_heads) + " * " + std::to_string(query_blocks) +
           " blocks exceed a CUDA grid";
  }
  return "";
}

FlashLaunchPlan PlanFlashAttention(const AttentionShape& s, bool weights) {
  FlashLaunchPlan plan;
  plan.query_blocks = (s.q_len + kFlashRowsPerBlock - 1) / kFlashRowsPerBlock;
  plan.blocks = plan.query_blocks * s.num_heads * s.batch;
  const int64_t chunks = (s.v_head_dim + 31) / 32;
  plan.value_chunks = chunks <= 2 ? 2 : chunks <= 4 ? 4 : 8;
  plan.shared_bytes = SharedBytes(s);
  if (weights) {
    const int64_t total = s.batch * s.num_heads * s.q_len * s.kv_len;
    // Grid-stride: enough blocks to fill any GPU, never more than the weights need.
    plan.weight_blocks = std::clamp<int64_t>((total + kWeightThreads - 1) / kWeightThreads, 1,
                                             int64_t{1} << 16);
  }
  return plan;
}

bool MmaKernelTakes(const AttentionShape& s, bool weights, int64_t max_shared_bytes) {
  const auto tiles = [](int64_t dim) { return dim % 16 == 0 && dim <= kMmaMaxHeadDim; };
  if (weights || !tiles(s.head_dim) || !tiles(s.v_head_dim)) return false;
  if (PlanMmaShared(s.head_dim, s.v_head_dim).total_bytes > max_shared_bytes) return false;
  const int64_t query_blocks = (s.q_len + kMmaRowsPerBlock - 1) / kMmaRowsPerBlock;
  return query_blocks <= kMaxGridBlocks / std::max<int64_t>(1, s.num_heads * s.batch);
}

MmaLaunchPlan PlanMmaAttention(const AttentionShape& s) {
  MmaLaunchPlan plan;
  plan.query_blocks = (s.q_len + kMmaRowsPerBlock - 1) / kMmaRowsPerBlock;
  plan.blocks = plan.query_blocks * s.num_heads * s.batch;
  plan.shared = PlanMmaShared(s.head_dim, s.v_head_dim);
  return plan;
}

}  // namespace attention::core::cuda

#include "core/cuda/copy_overlap_plan.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <string_view>

namespace attention::core::cuda {

bool CopyOverlapEnabled() {
  static const bool enabled = [] {
    const char* setting = std::getenv("ATTENTION_CUDA_OVERLAP");
    return setting == nullptr || std::string_view(setting) != "off";
  }();
  return enabled;
}

std::vector<int64_t> CopyOverlapPartBytes(absl::Span<const MhaInput* const> inputs,
                                          int64_t output_dim) {
  std::vector<int64_t> bytes;
  for (const MhaInput* input : inputs) {
    const MhaInput& in = *input;
    // Tensors already in the GPU's memory cross no bus.
    const int64_t element_bytes =
        in.inputs_memory == InputMemory::kGpu ? 0 : (in.is_half() ? 2 : 4);
    const int64_t answer_bytes =
        in.output_on_gpu ? 0 : (in.output_destination_bf16.empty() ? 4 : 2);
    const int64_t total =
        (in.query_elements() + in.key_elements() + in.value_elements()) * element_bytes +
        in.batch * in.q_len * output_dim * answer_bytes;
    if (SplitsIntoSequences(in)) {
      bytes.insert(bytes.end(), in.batch, total / in.batch);
    } else {
      bytes.push_back(total);
    }
  }
  return bytes;
}

std::vector<int64_t> SdpaOverlapPartBytes(const SdpaInput& input) {
  const AttentionDims& d = input.dims;
  const int64_t output_elements = d.batch * d.num_heads * d.q_len * d.v_head_dim;
  const int64_t total = static_cast<int64_t>(input.query.size() + input.key.size() +
                                             input.value.size() + output_elements) *
                        static_cast<int64_t>(sizeof(float));
  if (d.batch < 2 || !input.options.SplitsBetweenSequences()) return {total};
  return std::vector<int64_t>(d.batch, total / d.batch);
}

std::vector<size_t> PlanCopyOverlap(absl::Span<const int64_t> part_bytes, int64_t chunk_bytes) {
  const int64_t total = std::accumulate(part_bytes.begin(), part_bytes.end(), int64_t{0});
  if (part_bytes.size() < 2 || total < 2 * chunk_bytes) return {0};
  const int64_t chunks = std::min<int64_t>(kMaxOverlapChunks, total / chunk_bytes);
  // Cut where the running bytes pass each chunk's share of the total, once the chunk so
  // far and what is left each move chunk_bytes.
  std::vector<size_t> firsts = {0};
  int64_t moved = 0, chunk_moved = 0;
  for (size_t part = 0; part + 1 < part_bytes.size(); ++part) {
    moved += part_bytes[part];
    chunk_moved += part_bytes[part];
    const auto cuts = static_cast<int64_t>(firsts.size());
    if (cuts < chunks && moved >= total * cuts / chunks && chunk_moved >= chunk_bytes &&
        total - moved >= chunk_bytes) {
      firsts.push_back(part + 1);
      chunk_moved = 0;
    }
  }
  return firsts;
}

}  // namespace attention::core::cuda

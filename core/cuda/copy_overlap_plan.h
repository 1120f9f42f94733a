// How a large forward pass or scaled dot-product attention call on the GPU is cut into chunks
// whose copies overlap its compute (prepared_layer.cc, sdpa.cc): chunk i + 1 goes host -> device on
// one stream while chunk i computes on the other and chunk i - 1's answers come back. Plain C++,
// tested on every host.
#ifndef ATTENTION_CORE_CUDA_COPY_OVERLAP_PLAN_H_
#define ATTENTION_CORE_CUDA_COPY_OVERLAP_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/mha_types.h"
#include "core/status_macros.h"

namespace attention::core::cuda {

// Bytes a chunk moves (in and out) at least: below this a copy's fixed cost (about 10 us)
// and a second stream's launches outweigh what overlapping hides.
inline constexpr int64_t kOverlapChunkBytes = int64_t{4} << 20;
// Chunks of one pass at most: enough for the copies of all but the first and last to hide.
inline constexpr int kMaxOverlapChunks = 8;

// False when ATTENTION_CUDA_OVERLAP=off, which runs every call as one chunk (to tell the two
// apart on a GPU).
bool CopyOverlapEnabled();

// Bytes each part of SplitBatch(inputs) moves over the bus: its tensors in as sent, its
// answer out (none for those already in the GPU's memory: InputMemory::kGpu, output_on_gpu).
std::vector<int64_t> CopyOverlapPartBytes(absl::Span<const MhaInput* const> inputs,
                                          int64_t output_dim);

// Bytes each sequence of an SDPA call moves: its Q, K and V in, its output out. One part,
// the whole call, when it may not run in pieces (AttentionOptions::SplitsBetweenSequences).
std::vector<int64_t> SdpaOverlapPartBytes(const SdpaInput& input);

// The first part of each chunk, for parts (consecutive, in order) that move `part_bytes`:
// {0} (one chunk, the pass as it is) when the parts move less than 2 x chunk_bytes in all;
// else up to kMaxOverlapChunks chunks of consecutive parts, each moving about the same
// bytes and at least chunk_bytes (a part is never cut).
std::vector<size_t> PlanCopyOverlap(absl::Span<const int64_t> part_bytes,
                                    int64_t chunk_bytes = kOverlapChunkBytes);

// Runs `chunks` chunks over two lanes (streams): chunk c is enqueued on lane c % 2 once
// chunk c - 2, that lane's previous one, is received, so that chunk c + 1 is staged and
// copied in while chunk c computes; every chunk is received, in order. `enqueue(chunk,
// lane)` and `receive(chunk)` return absl::Status; the first error ends the run and is
// returned, and the caller waits for its lanes (chunks may still be in flight).
template <typename Enqueue, typename Receive>
absl::Status RunOverlappedChunks(size_t chunks, Enqueue&& enqueue, Receive&& receive) {
  for (size_t chunk = 0; chunk < chunks; ++chunk) {
    if (chunk >= 2) RETURN_IF_ERROR(receive(chunk - 2));
    RETURN_IF_ERROR(enqueue(chunk, static_cast<int>(chunk % 2)));
  }
  for (size_t chunk = chunks >= 2 ? chunks - 2 : 0; chunk < chunks; ++chunk) {
    RETURN_IF_ERROR(receive(chunk));
  }
  return absl::OkStatus();
}

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_COPY_OVERLAP_PLAN_H_

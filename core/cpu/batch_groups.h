// Which parts of a batch run every step of a layer on one thread each (core/cpu/bf16_layer.cc).
// Plain policy, apart from the layer so that its rule is tested on its own.
#ifndef ATTENTION_CORE_CPU_BATCH_GROUPS_H_
#define ATTENTION_CORE_CPU_BATCH_GROUPS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace attention::core {

// One part of a batch: an input, or one sequence of an input (OneSequence).
struct BatchPart {
  int64_t q_rows = 0;  // its query tokens
  int64_t kv_len = 0;  // the keys each of its queries attends
};

// Smallest rows of a group: 16 to 64 ran alike on Zen 4 (S4), 128 and more slower.
inline constexpr int64_t kGroupRows = 64;

// The parts (indices into `parts`) in groups of consecutive parts, each of at least
// kGroupRows query rows but the last, the costliest group first (FLOPs of a layer of width
// `embed_dim`), so that threads claiming them in order finish together. Empty where the
// groups cannot keep `threads` threads equally busy: fewer than two, or one costing more
// than a (2 x threads)-th of the batch. Each group then runs every step on one thread, its
// intermediate rows staying in that core's caches and no thread waiting for another between
// steps.
std::vector<std::vector<size_t>> GroupBatchParts(int64_t embed_dim,
                                                 absl::Span<const BatchPart> parts, int threads);

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_BATCH_GROUPS_H_

// Chunked prefill on the CPU over a paged KV cache: the sequences of a PagedDecodeBatch
// (core/cpu/paged_attention_cpu.h) with many new queries each, on the blocked flash-style
// kernel (core/cpu/attention_cpu.h) instead of the decode kernel, and the dispatcher that
// picks between the two per sequence.
//
// The decode kernel reads each KV head once for a whole GQA group but computes one query row
// at a time with dot products; a prefill chunk of hundreds of queries is compute-bound, and
// the blocked kernel's GEMM microkernel does that work several times faster. It reads keys
// and values from contiguous rows, so each sequence's visible keys and values of the layer
// are gathered from its blocks into float32 buffers first (bfloat16 widened): L tokens x
// H_kv x (dk + dv) floats of the calling thread's scratch, kept for its next call (so at
// most the KV pool's size, twice that for bfloat16, per calling thread). Reading the blocks
// in place instead was measured slower at long contexts (docs/benchmarks.md).
//
// Same semantics as PagedDecodeCpu: bottom-right causal alignment, the batch's sliding
// window and scale; log-sum-exp when a sequence asks for it. Each sequence is one problem
// of its own, so its results are bitwise the same for any thread count and any batch
// composition (the decode kernel's results are too, so the dispatcher's are).
#ifndef ATTENTION_CORE_CPU_PAGED_PREFILL_CPU_H_
#define ATTENTION_CORE_CPU_PAGED_PREFILL_CPU_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cpu/paged_attention_cpu.h"
#include "core/cpu/thread_pool.h"

namespace attention::core {

// Sequences with at least this many new queries go to the prefill path (see
// PagedAttentionCpu). session_prefill_bench's BM_PagedKernelCrossover (docs/benchmarks.md):
// at 32 queries the prefill path was 1.0-3.3x the decode kernel's speed from 512 to 16k
// keys; at 16 it lost up to 1.7x at 4k-16k keys, where gathering the context costs more
// than the decode kernel's whole pass.
inline constexpr int64_t kPagedPrefillMinQueries = 32;

// INVALID_ARGUMENT as PagedDecodeCpu (ValidatePagedDecodeBatch); otherwise computes every
// sequence of the batch, whatever its number of queries, on the blocked kernel.
absl::Status PagedPrefillCpu(const PagedDecodeBatch& batch, ThreadPool& pool);

// The paged attention of a step: sequences with n >= `prefill_min_queries` on
// PagedPrefillCpu, the others on PagedDecodeCpu (a bound above every n keeps them all
// there), with PagedDecodeCpu's `bf16_products` and `shared`. INVALID_ARGUMENT as PagedDecodeCpu,
// before anything is computed.
absl::Status PagedAttentionCpu(const PagedDecodeBatch& batch, ThreadPool& pool,
                               int64_t prefill_min_queries = kPagedPrefillMinQueries,
                               std::optional<Bf16Kernel> bf16_products = std::nullopt,
                               SharedPrefixes shared = SharedPrefixes::kReadOnce);

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_PAGED_PREFILL_CPU_H_

// Decode attention on the CPU over a paged KV cache (core/kv_cache/block_pool.h): each
// sequence's n new queries attend to its L cached keys, the n new ones included, with
// bottom-right causal alignment (query i, at position p = L - n + i, sees keys 0..p, or only
// the last W of them, p - W + 1..p, under a sliding window of W keys).
//
// Bandwidth-bound by design: each KV head is read once for all query heads of its GQA
// group (and once for a whole group of forks over the splits of a prefix they share), and
// long contexts are split across threads at fixed absolute key boundaries
// (kPagedSplitKeys) whose partial softmax states merge in a fixed order, so results are
// bitwise the same for any thread count and any batch composition (unless a caller asks for
// SharedPrefixes::kAsProducts).
//
// Steps of many queries (prefill chunks) are compute-bound: PagedAttentionCpu
// (core/cpu/paged_prefill_cpu.h) sends those to the blocked flash-style kernel instead.
#ifndef ATTENTION_CORE_CPU_PAGED_ATTENTION_CPU_H_
#define ATTENTION_CORE_CPU_PAGED_ATTENTION_CPU_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/cpu/gemm.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cpu/thread_pool.h"
#include "core/kv_cache/block_pool.h"
#include "core/kv_cache/paged_batch.h"

namespace attention::core {

// Keys per unit of work: one thread attends one KV head over one such range.
inline constexpr int64_t kPagedSplitKeys = 1024;
// Query rows (queries x GQA group) from which a group of forks attends the splits it shares
// as matrix products (GEMM microkernel) under SharedPrefixes::kAsProducts: BM_SharedPrefixDecode
// on Zen 3, GEMM / rows: float32 1.10-1.16 x the time at 32 rows, 0.98-1.03 at 64, 0.79 at 256.
inline constexpr int64_t kSharedPrefixGemmRows = 64;

// How forks of one prefix in a batch (FindSharedPrefixes over whole splits) attend the splits
// they share.
enum class SharedPrefixes {
  // Each fork reads them as if alone (a benchmark's baseline).
  kReadPerFork,
  // Read once for all the group's query rows, row by row: bitwise each fork's answer alone,
  // so batch-invariant (the default).
  kReadOnce,
  // Read once, and from kSharedPrefixGemmRows query rows attended as two matrix products,
  // within FlashAttention's rule of the row-by-row answers but not bitwise them: a fork's
  // bits then depend on which forks share its batch. Faster where bf16 products are (AMX:
  // 2.3 x over bf16 KV, 64 forks of 4,096 keys, on a Xeon model 167), about even in float32.
  kAsProducts,
};

// INVALID_ARGUMENT naming the field when the batch is malformed (n < 1, n > L, a block
// table too short or naming a block outside the storage, heads not a multiple of the KV
// heads, a negative window); otherwise computes every sequence's output. `level` picks the SIMD
// code (tests run each level the CPU supports); `shared` says how forks of one prefix attend
// what they share. Over bfloat16 KV, `bf16_products` (a kernel this CPU runs) makes
// kAsProducts' products bf16 on that kernel (the query rows and exps rounded to bf16), within
// the bf16 rule; unset, they are float32 products of the widened keys and values.
// PagedDecodeCpu's bf16_products on a host whose attention products are `products`
// (FastestBf16Products, or forced): unset where those are float32 (kPortable).
inline std::optional<Bf16Kernel> SharedPrefixBf16Products(Bf16Kernel products) {
  if (products == Bf16Kernel::kPortable) return std::nullopt;
  return products;
}

absl::Status PagedDecodeCpu(const PagedDecodeBatch& batch, ThreadPool& pool,
                            SimdLevel level = BestSimdLevel(),
                            SharedPrefixes shared = SharedPrefixes::kReadOnce,
                            std::optional<Bf16Kernel> bf16_products = std::nullopt);

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_PAGED_ATTENTION_CPU_H_

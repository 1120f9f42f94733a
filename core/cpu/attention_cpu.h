// The blocked float32 attention kernel of the CPU backend.
#ifndef ATTENTION_CORE_CPU_ATTENTION_CPU_H_
#define ATTENTION_CORE_CPU_ATTENTION_CPU_H_

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/attention_kernels.h"
#include "core/cpu/gemm_bf16.h"
#include "core/cpu/thread_pool.h"

namespace attention::core {

// Blocked float32 kernel: for each (sequence, head, block of QueryBlockRows(Nk) queries),
// GEMMs for the scores against the keys up to the block's causal frontier, a vectorized
// masked softmax, GEMMs with the values (OpenBLAS, or for up to 512 keys the microkernel of
// core/cpu/gemm.h). Past 1024 keys (and when no weights are returned)
// the keys are taken in blocks with an online softmax (running max and sum, flash-style),
// so extra memory is at most rows x 1024 floats per thread: no Nq x Nk matrix unless
// weights are requested. All problems share one ParallelFor, so a batch of many small
// requests keeps every thread busy. Writes each row's log-sum-exp when a problem asks
// (the paged prefill path's, core/cpu/paged_prefill_cpu.h). Problems with bf16_products
// multiply on `bf16_kernel` (kAvx512Bf16 or kAmx).
void AttentionBlockedCpu(absl::Span<const AttentionProblem> problems, ThreadPool& pool,
                         Bf16Kernel bf16_kernel = Bf16Kernel::kAvx512Bf16);

// How a BFLOAT16 layer's attention multiplies: bf16 products on AMX tiles or AVX512-BF16, or
// float32 products (kPortable) of the same bf16 values. Named amx, avx512_bf16, float32.
const char* Bf16ProductsName(Bf16Kernel kernel);
absl::StatusOr<Bf16Kernel> ParseBf16Products(absl::string_view name);
// Whether this CPU runs `kernel`'s products (float32 everywhere).
bool CpuSupportsBf16Products(Bf16Kernel kernel);
// The fastest of them on this host, measured once on one head's pass of the blocked kernel
// over 512 keys (256 queries, head size 64, one thread, best of three), and what the
// measurement found, for the start-up log.
Bf16Kernel FastestBf16Products();
std::string Bf16ProductsReport();

// Query rows per block: as many as keep the block's scores within 1 MiB (half of a
// 2 MiB L2, the rest for the K and V tiles), between 64 and 512. Taller blocks make the
// two GEMMs more efficient and pack each head's keys and values fewer times; short keys
// allow them (512 rather than 256: S2, 512 keys, bf16 +3.7%, float32 +1.5%, alternated).
inline int64_t QueryBlockRows(int64_t kv_len) {
  constexpr int64_t kScoreFloats = (1024 << 10) / sizeof(float);
  const int64_t rows = kScoreFloats / std::max<int64_t>(kv_len, 1);
  return std::clamp<int64_t>(rows, 64, 512);
}

}  // namespace attention::core

#endif  // ATTENTION_CORE_CPU_ATTENTION_CPU_H_

// Decode attention on a CUDA device over a paged KV cache: the CPU kernel's semantics
// (core/cpu/paged_attention_cpu.h: bottom-right causal, GQA-fused, optional sliding window
// and log-sum-exp, float32 or bfloat16 KV computed in float32) and its request types, with
// device pointers. See paged_decode_plan.h for how the work is cut.
//
// Results are bitwise the same for any batch composition (splits are fixed in absolute keys
// and merged in split order, with no atomics), not bitwise the CPU kernel's.
#ifndef ATTENTION_CORE_CUDA_PAGED_DECODE_H_
#define ATTENTION_CORE_CUDA_PAGED_DECODE_H_

#include <cstdint>

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/kv_cache/paged_batch.h"

namespace attention::core::cuda {

// In `batch`, on the device: storage.data; each sequence's block_table.data() (a device
// array of block_table.size() BlockIds: the span's size is read on the host, its entries
// never), query, output and log_sum_exp. The sequences array itself is host memory.
//
// INVALID_ARGUMENT naming the field for what the CPU kernel refuses and the host can see
// (n < 1, n > L, a block table too short, heads not a multiple of the KV heads, a negative
// window, a misaligned storage), with the same messages, and for shapes the kernels cannot
// run (shared memory, lengths of 2^31 or more). Block ids are not read on the host: one
// outside [0, storage.num_blocks) is read as NaN keys and values, so that sequence's outputs
// are NaN instead of reading outside the storage.
//
// `shared`: forks of one prefix, each group's shared splits run once for all its members
// (see paged_decode_plan.h), bitwise the results without: the caller's
// FindSharedPrefixes(batch, kCudaPagedSplitKeys) over the host's copy of the tables, with
// each group's members' queries contiguous in device memory in member order.
// INVALID_ARGUMENT naming the group for groups PagedSharedGroupsInvalidReason refuses or
// queries that are not contiguous. batch.stats, when set, counts what was shared.
//
// Enqueues the kernels on `stream` and returns; the outputs are ready when the stream is.
// Scratch for the split states comes from cudaMallocAsync on `stream` (the device's default
// memory pool), freed stream-ordered after the kernels.
absl::Status PagedDecodeCuda(const PagedDecodeBatch& batch, cudaStream_t stream,
                             absl::Span<const SharedPrefixGroup> shared = {});

// The same with the caller's device scratch, of at least PagedDecodeCudaScratchBytes(batch)
// bytes, 256-byte aligned (cudaMalloc's), not used by other work until the stream passes
// these kernels.
absl::StatusOr<int64_t> PagedDecodeCudaScratchBytes(
    const PagedDecodeBatch& batch, absl::Span<const SharedPrefixGroup> shared = {});
absl::Status PagedDecodeCuda(const PagedDecodeBatch& batch, void* scratch, int64_t scratch_bytes,
                             cudaStream_t stream, absl::Span<const SharedPrefixGroup> shared = {});

}  // namespace attention::core::cuda

#endif  // ATTENTION_CORE_CUDA_PAGED_DECODE_H_

#include "core/cpu/paged_prefill_cpu.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/attention_kernels.h"
#include "core/attention_options.h"
#include "core/cpu/attention_cpu.h"
#include "core/half_bits.h"

namespace attention::core {
namespace {

using kv_cache::KvLayout;

// `count` elements of the KV dtype at `source` as float32 at `destination`.
void CopyAsFloat(const char* source, DType dtype, int64_t count, float* destination) {
  if (dtype == DType::kFloat32) {
    std::memcpy(destination, source, count * sizeof(float));
    return;
  }
  const auto* bits = reinterpret_cast<const uint16_t*>(source);
  for (int64_t i = 0; i < count; ++i) destination[i] = BFloat16BitsToFloat(bits[i]);
}

// One sequence's keys [first_key, length) of every KV head: keys [H_kv][keys][dk] then
// values [H_kv][keys][dv], float32, at `gathered`; one block per unit of work.
void GatherKv(const PagedDecodeBatch& batch, const PagedDecodeSequence& sequence, int64_t first_key,
              float* gathered, ThreadPool& pool) {
  const KvLayout& layout = batch.layout;
  const int64_t tokens_per_block = batch.tokens_per_block;
  const int64_t keys = sequence.length - first_key;
  float* gathered_values = gathered + layout.num_kv_heads * keys * layout.key_dim;
  const int64_t first_block = first_key / tokens_per_block;
  const int64_t end_block = (sequence.length + tokens_per_block - 1) / tokens_per_block;
  pool.ParallelFor(end_block - first_block, [&](int64_t index) {
    const int64_t block = first_block + index;
    const int64_t begin = std::max(first_key, block * tokens_per_block);
    const int64_t end = std::min(sequence.length, (block + 1) * tokens_per_block);
    const int64_t slot = begin - block * tokens_per_block;
    const char* bytes = static_cast<const char*>(batch.storage.data) +
                        sequence.block_table[block] * batch.storage.block_bytes;
    const int64_t element = layout.ElementBytes();
    for (int64_t h = 0; h < layout.num_kv_heads; ++h) {
      // A block keeps each head's tokens contiguous, as the gathered rows are.
      CopyAsFloat(bytes + kv_cache::KeyOffset(layout, tokens_per_block, slot, h) * element,
                  layout.dtype, (end - begin) * layout.key_dim,
                  gathered + (h * keys + begin - first_key) * layout.key_dim);
      CopyAsFloat(bytes + kv_cache::ValueOffset(layout, tokens_per_block, slot, h) * element,
                  layout.dtype, (end - begin) * layout.value_dim,
                  gathered_values + (h * keys + begin - first_key) * layout.value_dim);
    }
  });
}

}  // namespace

absl::Status PagedPrefillCpu(const PagedDecodeBatch& batch, ThreadPool& pool) {
  if (absl::Status status = ValidatePagedDecodeBatch(batch, /*check_block_ids=*/true);
      !status.ok()) {
    return status;
  }
  const KvLayout& layout = batch.layout;
  AttentionOptions options;
  options.causal = true;
  options.scale = batch.scale;
  options.sliding_window = batch.sliding_window;
  thread_local std::vector<float> gathered;
  for (const PagedDecodeSequence& sequence : batch.sequences) {
    const int64_t n = sequence.num_queries;
    // Keys before the first query's window are seen by no query: not gathered. The problem's
    // keys start there, which keeps bottom-right alignment and the window as they are.
    const int64_t first_key =
        batch.sliding_window > 0
            ? std::max<int64_t>(0, sequence.length - n - batch.sliding_window + 1)
            : 0;
    const int64_t keys = sequence.length - first_key;
    const int64_t floats = layout.num_kv_heads * keys * (layout.key_dim + layout.value_dim);
    // Never shrunk: growing back would zero-fill what the gather overwrites anyway.
    if (static_cast<int64_t>(gathered.size()) < floats) gathered.resize(floats);
    GatherKv(batch, sequence, first_key, gathered.data(), pool);

    AttentionProblem problem;
    problem.dims = {/*batch=*/1, batch.num_heads, layout.num_kv_heads, n,
                    keys,        layout.key_dim,  layout.value_dim};
    problem.query = sequence.query;  // [n][H][dk]
    problem.query_layout = HeadLayout::BatchRowHead(batch.num_heads, n, layout.key_dim);
    problem.key = gathered.data();  // [H_kv][keys][dk]
    problem.key_layout = HeadLayout::BatchHeadRow(layout.num_kv_heads, keys, layout.key_dim);
    problem.value = gathered.data() + layout.num_kv_heads * keys * layout.key_dim;
    problem.value_layout = HeadLayout::BatchHeadRow(layout.num_kv_heads, keys, layout.value_dim);
    problem.output = sequence.output;  // [n][H][dv]
    problem.output_layout = HeadLayout::BatchRowHead(batch.num_heads, n, layout.value_dim);
    problem.log_sum_exp = sequence.log_sum_exp;  // [n][H], or null
    problem.log_sum_exp_layout = HeadLayout::BatchRowHead(batch.num_heads, n, 1);
    problem.options = &options;
    AttentionBlockedCpu({problem}, pool);
  }
  return absl::OkStatus();
}

absl::Status PagedAttentionCpu(const PagedDecodeBatch& batch, ThreadPool& pool,
                               int64_t prefill_min_queries, std::optional<Bf16Kernel> bf16_products,
                               SharedPrefixes shared) {
  if (absl::Status status = ValidatePagedDecodeBatch(batch, /*check_block_ids=*/true);
      !status.ok()) {
    return status;
  }
  std::vector<PagedDecodeSequence> decode, prefill;
  for (const PagedDecodeSequence& sequence : batch.sequences) {
    (sequence.num_queries >= prefill_min_queries ? prefill : decode).push_back(sequence);
  }
  PagedDecodeBatch part = batch;
  if (!decode.empty()) {
    part.sequences = decode;
    if (absl::Status status = PagedDecodeCpu(part, pool, BestSimdLevel(), shared, bf16_products);
        !status.ok()) {
      return status;
    }
  }
  if (!prefill.empty()) {
    part.sequences = prefill;
    return PagedPrefillCpu(part, pool);
  }
  return absl::OkStatus();
}

}  // namespace attention::core

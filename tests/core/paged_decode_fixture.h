// A paged KV pool in host memory and the dense references for testing paged decode kernels
// (the fixture of the CPU and CUDA kernels' tests): several sequences at randomly
// permuted blocks of a pool three times too large whose other blocks hold NaN, so a read
// outside a block table shows, and the textbook loops in float32 and float64 on the
// gathered KV, for FlashAttention's fidelity rule (tests/core/fidelity.h).
#ifndef ATTENTION_TESTS_CORE_PAGED_DECODE_FIXTURE_H_
#define ATTENTION_TESTS_CORE_PAGED_DECODE_FIXTURE_H_

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/half_bits.h"
#include "core/kv_cache/block_pool.h"
#include "core/kv_cache/kv_storage.h"
#include "core/kv_cache/paged_batch.h"
#include "gtest/gtest.h"
#include "tests/core/fidelity.h"

namespace attention::core::testing {

struct PagedShape {
  int64_t heads, kv_heads, key_dim, value_dim, tokens_per_block;
  DType dtype;
};

struct PagedSequence {
  int64_t length, queries;
  std::vector<float> keys, values;  // dense [L][H_kv][d], as stored (bf16-rounded for bf16)
  std::vector<float> query;         // [n][H][dk]
  std::vector<kv_cache::BlockId> table;
  std::vector<float> output, log_sum_exp;
};

class HostPagedPool {
 public:
  // `slack` bytes past each block's tokens: storage blocks may be larger than their tokens
  // (8 leaves float32 blocks only 8-byte aligned, 16 keeps them 16-byte aligned).
  HostPagedPool(const PagedShape& shape,
                const std::vector<std::pair<int64_t, int64_t>>& lengths_and_queries, uint64_t seed,
                int64_t slack = 8)
      : shape_(shape), layout_{shape.kv_heads, shape.key_dim, shape.value_dim, shape.dtype} {
    std::mt19937_64 rng(seed);
    block_bytes_ = shape.tokens_per_block * layout_.TokenBytes() + slack;
    int64_t needed = 0;
    for (const auto& [length, queries] : lengths_and_queries) {
      needed += (length + shape.tokens_per_block - 1) / shape.tokens_per_block;
    }
    num_blocks_ = 3 * needed;
    bytes_.assign(num_blocks_ * block_bytes_, 0xff);  // NaN in float32 and bfloat16
    std::vector<kv_cache::BlockId> permutation(num_blocks_);
    std::iota(permutation.begin(), permutation.end(), 0);
    std::shuffle(permutation.begin(), permutation.end(), rng);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    permutation_ = permutation;
    size_t& next_block = next_block_;
    for (const auto& [length, queries] : lengths_and_queries) {
      PagedSequence s;
      s.length = length;
      s.queries = queries;
      s.keys.resize(length * shape.kv_heads * shape.key_dim);
      s.values.resize(length * shape.kv_heads * shape.value_dim);
      for (float& x : s.keys) x = Stored(uniform(rng) * 2.0f);
      for (float& x : s.values) x = Stored(uniform(rng));
      s.query.resize(queries * shape.heads * shape.key_dim);
      for (float& x : s.query) x = uniform(rng) * 2.0f;
      const int64_t blocks = (length + shape.tokens_per_block - 1) / shape.tokens_per_block;
      s.table.assign(permutation.begin() + next_block, permutation.begin() + next_block + blocks);
      next_block += blocks;
      Write(s);
      s.output.assign(queries * shape.heads * shape.value_dim, -7.0f);
      s.log_sum_exp.assign(queries * shape.heads, -7.0f);
      sequences_.push_back(std::move(s));
    }
  }

  std::vector<PagedSequence>& sequences() { return sequences_; }

  // A fork of sequence `source`, as a session fork is: its first `shared_blocks` blocks are
  // the source's (the same block ids, so the same keys and values), then blocks of its own
  // with random keys and values up to `length`, and `queries` random queries. Returns its
  // index. The pool's unused blocks must hold it.
  size_t AddFork(size_t source, int64_t shared_blocks, int64_t length, int64_t queries,
                 uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    const PagedSequence& from = sequences_[source];
    const int64_t tpb = shape_.tokens_per_block;
    const int64_t shared_tokens = std::min(shared_blocks * tpb, from.length);
    PagedSequence s;
    s.length = length;
    s.queries = queries;
    s.keys.assign(from.keys.begin(),
                  from.keys.begin() + shared_tokens * shape_.kv_heads * shape_.key_dim);
    s.values.assign(from.values.begin(),
                    from.values.begin() + shared_tokens * shape_.kv_heads * shape_.value_dim);
    s.keys.resize(length * shape_.kv_heads * shape_.key_dim);
    s.values.resize(length * shape_.kv_heads * shape_.value_dim);
    for (size_t x = shared_tokens * shape_.kv_heads * shape_.key_dim; x < s.keys.size(); ++x) {
      s.keys[x] = Stored(uniform(rng) * 2.0f);
    }
    for (size_t x = shared_tokens * shape_.kv_heads * shape_.value_dim; x < s.values.size(); ++x) {
      s.values[x] = Stored(uniform(rng));
    }
    s.query.resize(queries * shape_.heads * shape_.key_dim);
    for (float& x : s.query) x = uniform(rng) * 2.0f;
    s.table.assign(from.table.begin(), from.table.begin() + shared_blocks);
    const int64_t blocks = (length + tpb - 1) / tpb;
    EXPECT_LE(next_block_ + (blocks - shared_blocks), permutation_.size()) << "pool too small";
    for (int64_t b = shared_blocks; b < blocks; ++b) s.table.push_back(permutation_[next_block_++]);
    Write(s);  // rewrites the shared blocks with the values they hold
    s.output.assign(queries * shape_.heads * shape_.value_dim, -7.0f);
    s.log_sum_exp.assign(queries * shape_.heads, -7.0f);
    sequences_.push_back(std::move(s));
    return sequences_.size() - 1;
  }

  // The sequences `indices` as one kernel batch over this pool; `entries` holds the batch's
  // sequences and must outlive it. Without log-sum-exps when `with_log_sum_exp` is false.
  PagedDecodeBatch Batch(const std::vector<size_t>& indices,
                         std::vector<PagedDecodeSequence>& entries, bool with_log_sum_exp = true) {
    entries.clear();
    for (const size_t i : indices) {
      PagedSequence& s = sequences_[i];
      entries.push_back({s.table, s.length, s.queries, s.query.data(), s.output.data(),
                         with_log_sum_exp ? s.log_sum_exp.data() : nullptr});
    }
    PagedDecodeBatch batch;
    batch.storage = {bytes_.data(), block_bytes_, num_blocks_};
    batch.layout = layout_;
    batch.tokens_per_block = shape_.tokens_per_block;
    batch.num_heads = shape_.heads;
    batch.scale = scale();
    batch.sliding_window = sliding_window;
    batch.sequences = entries;
    return batch;
  }
  // Every block of the pool into `storage` (of as many blocks, as large).
  absl::Status WriteBlocksTo(kv_cache::KvStorage& storage) const {
    for (kv_cache::BlockId block = 0; block < num_blocks_; ++block) {
      if (absl::Status status = storage.WriteBlock(block, bytes_.data() + block * block_bytes_);
          !status.ok()) {
        return status;
      }
    }
    return absl::OkStatus();
  }
  const PagedShape& shape() const { return shape_; }
  const kv_cache::KvLayout& layout() const { return layout_; }
  const std::vector<uint8_t>& bytes() const { return bytes_; }
  int64_t block_bytes() const { return block_bytes_; }
  int64_t num_blocks() const { return num_blocks_; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(shape_.key_dim)); }
  int64_t sliding_window = 0;

 private:
  float Stored(float x) const {
    return shape_.dtype == DType::kBFloat16 ? BFloat16ToFloat(FloatToBFloat16(x)) : x;
  }
  void Put(int64_t block, int64_t element, float x) {
    uint8_t* at = bytes_.data() + block * block_bytes_ + element * layout_.ElementBytes();
    if (shape_.dtype == DType::kBFloat16) {
      const uint16_t bits = FloatToBFloat16(x);
      std::memcpy(at, &bits, sizeof(bits));
    } else {
      std::memcpy(at, &x, sizeof(x));
    }
  }
  void Write(const PagedSequence& s) {
    const int64_t tpb = shape_.tokens_per_block;
    for (int64_t t = 0; t < s.length; ++t) {
      const int64_t block = s.table[t / tpb], slot = t % tpb;
      for (int64_t h = 0; h < shape_.kv_heads; ++h) {
        for (int64_t c = 0; c < shape_.key_dim; ++c) {
          Put(block, kv_cache::KeyOffset(layout_, tpb, slot, h) + c,
              s.keys[(t * shape_.kv_heads + h) * shape_.key_dim + c]);
        }
        for (int64_t c = 0; c < shape_.value_dim; ++c) {
          Put(block, kv_cache::ValueOffset(layout_, tpb, slot, h) + c,
              s.values[(t * shape_.kv_heads + h) * shape_.value_dim + c]);
        }
      }
    }
  }

  PagedShape shape_;
  kv_cache::KvLayout layout_;
  int64_t block_bytes_ = 0, num_blocks_ = 0;
  std::vector<uint8_t> bytes_;
  std::vector<kv_cache::BlockId> permutation_;  // blocks in the order sequences take them
  size_t next_block_ = 0;
  std::vector<PagedSequence> sequences_;
};

// Dense decode attention in precision T on the gathered KV: the textbook loops. With a
// window W, query i (at position p) sees keys p - W + 1 .. p. With `bf16_products`, the
// query and the exps that weigh the values are rounded to bf16 first, as bf16 products
// round them (the sum of the exps stays unrounded).
template <typename T>
void PagedReferenceDecode(const PagedShape& shape, const PagedSequence& s, float scale,
                          int64_t window, std::vector<T>* output, std::vector<T>* log_sum_exp,
                          bool bf16_products = false) {
  const auto operand = [bf16_products](T x) {
    if (!bf16_products) return x;
    return static_cast<T>(BFloat16BitsToFloat(FloatToBFloat16Bits(static_cast<float>(x))));
  };
  const int64_t group = shape.heads / shape.kv_heads;
  output->assign(s.queries * shape.heads * shape.value_dim, 0);
  log_sum_exp->assign(s.queries * shape.heads, 0);
  std::vector<T> scores;
  for (int64_t i = 0; i < s.queries; ++i) {
    const int64_t end = s.length - s.queries + i + 1;
    const int64_t begin = window > 0 ? std::max<int64_t>(0, end - window) : 0;
    const int64_t visible = end - begin;
    for (int64_t h = 0; h < shape.heads; ++h) {
      const int64_t kv = h / group;
      const float* q = &s.query[(i * shape.heads + h) * shape.key_dim];
      scores.assign(visible, 0);
      T max = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        const float* k = &s.keys[((begin + j) * shape.kv_heads + kv) * shape.key_dim];
        T dot = 0;
        for (int64_t c = 0; c < shape.key_dim; ++c) {
          dot += operand(static_cast<T>(q[c])) * static_cast<T>(k[c]);
        }
        scores[j] = dot * static_cast<T>(scale);
        max = std::max(max, scores[j]);
      }
      T sum = 0;
      for (T& x : scores) sum += (x = std::exp(x - max));
      for (int64_t c = 0; c < shape.value_dim; ++c) {
        T acc = 0;
        for (int64_t j = 0; j < visible; ++j) {
          const float value = s.values[((begin + j) * shape.kv_heads + kv) * shape.value_dim + c];
          acc += operand(scores[j]) * static_cast<T>(value);
        }
        (*output)[(i * shape.heads + h) * shape.value_dim + c] = acc / sum;
      }
      (*log_sum_exp)[i * shape.heads + h] = max + std::log(sum);
    }
  }
}

inline ::testing::AssertionResult PagedMatchesReferences(HostPagedPool& pool, size_t index,
                                                         FidelityStats& outputs,
                                                         FidelityStats& lses) {
  const PagedSequence& s = pool.sequences()[index];
  std::vector<double> oracle, oracle_lse;
  std::vector<float> textbook, textbook_lse;
  PagedReferenceDecode<double>(pool.shape(), s, pool.scale(), pool.sliding_window, &oracle,
                               &oracle_lse);
  PagedReferenceDecode<float>(pool.shape(), s, pool.scale(), pool.sliding_window, &textbook,
                              &textbook_lse);
  ::testing::AssertionResult result = outputs.Check(s.output, textbook, oracle);
  if (!result) return result << " (output)";
  result = lses.Check(s.log_sum_exp, textbook_lse, oracle_lse);
  if (!result) return result << " (log-sum-exp)";
  return result;
}

}  // namespace attention::core::testing

#endif  // ATTENTION_TESTS_CORE_PAGED_DECODE_FIXTURE_H_

// Seeded random attention options for the randomized comparisons against the reference.
#ifndef ATTENTION_TESTS_CORE_RANDOM_OPTIONS_H_
#define ATTENTION_TESTS_CORE_RANDOM_OPTIONS_H_

#include <algorithm>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/attention_options.h"
#include "core/dtype.h"

// Whether this build runs under AddressSanitizer or ThreadSanitizer (gcc says so with a
// macro, clang with __has_feature).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ATTENTION_TESTS_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ATTENTION_TESTS_SANITIZED 1
#endif
#endif

namespace attention::core::testing {

// `trials` of a seeded random grid, or the first quarter of them (at least 1) in a sanitizer
// build, whose instrumentation makes each trial several times slower (clang's ASan checks
// every intrinsic load): the Release build runs the whole grid, the sanitizers its prefix.
inline int TrialsForThisBuild(int trials) {
#if defined(ATTENTION_TESTS_SANITIZED)
  return std::max(1, trials / 4);
#else
  return trials;
#endif
}

inline std::vector<float> RandomFloats(std::mt19937_64& rng, size_t count) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = uniform(rng);
  return values;
}

// `count` values uniform in [-1, 1), rounded to bf16 bits.
inline std::vector<uint16_t> UniformBf16(std::mt19937_64& rng, int64_t count) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<uint16_t> values(count);
  for (uint16_t& v : values) v = FloatToBFloat16(uniform(rng));
  return values;
}

// Every option on or off at random; masks valid for `dims`.
inline AttentionOptions RandomOptions(std::mt19937_64& rng, const AttentionDims& dims) {
  auto coin = [&rng](double p) { return std::bernoulli_distribution(p)(rng); };
  AttentionOptions options;
  options.causal = coin(0.4);
  if (coin(0.3)) {
    for (int64_t b = 0; b < dims.batch; ++b) {
      options.key_lengths.push_back(std::uniform_int_distribution<int64_t>(0, dims.kv_len)(rng));
    }
  }
  if (coin(0.3)) {
    options.key_padding_keep.resize(dims.batch * dims.kv_len);
    for (auto& keep : options.key_padding_keep) keep = coin(0.8);
  }
  if (coin(0.4)) {
    const int64_t full[4] = {dims.batch, dims.num_heads, dims.q_len, dims.kv_len};
    int64_t count = 1;
    for (int d = 0; d < 4; ++d) {
      options.attn_mask_dims[d] = coin(0.5) ? full[d] : 1;
      count *= options.attn_mask_dims[d];
    }
    if (coin(0.5)) {
      options.attn_mask_keep.resize(count);
      for (auto& keep : options.attn_mask_keep) keep = coin(0.85);
    } else {
      options.attn_mask_bias = RandomFloats(rng, count);
      for (float& bias : options.attn_mask_bias) {
        if (coin(0.1)) bias = -std::numeric_limits<float>::infinity();
      }
    }
  }
  if (coin(0.3)) options.scale = std::uniform_real_distribution<float>(0.05f, 2.0f)(rng);
  if (coin(0.2)) {
    options.dropout_p = std::uniform_real_distribution<float>(0.0f, 0.6f)(rng);
    options.dropout_seed = rng();
  }
  const int need = std::uniform_int_distribution<int>(0, 2)(rng);
  options.need_weights = static_cast<NeedWeights>(need);
  return options;
}

inline std::string Describe(const AttentionDims& d, const AttentionOptions& o) {
  std::ostringstream out;
  out << "B=" << d.batch << " H=" << d.num_heads << " Hkv=" << d.num_kv_heads
      << " Nq=" << d.q_len << " Nk=" << d.kv_len << " dk=" << d.head_dim
      << " dv=" << d.v_head_dim << " causal=" << o.causal
      << " key_lengths=" << !o.key_lengths.empty() << " padding=" << !o.key_padding_keep.empty()
      << " bool_mask=" << !o.attn_mask_keep.empty() << " float_mask=" << !o.attn_mask_bias.empty()
      << " mask_dims=[" << o.attn_mask_dims[0] << "," << o.attn_mask_dims[1] << ","
      << o.attn_mask_dims[2] << "," << o.attn_mask_dims[3] << "]"
      << " scale=" << (o.scale ? *o.scale : -1) << " dropout=" << o.dropout_p
      << " need_weights=" << static_cast<int>(o.need_weights);
  return out.str();
}

// Seed for a randomized test: ATTENTION_TEST_SEED if set, else a fixed default.
inline uint64_t TestSeed(uint64_t fallback) {
  const char* env = std::getenv("ATTENTION_TEST_SEED");
  return env != nullptr ? std::stoull(env) : fallback;
}

}  // namespace attention::core::testing

#endif  // ATTENTION_TESTS_CORE_RANDOM_OPTIONS_H_

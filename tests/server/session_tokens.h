// Session-table test helpers: a caller's random tokens, step entries over them, steps one
// token at a time, a table's options by pool and block size, a GQA shape and a fresh
// directory.
#ifndef ATTENTION_TESTS_SERVER_SESSION_TOKENS_H_
#define ATTENTION_TESTS_SERVER_SESSION_TOKENS_H_

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/sessions/session_table.h"

namespace attention::server::testing {

// A sequence's tokens as the caller holds them: q [L][H][dk], k [L][Hkv][dk], v [L][Hkv][dv].
struct Tokens {
  std::vector<float> q, k, v;
};

inline Tokens RandomTokens(const SessionShape& shape, int64_t length, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t dv = shape.v_head_dim > 0 ? shape.v_head_dim : shape.head_dim;
  Tokens tokens;
  tokens.q.resize(length * shape.num_heads * shape.head_dim);
  tokens.k.resize(length * shape.num_kv_heads * shape.head_dim);
  tokens.v.resize(length * shape.num_kv_heads * dv);
  for (auto* values : {&tokens.q, &tokens.k, &tokens.v}) {
    for (float& x : *values) x = normal(rng);
  }
  return tokens;
}

// A step entry for tokens [position, position + n) of `tokens`, answering into `output`.
inline StepEntry Entry(const SessionInfo& session, const Tokens& tokens, int64_t layer,
                       int64_t position, int64_t n, std::vector<float>* output) {
  const SessionShape& shape = session.shape;
  const int64_t dv = shape.v_head_dim > 0 ? shape.v_head_dim : shape.head_dim;
  output->assign(n * shape.num_heads * dv, 0.0f);
  StepEntry entry;
  entry.session_id = session.id;
  entry.layer = layer;
  entry.position = position;
  entry.num_tokens = n;
  entry.query = tokens.q.data() + position * shape.num_heads * shape.head_dim;
  entry.key = tokens.k.data() + position * shape.num_kv_heads * shape.head_dim;
  entry.value = tokens.v.data() + position * shape.num_kv_heads * dv;
  entry.output = output->data();
  return entry;
}

// Steps tokens [from, to) of every layer of `session` at `now`, one token per step,
// appending the answers to `answers`.
inline void StepOneTokenAtATime(SessionTable& table, const SessionInfo& session,
                                const Tokens& tokens, int64_t from, int64_t to, absl::Time now,
                                std::vector<float>* answers) {
  for (int64_t position = from; position < to; ++position) {
    for (int64_t layer = 0; layer < session.shape.num_layers; ++layer) {
      std::vector<float> output;
      const StepEntry entry = Entry(session, tokens, layer, position, 1, &output);
      const absl::Status status = table.Step({&entry, 1}, now)[0];
      ASSERT_TRUE(status.ok()) << status;
      answers->insert(answers->end(), output.begin(), output.end());
    }
  }
}

// Two layers of 4 query heads over 2 KV heads of 16 dims.
inline SessionShape GqaShape() {
  SessionShape shape;
  shape.num_layers = 2;
  shape.num_heads = 4;
  shape.num_kv_heads = 2;
  shape.head_dim = 16;
  return shape;
}

// A fresh directory under the test's temporary directory.
inline std::string FreshDirectory(const std::string& name) {
  std::string path = absl::StrCat(::testing::TempDir(), "/", name, "-", getpid());
  std::filesystem::remove_all(path);
  std::filesystem::create_directories(path);
  return path;
}

// A pool of `kv_cache_bytes` in blocks of `block_bytes`.
inline SessionTableOptions Options(int64_t kv_cache_bytes = 16 << 20,
                                   int64_t block_bytes = 64 << 10) {
  SessionTableOptions options;
  options.kv_cache_bytes = kv_cache_bytes;
  options.block_bytes = block_bytes;
  return options;
}

}  // namespace attention::server::testing

#endif  // ATTENTION_TESTS_SERVER_SESSION_TOKENS_H_

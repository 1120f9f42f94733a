// The requests attention-loadgen sends.
#ifndef ATTENTION_CLIENT_LOADGEN_REQUESTS_H_
#define ATTENTION_CLIENT_LOADGEN_REQUESTS_H_

#include <cstdint>
#include <memory>
#include <random>
#include <string>

#include "attention/v1/attention.pb.h"
#include "client/loadgen/config.h"

namespace attention::loadgen {

using Request = v1::MultiHeadAttentionRequest;

// Builds requests from one pre-encoded payload of random N(0, 1) values (enough for the
// longest sequence); a request of N tokens carries its first B * N * E elements.
// Thread-safe (immutable after construction).
class RequestFactory {
 public:
  explicit RequestFactory(const Config& config);

  std::unique_ptr<Request> Make(int64_t tokens) const;

  // Query tokens answered by a request of sequence length `tokens`.
  int64_t QueryTokens(int64_t tokens) const { return config_.batch * tokens; }

  int64_t PickLength(std::mt19937_64& rng) const;

 private:
  const Config& config_;
  std::string payload_;
  int64_t element_size_ = 4;
  v1::DataType wire_dtype_ = v1::FLOAT32;
};

}  // namespace attention::loadgen

#endif  // ATTENTION_CLIENT_LOADGEN_REQUESTS_H_

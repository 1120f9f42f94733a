// The run configuration of attention-loadgen, read from its command-line flags.
#ifndef ATTENTION_CLIENT_LOADGEN_CONFIG_H_
#define ATTENTION_CLIENT_LOADGEN_CONFIG_H_

#include <cstdint>
#include <memory>
#include <string>

#include <grpcpp/security/credentials.h>

#include "client/attention_client.h"
#include "core/dtype.h"

namespace attention::loadgen {

struct Config {
  std::string target;
  client::ClientOptions connection;  // TLS, from the shared connection flags
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string layer;
  bool stream = false;
  bool open_loop = false;
  int concurrency = 1;
  double rate = 0;
  int streams = 0;  // resolved: > 0 in stream mode
  int connections = 1;
  int64_t batch = 1;
  int64_t min_tokens = 16;
  int64_t max_tokens = 16;
  std::string tokens_flag;
  int64_t embed_dim = 0;
  int64_t inline_layer_heads = 0;  // > 0: requests carry an inline layer
  uint64_t inline_layer_seed = 1;
  std::string dtype_name;
  core::DType dtype = core::DType::kFloat32;
  bool causal = false;
  double duration = 10;
  double warmup = 1;
  uint64_t seed = 1;
  double drain_timeout = 10;
  double request_timeout = 60;
  int64_t max_outstanding = 10000;
  std::string json_path;
};

// Reads and checks the flags; on error prints the reason and returns false.
bool ReadConfig(Config* c);

}  // namespace attention::loadgen

#endif  // ATTENTION_CLIENT_LOADGEN_CONFIG_H_

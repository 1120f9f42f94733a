// attention-cli: embeds a sentence, sends it to a layer on the server and prints what
// comes back. Used by the README's run command. With --health it only asks the server's
// grpc.health.v1 service (the container image's HEALTHCHECK).
#include <chrono>
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_join.h"
#include "attention_version.h"
#include "client/attention_client.h"
#include "client/connection_flags.h"
#include "tensor_codec.h"

ABSL_FLAG(std::string, target, "localhost:50051", "server address");
ABSL_FLAG(std::string, layer, "demo-bert-base", "name of a layer loaded on the server");
ABSL_FLAG(std::string, text, "time flies like an arrow", "sentence to embed, one token per word");
ABSL_FLAG(uint64_t, embedding_seed, 0, "seed of the deterministic word embedding");
ABSL_FLAG(std::string, dtype, "float32", "wire dtype: float32, float16 or bfloat16");
ABSL_FLAG(bool, causal, false, "causal attention");
ABSL_FLAG(int, show, 6, "values shown per row");
ABSL_FLAG(bool, health, false,
          "only check health: grpc.health.v1 Check for the whole server; prints SERVING and "
          "exits 0 when it is, else prints the status and exits 1");

namespace {

using attention::client::AttentionClient;
namespace v1 = attention::v1;

void PrintRows(const std::string& title, const std::vector<float>& values, int64_t rows,
               int64_t width, int show, const std::vector<std::string>& labels) {
  std::printf("%s\n", title.c_str());
  for (int64_t r = 0; r < rows; ++r) {
    std::printf("  %-8s [", labels[r].c_str());
    for (int64_t c = 0; c < std::min<int64_t>(width, show); ++c) {
      std::printf("%s% .4f", c == 0 ? "" : ", ", values[r * width + c]);
    }
    std::printf("%s]\n", width > show ? ", ..." : "");
  }
}

int Run() {
  auto options = attention::client::ClientOptionsFromFlags();
  if (!options.ok()) {
    std::cerr << options.status() << std::endl;
    return 2;
  }
  AttentionClient client(absl::GetFlag(FLAGS_target), *options);
  if (absl::GetFlag(FLAGS_health)) {
    auto serving = client.IsServing();
    if (!serving.ok()) {
      std::cerr << "health check: " << serving.status() << std::endl;
      return 1;
    }
    std::cout << (*serving ? "SERVING" : "NOT_SERVING") << std::endl;
    return *serving ? 0 : 1;
  }
  auto layer = client.GetLayer(absl::GetFlag(FLAGS_layer));
  if (!layer.ok()) {
    std::cerr << "GetLayer: " << layer.status() << std::endl;
    return 1;
  }
  const auto words = attention::client::SplitWords(absl::GetFlag(FLAGS_text));
  if (words.empty()) {
    std::cerr << "--text has no words" << std::endl;
    return 2;
  }
  const int64_t embed_dim = layer->config().embed_dim();
  const int64_t tokens = static_cast<int64_t>(words.size());
  const std::vector<float> embedding =
      attention::client::EmbedWords(words, embed_dim, absl::GetFlag(FLAGS_embedding_seed));

  const std::string dtype_name = absl::GetFlag(FLAGS_dtype);
  attention::core::DType dtype = attention::core::DType::kFloat32;
  if (dtype_name == "float16") {
    dtype = attention::core::DType::kFloat16;
  } else if (dtype_name == "bfloat16") {
    dtype = attention::core::DType::kBFloat16;
  } else if (dtype_name != "float32") {
    std::cerr << "--dtype must be float32, float16 or bfloat16" << std::endl;
    return 2;
  }
  v1::MultiHeadAttentionRequest request;
  request.set_layer(layer->name());
  request.set_request_id("attention-cli");
  const std::vector<int64_t> shape = {1, tokens, embed_dim};
  attention::wire::EncodeTensor(embedding, shape, dtype, request.mutable_query());
  request.mutable_options()->set_causal(absl::GetFlag(FLAGS_causal));
  request.mutable_options()->set_need_weights(v1::NEED_WEIGHTS_AVERAGED);

  const auto start = std::chrono::steady_clock::now();
  auto response = client.MultiHeadAttention(request);
  const double millis =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!response.ok()) {
    std::cerr << "MultiHeadAttention: " << response.status() << std::endl;
    return 1;
  }
  auto output = attention::wire::DecodeFloatTensor(response->output(), "output");
  auto weights = attention::wire::DecodeFloatTensor(response->attention_weights(), "weights");
  if (!output.ok() || !weights.ok()) {
    std::cerr << "bad response: " << (output.ok() ? weights.status() : output.status())
              << std::endl;
    return 1;
  }
  const int show = absl::GetFlag(FLAGS_show);
  std::printf("layer %s v%llu on %s: embed_dim %lld, %lld heads, %lld parameters\n",
              layer->name().c_str(), static_cast<unsigned long long>(response->layer_version()),
              layer->device().c_str(),
              static_cast<long long>(embed_dim), static_cast<long long>(layer->config().num_heads()),
              static_cast<long long>(layer->parameter_count()));
  std::printf("input \"%s\": %lld tokens, %s, round trip %.2f ms\n",
              absl::GetFlag(FLAGS_text).c_str(), static_cast<long long>(tokens),
              dtype_name.c_str(), millis);
  std::printf("attention output shape [%s]\n", absl::StrJoin(output->shape, ", ").c_str());
  PrintRows("attention output (first values per token):", output->values, tokens,
            output->shape[2], show, words);
  std::printf("attention weights shape [%s] (averaged over heads)\n",
              absl::StrJoin(weights->shape, ", ").c_str());
  PrintRows("attention weights (row = query token, columns = key tokens):", weights->values,
            tokens, tokens, show, words);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Sends a sentence through a multi-head-attention layer.");
  attention::SetVersionFlagOutput("attention-cli");
  absl::ParseCommandLine(argc, argv);
  return Run();
}

// attention-loadgen's requests: one random payload, cut to each request's length.
#include "client/loadgen/requests.h"

#include <vector>

#include "tensor_codec.h"

namespace attention::loadgen {

RequestFactory::RequestFactory(const Config& config) : config_(config) {
  const int64_t count = config.batch * config.max_tokens * config.embed_dim;
  std::mt19937_64 rng(config.seed ^ 0x9e3779b97f4a7c15ULL);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  payload_ = core::EncodeFloats(values, config.dtype);
  element_size_ = core::ElementSize(config.dtype);
  wire_dtype_ = wire::WireDType(config.dtype);
}

std::unique_ptr<Request> RequestFactory::Make(int64_t tokens) const {
  auto request = std::make_unique<Request>();
  if (config_.inline_layer_heads > 0) {
    v1::LayerSpec* spec = request->mutable_inline_layer();
    spec->mutable_config()->set_embed_dim(config_.embed_dim);
    spec->mutable_config()->set_num_heads(config_.inline_layer_heads);
    spec->mutable_random_init()->set_seed(config_.inline_layer_seed);
  } else {
    request->set_layer(config_.layer);
  }
  v1::Tensor* query = request->mutable_query();
  query->set_dtype(wire_dtype_);
  query->add_shape(config_.batch);
  query->add_shape(tokens);
  query->add_shape(config_.embed_dim);
  query->set_raw_data(payload_.data(), static_cast<size_t>(config_.batch * tokens *
                                                           config_.embed_dim * element_size_));
  if (config_.causal) request->mutable_options()->set_causal(true);
  return request;
}

int64_t RequestFactory::PickLength(std::mt19937_64& rng) const {
  if (config_.min_tokens == config_.max_tokens) return config_.min_tokens;
  return std::uniform_int_distribution<int64_t>(config_.min_tokens, config_.max_tokens)(rng);
}

}  // namespace attention::loadgen

// Every rejection the server makes: the specific status code and a message naming the
// field and the values. The server answers a valid request after all of them.
#include <cmath>
#include <functional>

#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

using wire::EncodeTensor;

struct MhaCase {
  std::string name;
  std::function<void(v1::MultiHeadAttentionRequest&)> corrupt;
  absl::StatusCode code;
  std::string message_part;
};

void SetMask(v1::Tensor* tensor, v1::DataType dtype, std::vector<int64_t> shape) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  tensor->set_dtype(dtype);
  tensor->mutable_shape()->Assign(shape.begin(), shape.end());
  tensor->set_raw_data(std::string(count * (dtype == v1::BOOL ? 1 : 4), '\0'));
}

std::vector<MhaCase> MhaCases() {
  using C = absl::StatusCode;
  return {
      {"byte count short", [](auto& r) { r.mutable_query()->mutable_raw_data()->pop_back(); },
       C::kInvalidArgument, "query.raw_data has 15359 bytes; shape [1, 5, 768] of FLOAT32 needs 15360"},
      {"rank 2", [](auto& r) { r.mutable_query()->mutable_shape()->Set(0, 5), r.mutable_query()->mutable_shape()->Set(1, 768), r.mutable_query()->mutable_shape()->RemoveLast(); },
       C::kInvalidArgument, "query.shape [5, 768] has rank 2; expected [B, Nq, embed_dim]"},
      {"zero dim", [](auto& r) { r.mutable_query()->mutable_shape()->Set(1, 0); },
       C::kInvalidArgument, "query.shape[1] = 0 must be >= 1"},
      {"negative dim", [](auto& r) { r.mutable_query()->mutable_shape()->Set(0, -3); },
       C::kInvalidArgument, "query.shape[0] = -3 must be >= 1"},
      {"overflowing dims", [](auto& r) { r.mutable_query()->mutable_shape()->Set(0, int64_t{1} << 40); r.mutable_query()->mutable_shape()->Set(1, int64_t{1} << 40); },
       C::kInvalidArgument, "has more than 2147483648 elements"},
      {"unknown layer", [](auto& r) { r.set_layer("nope"); },
       C::kNotFound, "layer \"nope\" is not loaded (loaded: demo-bert-base)"},
      {"no layer", [](auto& r) { r.clear_layer(); },
       C::kInvalidArgument, "layer is empty"},
      {"layer and inline layer", [](auto& r) { r.mutable_inline_layer()->mutable_random_init(); },
       C::kInvalidArgument, "are both set"},
      {"heads do not divide embed dim", [](auto& r) {
         r.clear_layer();
         r.mutable_inline_layer()->mutable_config()->set_embed_dim(10);
         r.mutable_inline_layer()->mutable_config()->set_num_heads(3);
         r.mutable_inline_layer()->mutable_random_init();
       },
       C::kInvalidArgument, "inline_layer.config.num_heads = 3 does not divide config.embed_dim = 10"},
      {"kv heads do not divide heads", [](auto& r) {
         r.clear_layer();
         auto* config = r.mutable_inline_layer()->mutable_config();
         config->set_embed_dim(768), config->set_num_heads(12), config->set_num_kv_heads(5);
         r.mutable_inline_layer()->mutable_random_init();
       },
       C::kInvalidArgument, "config.num_kv_heads = 5 must be >= 1 and divide config.num_heads = 12"},
      {"inline layer without weights", [](auto& r) {
         r.clear_layer();
         r.mutable_inline_layer()->mutable_config()->set_embed_dim(768);
         r.mutable_inline_layer()->mutable_config()->set_num_heads(12);
       },
       C::kInvalidArgument, "inline_layer.weights is not set"},
      {"unknown dtype", [](auto& r) { r.mutable_query()->set_dtype(static_cast<v1::DataType>(42)); },
       C::kInvalidArgument, "query.dtype = 42 is not a known DataType"},
      {"unspecified dtype", [](auto& r) { r.mutable_query()->set_dtype(v1::DATA_TYPE_UNSPECIFIED); },
       C::kInvalidArgument, "query.dtype is DATA_TYPE_UNSPECIFIED"},
      {"bool query", [](auto& r) { r.mutable_query()->set_dtype(v1::BOOL); },
       C::kInvalidArgument, "query.dtype is BOOL"},
      {"missing query", [](auto& r) { r.clear_query(); }, C::kInvalidArgument, "query is missing"},
      {"float_data count", [](auto& r) { r.mutable_query()->clear_raw_data(); r.mutable_query()->add_float_data(1.0f); },
       C::kInvalidArgument, "query.float_data has 1 values; shape [1, 5, 768] needs 3840"},
      {"raw and float data", [](auto& r) { r.mutable_query()->add_float_data(1.0f); },
       C::kInvalidArgument, "query has both raw_data and float_data"},
      {"wrong embed dim", [](auto& r) {
         EncodeTensor(std::vector<float>(10), std::vector<int64_t>{1, 1, 10}, core::DType::kFloat32, r.mutable_query());
       },
       C::kInvalidArgument, "query.shape[2] = 10 must equal the layer's embed_dim = 768"},
      {"key without value", [](auto& r) { *r.mutable_key() = r.query(); },
       C::kInvalidArgument, "key is set but value is not"},
      {"key batch mismatch", [](auto& r) {
         EncodeTensor(std::vector<float>(2 * 3 * 768), std::vector<int64_t>{2, 3, 768}, core::DType::kFloat32, r.mutable_key());
         *r.mutable_value() = r.key();
       },
       C::kInvalidArgument, "key.shape[0] = 2 must equal query batch size B = 1"},
      {"key length out of range", [](auto& r) { r.mutable_options()->add_key_lengths(9); },
       C::kInvalidArgument, "options.key_lengths[0] = 9 is outside [0, 5] (Nk)"},
      {"key lengths count", [](auto& r) { r.mutable_options()->add_key_lengths(1); r.mutable_options()->add_key_lengths(1); },
       C::kInvalidArgument, "options.key_lengths has 2 values; expected batch size 1"},
      {"dropout 1.5", [](auto& r) { r.mutable_options()->set_dropout_p(1.5f); },
       C::kInvalidArgument, "options.dropout_p = 1.5 is outside [0, 1)"},
      {"scale NaN", [](auto& r) { r.mutable_options()->set_scale(std::nanf("")); },
       C::kInvalidArgument, "options.scale = nan is not finite"},
      {"mask not broadcastable", [](auto& r) { SetMask(r.mutable_options()->mutable_attn_mask(), v1::BOOL, {3, 5}); },
       C::kInvalidArgument, "options.attn_mask shape [1, 1, 3, 5] is not broadcastable to [B, H, Nq, Nk] = [1, 12, 5, 5]"},
      {"mask rank 5", [](auto& r) { SetMask(r.mutable_options()->mutable_attn_mask(), v1::BOOL, {1, 1, 1, 5, 5}); },
       C::kInvalidArgument, "options.attn_mask has rank 5"},
      {"float key padding mask", [](auto& r) { SetMask(r.mutable_options()->mutable_key_padding_mask(), v1::FLOAT32, {1, 5}); },
       C::kInvalidArgument, "options.key_padding_mask.dtype is FLOAT32; expected BOOL"},
      {"key padding shape", [](auto& r) { SetMask(r.mutable_options()->mutable_key_padding_mask(), v1::BOOL, {1, 4}); },
       C::kInvalidArgument, "options.key_padding_mask.shape [1, 4] must be [B, Nk] = [1, 5]"},
      {"unknown need_weights", [](auto& r) { r.mutable_options()->set_need_weights(static_cast<v1::NeedWeights>(7)); },
       C::kInvalidArgument, "options.need_weights = 7 is not a known NeedWeights value"},
      {"unknown polarity", [](auto& r) { r.mutable_options()->set_attn_mask_polarity(static_cast<v1::BoolMaskPolarity>(9)); },
       C::kInvalidArgument, "options.attn_mask_polarity = 9 is not a known BoolMaskPolarity"},
      {"negative queue timeout", [](auto& r) { r.mutable_options()->set_queue_timeout_us(-5); },
       C::kInvalidArgument, "options.queue_timeout_us = -5 must be >= 0"},
      {"float_data with FLOAT16", [](auto& r) { r.set_float_data_output(true), r.set_output_dtype(v1::FLOAT16); },
       C::kInvalidArgument, "output_dtype = FLOAT16 cannot travel in float_data"},
      {"bool output dtype", [](auto& r) { r.set_output_dtype(v1::BOOL); },
       C::kInvalidArgument, "output_dtype is BOOL"},
      {"unknown output dtype", [](auto& r) { r.set_output_dtype(static_cast<v1::DataType>(42)); },
       C::kInvalidArgument, "output_dtype = 42 is not a known DataType"},
      {"unknown key padding polarity", [](auto& r) { r.mutable_options()->set_key_padding_polarity(static_cast<v1::BoolMaskPolarity>(7)); },
       C::kInvalidArgument, "options.key_padding_polarity = 7 is not a known BoolMaskPolarity"},
      {"key rank 2", [](auto& r) {
         EncodeTensor(std::vector<float>(5 * 768), std::vector<int64_t>{5, 768}, core::DType::kFloat32, r.mutable_key());
         *r.mutable_value() = r.key();
       },
       C::kInvalidArgument, "key.shape [5, 768] has rank 2; expected [B, Nk, kdim]"},
      {"value length differs from key length", [](auto& r) {
         EncodeTensor(std::vector<float>(4 * 768), std::vector<int64_t>{1, 4, 768}, core::DType::kFloat32, r.mutable_key());
         EncodeTensor(std::vector<float>(3 * 768), std::vector<int64_t>{1, 3, 768}, core::DType::kFloat32, r.mutable_value());
       },
       C::kInvalidArgument, "value.shape[1] = 3 must equal key length Nk = 4"},
      {"value width differs from vdim", [](auto& r) {
         EncodeTensor(std::vector<float>(4 * 768), std::vector<int64_t>{1, 4, 768}, core::DType::kFloat32, r.mutable_key());
         EncodeTensor(std::vector<float>(4 * 7), std::vector<int64_t>{1, 4, 7}, core::DType::kFloat32, r.mutable_value());
       },
       C::kInvalidArgument, "value.shape[2] = 7 must equal the layer's vdim = 768"},
      {"negative key length", [](auto& r) { r.mutable_options()->add_key_lengths(-1); },
       C::kInvalidArgument, "options.key_lengths[0] = -1 is outside [0, 5] (Nk)"},
      {"scale infinite", [](auto& r) { r.mutable_options()->set_scale(INFINITY); },
       C::kInvalidArgument, "options.scale = inf is not finite"},
      {"negative dropout", [](auto& r) { r.mutable_options()->set_dropout_p(-0.5f); },
       C::kInvalidArgument, "options.dropout_p = -0.5 is outside [0, 1)"},
      {"bool mask byte count", [](auto& r) {
         SetMask(r.mutable_options()->mutable_attn_mask(), v1::BOOL, {5, 5});
         r.mutable_options()->mutable_attn_mask()->mutable_raw_data()->pop_back();
       },
       C::kInvalidArgument, "options.attn_mask.raw_data has 24 bytes; shape [5, 5] of BOOL needs 25"},
      {"float16 query byte count", [](auto& r) {
         EncodeTensor(std::vector<float>(5 * 768), std::vector<int64_t>{1, 5, 768}, core::DType::kFloat16, r.mutable_query());
         r.mutable_query()->mutable_raw_data()->pop_back();
       },
       C::kInvalidArgument, "query.raw_data has 7679 bytes; shape [1, 5, 768] of FLOAT16 needs 7680"},
      {"request id too long", [](auto& r) { r.set_request_id(std::string(300, 'x')); },
       C::kInvalidArgument, "request_id has 300 bytes; at most 256"},
      {"unknown field in an inline weight tensor", [](auto& r) {
         r.clear_layer();
         r.mutable_inline_layer()->mutable_config()->set_embed_dim(768);
         r.mutable_inline_layer()->mutable_config()->set_num_heads(12);
         v1::Tensor& tensor =
             (*r.mutable_inline_layer()->mutable_inline_weights()->mutable_tensors())["q_proj.weight"];
         tensor.GetReflection()->MutableUnknownFields(&tensor)->AddVarint(33, 1);
       },
       C::kUnimplemented,
       "inline_layer.inline_weights.tensors[\"q_proj.weight\"] (attention.v1.Tensor) field 33"},
      {"safetensors inline layer", [](auto& r) {
         r.clear_layer();
         r.mutable_inline_layer()->mutable_config()->set_embed_dim(768);
         r.mutable_inline_layer()->mutable_config()->set_num_heads(12);
         r.mutable_inline_layer()->mutable_safetensors()->set_path("x.safetensors");
       },
       C::kFailedPrecondition, "inline_layer.safetensors: the server has no model repository"},
  };
}

TEST_F(ServerTest, MalformedMultiHeadAttentionRequestsAreRejected) {
  std::mt19937_64 rng(3);
  const v1::MultiHeadAttentionRequest valid = DemoRequest(rng, 1, 5);
  for (const MhaCase& test_case : MhaCases()) {
    v1::MultiHeadAttentionRequest request = valid;
    test_case.corrupt(request);
    const absl::Status status = client_->MultiHeadAttention(request).status();
    EXPECT_EQ(status.code(), test_case.code) << test_case.name << ": " << status;
    EXPECT_NE(status.message().find(test_case.message_part), std::string::npos)
        << test_case.name << ": got \"" << status.message() << "\"";
  }
  EXPECT_TRUE(client_->MultiHeadAttention(valid).ok()) << "server must still answer";
}

TEST_F(ServerTest, MalformedScaledDotProductAttentionRequestsAreRejected) {
  std::mt19937_64 rng(4);
  v1::ScaledDotProductAttentionRequest valid;
  EncodeTensor(RandomValues(rng, 2 * 4 * 3 * 8), std::vector<int64_t>{2, 4, 3, 8},
               core::DType::kFloat32, valid.mutable_query());
  EncodeTensor(RandomValues(rng, 2 * 2 * 5 * 8), std::vector<int64_t>{2, 2, 5, 8},
               core::DType::kFloat32, valid.mutable_key());
  EncodeTensor(RandomValues(rng, 2 * 2 * 5 * 6), std::vector<int64_t>{2, 2, 5, 6},
               core::DType::kFloat32, valid.mutable_value());
  ASSERT_TRUE(client_->ScaledDotProductAttention(valid).ok());
  struct Case {
    std::string name;
    std::function<void(v1::ScaledDotProductAttentionRequest&)> corrupt;
    std::string message_part;
  };
  const std::vector<Case> cases = {
      {"kv heads do not divide heads",
       [&](auto& r) {
         EncodeTensor(RandomValues(rng, 2 * 3 * 5 * 8), std::vector<int64_t>{2, 3, 5, 8},
                      core::DType::kFloat32, r.mutable_key());
         EncodeTensor(RandomValues(rng, 2 * 3 * 5 * 6), std::vector<int64_t>{2, 3, 5, 6},
                      core::DType::kFloat32, r.mutable_value());
       },
       "key.shape[1] (Hkv) = 3 must be >= 1 and divide query.shape[1] (H) = 4"},
      {"head size mismatch",
       [&](auto& r) {
         EncodeTensor(RandomValues(rng, 2 * 2 * 5 * 7), std::vector<int64_t>{2, 2, 5, 7},
                      core::DType::kFloat32, r.mutable_key());
       },
       "key.shape[3] = 7 must equal query head size dk = 8"},
      {"value length mismatch",
       [&](auto& r) {
         EncodeTensor(RandomValues(rng, 2 * 2 * 4 * 6), std::vector<int64_t>{2, 2, 4, 6},
                      core::DType::kFloat32, r.mutable_value());
       },
       "value.shape[2] = 4 must equal key length Nk = 5"},
      {"query rank",
       [&](auto& r) {
         EncodeTensor(RandomValues(rng, 2 * 12 * 8), std::vector<int64_t>{2, 12, 8},
                      core::DType::kFloat32, r.mutable_query());
       },
       "query.shape [2, 12, 8] has rank 3; expected [B, H, Nq, dk]"},
      {"missing value", [](auto& r) { r.clear_value(); }, "value is missing"},
      {"negative queue timeout", [](auto& r) { r.mutable_options()->set_queue_timeout_us(-1); },
       "options.queue_timeout_us = -1 must be >= 0"},
      {"causal with lengths beyond Nk",
       [](auto& r) {
         r.mutable_options()->set_causal(true);
         r.mutable_options()->add_key_lengths(6);
         r.mutable_options()->add_key_lengths(1);
       },
       "options.key_lengths[0] = 6 is outside [0, 5] (Nk)"},
      {"bool compute", [](auto& r) { r.set_compute_dtype(v1::BOOL); },
       "compute_dtype = BOOL is not a compute precision; expected FLOAT32, BFLOAT16 or FLOAT16"},
      {"unknown compute dtype", [](auto& r) { r.set_compute_dtype(static_cast<v1::DataType>(77)); },
       "compute_dtype = 77 is not a known DataType"},
  };
  for (const Case& test_case : cases) {
    v1::ScaledDotProductAttentionRequest request = valid;
    test_case.corrupt(request);
    const absl::Status status = client_->ScaledDotProductAttention(request).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << test_case.name << ": " << status;
    EXPECT_NE(status.message().find(test_case.message_part), std::string::npos)
        << test_case.name << ": got \"" << status.message() << "\"";
  }
  EXPECT_TRUE(client_->ScaledDotProductAttention(valid).ok()) << "server must still answer";
}

TEST_F(ServerTest, MalformedLayerManagementIsRejected) {
  using C = absl::StatusCode;
  const v1::LoadLayerRequest valid = RandomLayerRequest("ok", 8, 1);
  struct Case {
    std::string name;
    std::function<void(v1::LoadLayerRequest&)> corrupt;
    C code;
    std::string message_part;
  };
  const std::vector<Case> cases = {
      {"random init too large",
       [](auto& r) {
         r.mutable_spec()->mutable_config()->set_embed_dim(65536);
         r.mutable_spec()->mutable_config()->set_num_heads(64);
       },
       C::kResourceExhausted,
       "spec.random_init: the config needs 68720525312 bytes of weights (17180131328 "
       "parameters)"},
      {"bad name", [](auto& r) { r.set_name("a/b"); }, C::kInvalidArgument,
       "name \"a/b\" has a character outside [A-Za-z0-9._-]"},
      {"empty name", [](auto& r) { r.clear_name(); }, C::kInvalidArgument,
       "name has 0 characters"},
      {"zero heads", [](auto& r) { r.mutable_spec()->mutable_config()->set_num_heads(0); },
       C::kInvalidArgument, "spec.config.num_heads = 0 must be >= 1"},
      {"missing tensor",
       [](auto& r) { r.mutable_spec()->mutable_inline_weights(); }, C::kInvalidArgument,
       "spec.inline_weights.tensors[\"q_proj.weight\"] is missing"},
      {"mis-shaped tensor",
       [](auto& r) {
         auto* tensors = r.mutable_spec()->mutable_inline_weights()->mutable_tensors();
         EncodeTensor(std::vector<float>(8 * 7), std::vector<int64_t>{8, 7},
                      core::DType::kFloat32, &(*tensors)["q_proj.weight"]);
       },
       C::kInvalidArgument,
       "spec.inline_weights.tensors[\"q_proj.weight\"] has shape [8, 7]; expected [8, 8]"},
      {"other naming",
       [](auto& r) {
         r.mutable_spec()->mutable_inline_weights()->set_naming(v1::WEIGHT_NAMING_HF_BERT);
       },
       C::kInvalidArgument,
       "spec.inline_weights.tensors[\"attention.self.query.weight\"] is missing; "
       "WEIGHT_NAMING_HF_BERT expects shape [8, 8]"},
      {"unknown naming",
       [](auto& r) {
         r.mutable_spec()->mutable_inline_weights()->set_naming(static_cast<v1::WeightNaming>(9));
       },
       C::kInvalidArgument, "spec.inline_weights.naming = 9 is not a known WeightNaming value"},
      {"persist without repository", [](auto& r) { r.set_persist(true); },
       C::kFailedPrecondition, "persist = true needs a model repository"},
      {"zero batch size", [](auto& r) { r.mutable_batching()->set_max_batch_requests(0); },
       C::kInvalidArgument, "batching.max_batch_requests = 0 must be >= 1"},
      {"negative queue delay",
       [](auto& r) { r.mutable_batching()->set_max_queue_delay_us(-2); }, C::kInvalidArgument,
       "batching.max_queue_delay_us = -2 must be >= 0 (microseconds)"},
      {"zero queue bound", [](auto& r) { r.mutable_batching()->set_max_queue_tokens(0); },
       C::kInvalidArgument, "batching.max_queue_tokens = 0 must be >= 1"},
      {"negative queue timeout",
       [](auto& r) { r.mutable_batching()->set_queue_timeout_us(-1); }, C::kInvalidArgument,
       "batching.queue_timeout_us = -1 must be >= 0"},
  };
  for (const Case& test_case : cases) {
    v1::LoadLayerRequest request = valid;
    test_case.corrupt(request);
    const absl::Status status = client_->LoadLayer(request).status();
    EXPECT_EQ(status.code(), test_case.code) << test_case.name << ": " << status;
    EXPECT_NE(status.message().find(test_case.message_part), std::string::npos)
        << test_case.name << ": got \"" << status.message() << "\"";
  }
  EXPECT_EQ(client_->GetLayer("ok").status().code(), C::kNotFound) << "nothing was loaded";
  EXPECT_EQ(client_->GetLayer("missing").status().code(), C::kNotFound);
  EXPECT_EQ(client_->UnloadLayer("missing").code(), C::kNotFound);
  EXPECT_TRUE(client_->LoadLayer(valid).ok()) << "server must still answer";
}

}  // namespace
}  // namespace attention::server::testing

namespace attention::server::testing {
namespace {

TEST_F(ServerTest, AnswerLargerThanTheMessageLimitIsRefusedBeforeCompute) {
  // 1500 tokens fit in a request (4.6 MB), but per-head weights 12 x 1500 x 1500 floats
  // (108 MB) would not fit in a 64 MiB answer.
  std::mt19937_64 rng(9);
  v1::MultiHeadAttentionRequest request = DemoRequest(rng, 1, 1500);
  request.mutable_options()->set_need_weights(v1::NEED_WEIGHTS_PER_HEAD);
  const absl::Status status = client_->MultiHeadAttention(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("attention weights 27000000 values"), std::string::npos)
      << status;
  request.mutable_options()->set_need_weights(v1::NEED_WEIGHTS_AVERAGED);  // 9 MB: fine
  EXPECT_TRUE(client_->MultiHeadAttention(request).ok());

  v1::ScaledDotProductAttentionRequest sdpa;
  const std::vector<int64_t> shape = {1, 8, 1500, 4};
  for (v1::Tensor* tensor : {sdpa.mutable_query(), sdpa.mutable_key(), sdpa.mutable_value()}) {
    wire::EncodeTensor(RandomValues(rng, 8 * 1500 * 4), shape, core::DType::kFloat32, tensor);
  }
  sdpa.mutable_options()->set_need_weights(v1::NEED_WEIGHTS_PER_HEAD);  // 72 MB
  EXPECT_EQ(client_->ScaledDotProductAttention(sdpa).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// The request that once killed the server with std::bad_alloc (issue 13): a 32 MiB call
// through an inline layer with 65536 heads of width 1. Its sizes overflow int64 and its
// buffers would need terabytes; it must be refused before anything is allocated.
v1::MultiHeadAttentionRequest HugeHeadCountRequest() {
  v1::MultiHeadAttentionRequest request;
  v1::LayerConfig* config = request.mutable_inline_layer()->mutable_config();
  config->set_embed_dim(1);
  config->set_num_heads(65536);
  config->set_head_dim(1);
  request.mutable_inline_layer()->mutable_random_init()->set_seed(1);
  const int64_t tokens = int64_t{1} << 24;
  request.mutable_query()->set_dtype(v1::FLOAT16);
  for (int64_t dim : {int64_t{1}, tokens, int64_t{1}}) request.mutable_query()->add_shape(dim);
  request.mutable_query()->set_raw_data(std::string(tokens * 2, '\0'));
  return request;
}

TEST_F(ServerTest, RequestWhoseSizesOverflowIsRefusedBeforeAllocating) {
  v1::MultiHeadAttentionRequest request = HugeHeadCountRequest();
  request.mutable_options()->set_need_weights(v1::NEED_WEIGHTS_PER_HEAD);
  absl::Status status = client_->MultiHeadAttention(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("the answer would be more than 2^63 bytes"), std::string::npos)
      << status;
  // Without weights the answer fits, but 2^24 tokens x 65536 heads of work do not.
  request.mutable_options()->set_need_weights(v1::NEED_WEIGHTS_NONE);
  status = client_->MultiHeadAttention(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("(--max_request_flops)"), std::string::npos) << status;
  std::mt19937_64 rng(10);
  EXPECT_TRUE(client_->MultiHeadAttention(DemoRequest(rng, 1, 3)).ok()) << "server must live";
}

TEST_F(ServerTest, ScaledDotProductAttentionOverTheWorkBudgetIsRefused) {
  // 2^20 queries and keys of width 1: 4 MiB of input, 2^40 scores.
  v1::ScaledDotProductAttentionRequest request;
  const int64_t length = int64_t{1} << 20;
  for (v1::Tensor* tensor :
       {request.mutable_query(), request.mutable_key(), request.mutable_value()}) {
    tensor->set_dtype(v1::FLOAT16);
    for (int64_t dim : {int64_t{1}, int64_t{1}, length, int64_t{1}}) tensor->add_shape(dim);
    tensor->set_raw_data(std::string(length * 2, '\0'));
  }
  const absl::Status status = client_->ScaledDotProductAttention(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("needs 13194139533312 FLOPs"), std::string::npos) << status;
}

class TightBudgetServerTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.demo_layer = false;
    options.device = "cpu";  // the expected sizes count the CPU's packed copy
    options.registry.max_weight_bytes = 1000;
    options.request_budget.max_request_memory_bytes = 1 << 20;
    return options;
  }
};

TEST_F(TightBudgetServerTest, LoadOverTheWeightBudgetIsRefusedBeforeReadingWeights) {
  // Inline weights are left empty: had the weights been read first, the answer would be
  // INVALID_ARGUMENT for the missing tensors.
  v1::LoadLayerRequest request;
  request.set_name("big");
  request.mutable_spec()->mutable_config()->set_embed_dim(64);
  request.mutable_spec()->mutable_config()->set_num_heads(2);
  request.mutable_spec()->mutable_inline_weights();
  const absl::Status status = client_->LoadLayer(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  // 66560 bytes of weights, twice that with the CPU's packed copy (the estimate before
  // building).
  EXPECT_NE(status.message().find("layer \"big\" needs 133120 bytes of host memory for its "
                                  "weights (with the CPU's packed copy) but only 1000 of "
                                  "max_weight_bytes = 1000 are free"),
            std::string::npos)
      << status;
}

TEST_F(TightBudgetServerTest, InlineLayerOverTheRequestMemoryBudgetIsRefused) {
  std::mt19937_64 rng(11);
  v1::MultiHeadAttentionRequest request = DemoRequest(rng, 1, 2);
  request.clear_layer();
  request.mutable_inline_layer()->mutable_config()->set_embed_dim(768);
  request.mutable_inline_layer()->mutable_config()->set_num_heads(12);
  request.mutable_inline_layer()->mutable_random_init();
  const absl::Status status = client_->MultiHeadAttention(request).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("inline_layer needs 9449472 bytes of weights, over the "
                                  "server's per-request limit of 1048576"),
            std::string::npos)
      << status;
}

}  // namespace
}  // namespace attention::server::testing

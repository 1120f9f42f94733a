// The Open Inference Protocol (KServe v2) service: every rejection of the request
// translation with its status and message, the mapping of inputs, parameters and outputs,
// and calls through a real server (answers equal the native RPC's bitwise; repository loads
// and unloads follow the admin token).
#include <cmath>
#include <cstring>
#include <functional>
#include <tuple>

#include <grpcpp/create_channel.h>

#include "inference/grpc_service.grpc.pb.h"
#include "server/kserve/kserve_convert.h"
#include "tests/core/random_options.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

using inference::ModelInferRequest;

// A valid FP32 ModelInfer request for the demo layer: query [1, tokens, 768] in raw contents.
ModelInferRequest InferRequest(std::mt19937_64& rng, int64_t tokens) {
  ModelInferRequest request;
  request.set_model_name(kDemoLayerName);
  auto* query = request.add_inputs();
  query->set_name("query");
  query->set_datatype("FP32");
  for (int64_t dim : {int64_t{1}, tokens, kDemoEmbedDim}) query->add_shape(dim);
  const std::vector<float> values = RandomValues(rng, tokens * kDemoEmbedDim);
  request.add_raw_input_contents()->assign(reinterpret_cast<const char*>(values.data()),
                                           values.size() * sizeof(float));
  return request;
}

ModelInferRequest::InferInputTensor* AddInput(ModelInferRequest& request, const std::string& name,
                                              const std::string& datatype,
                                              const std::vector<int64_t>& shape) {
  auto* input = request.add_inputs();
  input->set_name(name);
  input->set_datatype(datatype);
  for (int64_t dim : shape) input->add_shape(dim);
  return input;
}

template <typename T>
std::string Bytes(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

struct InferCase {
  std::string name;
  std::function<void(ModelInferRequest&)> corrupt;
  absl::StatusCode code;
  std::string message_part;
};

std::vector<InferCase> InferCases() {
  using C = absl::StatusCode;
  return {
      {"no model name", [](auto& r) { r.clear_model_name(); }, C::kInvalidArgument,
       "model_name is empty"},
      {"raw count", [](auto& r) { r.add_raw_input_contents(); }, C::kInvalidArgument,
       "raw_input_contents has 2 entries for 1 inputs"},
      {"raw and typed",
       [](auto& r) { r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1); },
       C::kInvalidArgument, "inputs[\"query\"] has contents while raw_input_contents is used"},
      {"unknown input", [](auto& r) { r.mutable_inputs(0)->set_name("hidden"); },
       C::kInvalidArgument, "inputs[\"hidden\"] is not an input"},
      {"duplicate input",
       [](auto& r) {
         *r.add_inputs() = r.inputs(0);
         r.add_raw_input_contents(r.raw_input_contents(0));
       },
       C::kInvalidArgument, "inputs[\"query\"] is given twice"},
      {"no query", [](auto& r) { r.mutable_inputs(0)->set_name("key"); }, C::kInvalidArgument,
       "inputs has no \"query\""},
      {"query datatype", [](auto& r) { r.mutable_inputs(0)->set_datatype("INT8"); },
       C::kInvalidArgument,
       "inputs[\"query\"].datatype = \"INT8\" is not accepted; expected one of "
       "FP32, FP16, BF16"},
      {"shared memory input, off",
       [](auto& r) {
         auto& parameters = *r.mutable_inputs(0)->mutable_parameters();
         parameters["shared_memory_region"].set_string_param("r");
         parameters["shared_memory_byte_size"].set_int64_param(9216);
       },
       C::kFailedPrecondition,
       "inputs[\"query\"].parameters[\"shared_memory_region\"]: system shared memory is off "
       "on this server; start it with --kserve_system_shared_memory"},
      {"unknown input parameter",
       [](auto& r) {
         (*r.mutable_inputs(0)->mutable_parameters())["classification"].set_int64_param(1);
       },
       C::kUnimplemented, "inputs[\"query\"].parameters[\"classification\"] is not supported"},
      {"binary_data_size mismatch",
       [](auto& r) {
         (*r.mutable_inputs(0)->mutable_parameters())["binary_data_size"].set_int64_param(12);
       },
       C::kInvalidArgument,
       "inputs[\"query\"].parameters[\"binary_data_size\"] = 12 does not "
       "match its raw_input_contents entry (9216 bytes)"},
      {"binary_data_size without raw",
       [](auto& r) {
         r.clear_raw_input_contents();
         r.mutable_inputs(0)->mutable_contents()->mutable_fp32_contents()->Resize(3 * 768, 0.0f);
         (*r.mutable_inputs(0)->mutable_parameters())["binary_data_size"].set_int64_param(9216);
       },
       C::kInvalidArgument, "does not match its raw_input_contents entry (none)"},
      {"negative binary_data_size",
       [](auto& r) {
         (*r.mutable_inputs(0)->mutable_parameters())["binary_data_size"].set_int64_param(-5);
       },
       C::kInvalidArgument,
       "inputs[\"query\"].parameters[\"binary_data_size\"] = -5 does not "
       "match its raw_input_contents entry (9216 bytes)"},
      {"FP32 in int_contents",
       [](auto& r) {
         r.clear_raw_input_contents();
         for (int v : {1, 2, 3}) r.mutable_inputs(0)->mutable_contents()->add_int_contents(v);
       },
       C::kInvalidArgument,
       "inputs[\"query\"] is FP32, whose values go in "
       "contents.fp32_contents, but its contents.int_contents holds 3 values"},
      {"FP16 in fp32_contents",
       [](auto& r) {
         r.clear_raw_input_contents();
         r.mutable_inputs(0)->set_datatype("FP16");
         r.mutable_inputs(0)->mutable_contents()->mutable_fp32_contents()->Resize(3 * 768, 0.0f);
       },
       C::kInvalidArgument,
       "inputs[\"query\"] is FP16, which has no typed contents in the "
       "protocol, but its contents.fp32_contents holds 2304 values; send it in raw_input_contents"},
      {"INT64 mask in int_contents",
       [](auto& r) {
         r.clear_raw_input_contents();
         r.mutable_inputs(0)->mutable_contents()->mutable_fp32_contents()->Resize(3 * 768, 0.0f);
         AddInput(r, "key_padding_mask", "INT64", {1, 3})->mutable_contents()->add_int_contents(1);
       },
       C::kInvalidArgument,
       "inputs[\"key_padding_mask\"] is INT64, whose values go in "
       "contents.int64_contents, but its contents.int_contents holds 1 values"},
      {"typed FP32 count",
       [](auto& r) {
         r.clear_raw_input_contents();
         r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1);
       },
       C::kInvalidArgument, "inputs[\"query\"].contents holds 1 FP32 values; its shape needs 2304"},
      {"typed FP16",
       [](auto& r) {
         r.clear_raw_input_contents();
         r.mutable_inputs(0)->set_datatype("FP16");
       },
       C::kInvalidArgument, "inputs[\"query\"] is FP16, which has no typed contents"},
      {"typed BOOL count",
       [](auto& r) {
         r.clear_raw_input_contents();
         r.mutable_inputs(0)->mutable_contents()->mutable_fp32_contents()->Resize(3 * 768, 0.0f);
         AddInput(r, "key_padding_mask", "BOOL", {1, 3})->mutable_contents()->add_bool_contents(true);
       },
       C::kInvalidArgument,
       "inputs[\"key_padding_mask\"].contents holds 1 BOOL values; its shape needs 3"},
      {"typed INT64 count",
       [](auto& r) {
         r.clear_raw_input_contents();
         r.mutable_inputs(0)->mutable_contents()->mutable_fp32_contents()->Resize(3 * 768, 0.0f);
         AddInput(r, "key_padding_mask", "INT64", {1, 3})->mutable_contents()->add_int64_contents(1);
       },
       C::kInvalidArgument,
       "inputs[\"key_padding_mask\"].contents holds 1 INT64 values; its shape needs 3"},
      {"INT64 mask value",
       [](auto& r) {
         AddInput(r, "key_padding_mask", "INT64", {1, 3});
         r.add_raw_input_contents(Bytes(std::vector<int64_t>{1, 7, 0}));
       },
       C::kInvalidArgument,
       "inputs[\"key_padding_mask\"] element 1 = 7; an integer mask holds 1 "
       "(attend) or 0 (padding)"},
      {"INT32 mask bytes",
       [](auto& r) {
         AddInput(r, "key_padding_mask", "INT32", {1, 3});
         r.add_raw_input_contents(Bytes(std::vector<int32_t>{1, 1}));
       },
       C::kInvalidArgument,
       "raw_input_contents of \"key_padding_mask\" has 8 bytes; shape and "
       "INT32 need 3 x 4"},
      {"negative mask dim",
       [](auto& r) {
         AddInput(r, "key_padding_mask", "INT64", {1, -3});
         r.add_raw_input_contents("");
       },
       C::kInvalidArgument, "inputs[\"key_padding_mask\"].shape[1] = -3 is negative"},
      // The shape rule caps the count (wire::ElementCount): 2^61 INT64 elements need 2^64
      // bytes, which wrap to the 0 sent, and are refused before a buffer is sized from them.
      {"mask count past the cap",
       [](auto& r) {
         AddInput(r, "key_padding_mask", "INT64", {int64_t{1} << 61});
         r.add_raw_input_contents("");
       },
       C::kInvalidArgument,
       "inputs[\"key_padding_mask\"].shape [2305843009213693952] has more "
       "than 2147483648 elements"},
      {"attn_mask datatype",
       [](auto& r) {
         AddInput(r, "attn_mask", "INT64", {3, 3});
         r.add_raw_input_contents(std::string(72, '\0'));
       },
       C::kInvalidArgument, "inputs[\"attn_mask\"].datatype = \"INT64\" is not accepted"},
      {"unknown parameter",
       [](auto& r) { (*r.mutable_parameters())["sequence_id"].set_int64_param(4); },
       C::kInvalidArgument,
       "parameters[\"sequence_id\"] is not a parameter of this server; known:"},
      {"causal type", [](auto& r) { (*r.mutable_parameters())["causal"].set_string_param("yes"); },
       C::kInvalidArgument, "parameters[\"causal\"] must be a bool parameter"},
      {"scale type", [](auto& r) { (*r.mutable_parameters())["scale"].set_int64_param(2); },
       C::kInvalidArgument, "parameters[\"scale\"] must be a double parameter"},
      {"need_weights value",
       [](auto& r) { (*r.mutable_parameters())["need_weights"].set_string_param("all"); },
       C::kInvalidArgument,
       "parameters[\"need_weights\"] = \"all\"; expected \"none\", \"averaged\" or \"per_head\""},
      {"need_weights type",
       [](auto& r) { (*r.mutable_parameters())["need_weights"].set_double_param(1); },
       C::kInvalidArgument, "parameters[\"need_weights\"] must be a string or bool parameter"},
      {"polarity value",
       [](auto& r) { (*r.mutable_parameters())["bool_mask_polarity"].set_string_param("up"); },
       C::kInvalidArgument, "parameters[\"bool_mask_polarity\"] = \"up\"; expected"},
      {"negative timeout",
       [](auto& r) { (*r.mutable_parameters())["timeout"].set_int64_param(-1); },
       C::kInvalidArgument, "parameters[\"timeout\"] = -1 µs must be >= 0"},
      {"huge priority",
       [](auto& r) { (*r.mutable_parameters())["priority"].set_uint64_param(~uint64_t{0}); },
       C::kInvalidArgument, "parameters[\"priority\"] = 18446744073709551615 is too large"},
      {"priority range",
       [](auto& r) { (*r.mutable_parameters())["priority"].set_uint64_param(2'000'000); },
       C::kInvalidArgument, "parameters[\"priority\"] = 2000000 must be in [0, 1000000)"},
      {"unknown output", [](auto& r) { r.add_outputs()->set_name("logits"); }, C::kInvalidArgument,
       "outputs[\"logits\"] is not an output"},
      {"duplicate output",
       [](auto& r) {
         r.add_outputs()->set_name("output");
         r.add_outputs()->set_name("output");
       },
       C::kInvalidArgument, "outputs[\"output\"] is requested twice"},
      {"output parameter",
       [](auto& r) {
         auto* output = r.add_outputs();
         output->set_name("output");
         (*output->mutable_parameters())["classification"].set_int64_param(3);
       },
       C::kUnimplemented, "outputs[\"output\"].parameters[\"classification\"] is not supported"},
      {"weights without need",
       [](auto& r) {
         r.add_outputs()->set_name("attention_weights");
         (*r.mutable_parameters())["need_weights"].set_string_param("none");
       },
       C::kInvalidArgument,
       "outputs asks for \"attention_weights\" but parameters[\"need_weights\"] is \"none\""},
  };
}

TEST(KserveConvertTest, EveryRejectionNamesTheFieldAndValues) {
  for (const InferCase& test : InferCases()) {
    SCOPED_TRACE(test.name);
    std::mt19937_64 rng(7);
    ModelInferRequest request = InferRequest(rng, 3);
    test.corrupt(request);
    v1::MultiHeadAttentionRequest native;
    kserve::OutputPlan plan;
    const absl::Status status = kserve::ToNativeRequest(request, &native, &plan);
    EXPECT_EQ(status.code(), test.code) << status;
    EXPECT_NE(status.message().find(test.message_part), std::string::npos) << status.message();
  }
}

// KServe's datatype names come from core's dtype table, both ways.
TEST(KserveConvertTest, DatatypeNamesAreCoresTable) {
  for (const core::DTypeInfo& info : core::kDTypes) {
    EXPECT_STREQ(kserve::DatatypeName(wire::WireDType(info.dtype)), info.kserve_name);
  }
  EXPECT_STREQ(kserve::DatatypeName(v1::DATA_TYPE_UNSPECIFIED), "");
}

TEST(KserveConvertTest, MapsInputsParametersAndOutputs) {
  std::mt19937_64 rng(11);
  ModelInferRequest request = InferRequest(rng, 3);
  request.set_id("r-1");
  AddInput(request, "key_padding_mask", "INT64", {1, 3});
  request.add_raw_input_contents(Bytes(std::vector<int64_t>{1, 1, 0}));
  auto* attn_mask = AddInput(request, "attn_mask", "BOOL", {3, 3});
  request.add_raw_input_contents(std::string("\1\0\0\1\1\0\1\1\1", 9));
  (void)attn_mask;
  // The KServe SDK's size of a raw input is accepted when it is right.
  (*request.mutable_inputs(0)->mutable_parameters())["binary_data_size"].set_int64_param(
      static_cast<int64_t>(request.raw_input_contents(0).size()));
  auto& parameters = *request.mutable_parameters();
  parameters["causal"].set_bool_param(true);
  parameters["scale"].set_double_param(0.25);
  parameters["need_weights"].set_string_param("per_head");
  parameters["bool_mask_polarity"].set_string_param("true_attends");
  parameters["timeout"].set_int64_param(5000);
  parameters["priority"].set_uint64_param(1);
  v1::MultiHeadAttentionRequest native;
  kserve::OutputPlan plan;
  ASSERT_TRUE(kserve::ToNativeRequest(request, &native, &plan).ok());
  EXPECT_EQ(native.layer(), kDemoLayerName);
  EXPECT_EQ(native.request_id(), "r-1");
  EXPECT_EQ(native.query().raw_data(), request.raw_input_contents(0));
  const v1::AttentionOptions& options = native.options();
  EXPECT_TRUE(options.causal());
  EXPECT_EQ(options.scale(), 0.25f);
  EXPECT_EQ(options.need_weights(), v1::NEED_WEIGHTS_PER_HEAD);
  EXPECT_EQ(options.queue_timeout_us(), 5000);
  EXPECT_EQ(options.priority(), 999'999);  // Triton's first level runs before priority 0
  // The tokenizer's mask keeps its attend polarity; the bool mask takes the parameter's.
  EXPECT_EQ(options.key_padding_mask().dtype(), v1::BOOL);
  EXPECT_EQ(options.key_padding_mask().raw_data(), std::string("\1\1\0", 3));
  EXPECT_EQ(options.key_padding_polarity(), v1::TRUE_ATTENDS);
  EXPECT_EQ(options.attn_mask_polarity(), v1::TRUE_ATTENDS);
  EXPECT_EQ(plan.names, (std::vector<std::string>{"output", "attention_weights"}));
  EXPECT_TRUE(plan.binary_data);
}

TEST(KserveConvertTest, TypedContentsAndTypedOutputs) {
  ModelInferRequest request;
  request.set_model_name("m");
  auto* query = AddInput(request, "query", "FP32", {1, 1, 2});
  query->mutable_contents()->add_fp32_contents(1.5f);
  query->mutable_contents()->add_fp32_contents(-2.0f);
  auto* mask = AddInput(request, "key_padding_mask", "BOOL", {1, 1});
  mask->mutable_contents()->add_bool_contents(true);
  (*request.mutable_parameters())["binary_data_output"].set_bool_param(false);
  request.add_outputs()->set_name("output");
  v1::MultiHeadAttentionRequest native;
  kserve::OutputPlan plan;
  ASSERT_TRUE(kserve::ToNativeRequest(request, &native, &plan).ok());
  EXPECT_EQ(native.query().float_data_size(), 2);
  EXPECT_EQ(native.options().key_padding_mask().raw_data(), std::string("\1", 1));
  EXPECT_EQ(native.options().key_padding_polarity(), v1::TRUE_MASKS_OUT);
  EXPECT_EQ(native.output_dtype(), v1::FLOAT32);
  EXPECT_FALSE(plan.binary_data);

  v1::MultiHeadAttentionResponse answer;
  answer.set_layer_version(4);
  wire::EncodeTensor(std::vector<float>{0.5f, 3.0f}, {1, 1, 2}, core::DType::kFloat32,
                     answer.mutable_output());
  inference::ModelInferResponse response;
  ASSERT_TRUE(kserve::ToInferResponse(answer, plan, "m", &response).ok());
  EXPECT_EQ(response.model_version(), "4");
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.raw_output_contents_size(), 0);
  EXPECT_EQ(response.outputs(0).datatype(), "FP32");
  ASSERT_EQ(response.outputs(0).contents().fp32_contents_size(), 2);
  EXPECT_EQ(response.outputs(0).contents().fp32_contents(1), 3.0f);
}

class KserveServerTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.access.admin_token = "s3cret";
    return options;
  }
  void SetUp() override {
    ServerTest::SetUp();
    stub_ = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  }
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
};

TEST_F(KserveServerTest, InferEqualsTheNativeAnswerBitwise) {
  const uint64_t seed = core::testing::TestSeed(3710);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  ModelInferRequest request = InferRequest(rng, 6);
  (*request.mutable_parameters())["causal"].set_bool_param(true);
  (*request.mutable_parameters())["need_weights"].set_bool_param(true);
  grpc::ClientContext context;
  inference::ModelInferResponse response;
  const grpc::Status status = stub_->ModelInfer(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();

  v1::MultiHeadAttentionRequest native;
  kserve::OutputPlan plan;
  ASSERT_TRUE(kserve::ToNativeRequest(request, &native, &plan).ok());
  auto expected = client_->MultiHeadAttention(native);
  ASSERT_TRUE(expected.ok()) << expected.status();
  ASSERT_EQ(response.outputs_size(), 2);
  EXPECT_EQ(response.outputs(0).name(), "output");
  EXPECT_EQ(response.raw_output_contents(0), expected->output().raw_data());
  EXPECT_EQ(response.outputs(1).name(), "attention_weights");
  EXPECT_EQ(response.raw_output_contents(1), expected->attention_weights().raw_data());
  EXPECT_EQ(response.model_version(), std::to_string(expected->layer_version()));
}

TEST_F(KserveServerTest, UnknownModelAndVersionAreNotFound) {
  std::mt19937_64 rng(3);
  ModelInferRequest request = InferRequest(rng, 2);
  request.set_model_version("9");
  grpc::ClientContext context;
  inference::ModelInferResponse response;
  grpc::Status status = stub_->ModelInfer(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(status.error_message().find("has version 1, not \"9\""), std::string::npos)
      << status.error_message();

  inference::ModelReadyRequest ready;
  ready.set_name("absent");
  inference::ModelReadyResponse ready_response;
  grpc::ClientContext ready_context;
  ASSERT_TRUE(stub_->ModelReady(&ready_context, ready, &ready_response).ok());
  EXPECT_FALSE(ready_response.ready());
}

TEST_F(KserveServerTest, RepositoryLoadAndUnloadNeedTheAdminToken) {
  inference::RepositoryModelLoadRequest load;
  load.set_model_name("small");
  (*load.mutable_parameters())["config"].set_string_param(
      R"({"spec": {"config": {"embedDim": 8, "numHeads": 2}, "randomInit": {"seed": 5}}})");
  inference::RepositoryModelLoadResponse loaded;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub_->RepositoryModelLoad(&context, load, &loaded);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer wrong");
    EXPECT_EQ(stub_->RepositoryModelLoad(&context, load, &loaded).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer s3cret");
    const grpc::Status status = stub_->RepositoryModelLoad(&context, load, &loaded);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  inference::RepositoryIndexResponse index;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->RepositoryIndex(&context, {}, &index).ok());
  }
  std::vector<std::string> names;
  for (const auto& model : index.models()) names.push_back(model.name());
  EXPECT_EQ(names, (std::vector<std::string>{kDemoLayerName, "small"}));

  inference::RepositoryModelUnloadRequest unload;
  unload.set_model_name("small");
  inference::RepositoryModelUnloadResponse unloaded;
  {
    grpc::ClientContext context;
    EXPECT_EQ(stub_->RepositoryModelUnload(&context, unload, &unloaded).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer s3cret");
    ASSERT_TRUE(stub_->RepositoryModelUnload(&context, unload, &unloaded).ok());
  }
  EXPECT_FALSE(server_->registry().Get("small").ok());
}

TEST_F(KserveServerTest, RepositoryLoadRejections) {
  struct Case {
    std::string name;
    std::function<void(inference::RepositoryModelLoadRequest&)> set;
    grpc::StatusCode code;
    std::string message_part;
  };
  const std::vector<Case> cases = {
      {"no config", [](auto&) {}, grpc::StatusCode::INVALID_ARGUMENT,
       "parameters[\"config\"] is missing"},
      {"file upload", [](auto& r) { (*r.mutable_parameters())["file:1/model.onnx"].set_bytes_param("x"); },
       grpc::StatusCode::UNIMPLEMENTED, "parameters[\"file:1/model.onnx\"] is not supported"},
      {"config type", [](auto& r) { (*r.mutable_parameters())["config"].set_int64_param(1); },
       grpc::StatusCode::INVALID_ARGUMENT, "parameters[\"config\"] must be a string parameter"},
      {"bad json", [](auto& r) { (*r.mutable_parameters())["config"].set_string_param("{\"spec\": ["); },
       grpc::StatusCode::INVALID_ARGUMENT, "is not an attention.v1.LoadLayerRequest in JSON"},
      {"other name", [](auto& r) { (*r.mutable_parameters())["config"].set_string_param("{\"name\": \"x\"}"); },
       grpc::StatusCode::INVALID_ARGUMENT, "names the layer \"x\" but model_name is \"m\""},
      {"other repository", [](auto& r) { r.set_repository_name("s3"); },
       grpc::StatusCode::NOT_FOUND, "repository_name = \"s3\" is not a repository of this server"},
  };
  for (const Case& test : cases) {
    SCOPED_TRACE(test.name);
    inference::RepositoryModelLoadRequest load;
    load.set_model_name("m");
    test.set(load);
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer s3cret");
    inference::RepositoryModelLoadResponse loaded;
    const grpc::Status status = stub_->RepositoryModelLoad(&context, load, &loaded);
    EXPECT_EQ(status.error_code(), test.code) << status.error_message();
    EXPECT_NE(status.error_message().find(test.message_part), std::string::npos)
        << status.error_message();
  }
}

// Issue 23: errors found after the translation name the protocol's fields (raw entries,
// inputs, parameters, model_name, id, FP32), never the native ones they became.
TEST_F(KserveServerTest, ErrorsNameTheProtocolsFields) {
  using C = grpc::StatusCode;
  const std::vector<std::tuple<std::string, std::function<void(ModelInferRequest&)>, C,
                               std::string>>
      cases = {
          {"raw bytes short", [](auto& r) { r.mutable_raw_input_contents(0)->pop_back(); },
           C::INVALID_ARGUMENT,
           "raw_input_contents[0] (inputs[\"query\"]) has 9215 bytes; shape [1, 3, 768] of FP32 "
           "needs 9216"},
          {"unknown model", [](auto& r) { r.set_model_name("nope"); }, C::NOT_FOUND,
           "model_name = \"nope\" is not a loaded model (loaded: demo-bert-base)"},
          {"id too long", [](auto& r) { r.set_id(std::string(300, 'x')); }, C::INVALID_ARGUMENT,
           "id has 300 bytes; at most 256"},
          {"wrong embed dim", [](auto& r) {
             r.mutable_inputs(0)->set_shape(1, 12);
             r.mutable_inputs(0)->set_shape(2, 192);
           },
           C::INVALID_ARGUMENT, "inputs[\"query\"].shape[2] = 192 must equal the layer's embed_dim"},
          {"zero dim", [](auto& r) {
             r.mutable_inputs(0)->set_shape(1, 0);
             r.mutable_raw_input_contents(0)->clear();
           },
           C::INVALID_ARGUMENT, "inputs[\"query\"].shape[1] = 0 must be >= 1"},
          {"mask not broadcastable", [](auto& r) {
             AddInput(r, "attn_mask", "BOOL", {2, 3});
             r.add_raw_input_contents(std::string(6, '\0'));
           },
           C::INVALID_ARGUMENT, "inputs[\"attn_mask\"] shape [1, 1, 2, 3] is not broadcastable"},
          {"padding mask shape", [](auto& r) {
             AddInput(r, "key_padding_mask", "BOOL", {1, 2});
             r.add_raw_input_contents(std::string(2, '\0'));
           },
           C::INVALID_ARGUMENT, "inputs[\"key_padding_mask\"].shape [1, 2] must be [B, Nk]"},
          {"key without value", [](auto& r) {
             *r.add_inputs() = r.inputs(0);
             r.mutable_inputs(1)->set_name("key");
             r.add_raw_input_contents(r.raw_input_contents(0));
           },
           C::INVALID_ARGUMENT, "inputs[\"key\"] is set but value is not"},
          {"non-finite query", [](auto& r) {
             const float nan = std::nanf("");
             std::memcpy(r.mutable_raw_input_contents(0)->data() + 4, &nan, sizeof(nan));
           },
           C::INVALID_ARGUMENT, "inputs[\"query\"] holds NaN at [0, 0, 1]"},
          {"infinite scale", [](auto& r) { (*r.mutable_parameters())["scale"].set_double_param(1e300); },
           C::INVALID_ARGUMENT, "parameters[\"scale\"] = inf is not finite"},
      };
  for (const auto& [name, corrupt, code, message_part] : cases) {
    SCOPED_TRACE(name);
    std::mt19937_64 rng(13);
    ModelInferRequest request = InferRequest(rng, 3);
    corrupt(request);
    grpc::ClientContext context;
    inference::ModelInferResponse response;
    const grpc::Status status = stub_->ModelInfer(&context, request, &response);
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_NE(status.error_message().find(message_part), std::string::npos)
        << status.error_message();
    for (const char* native : {"raw_data", "float_data", "request_id", "options.", "FLOAT32",
                               "layer \""}) {
      EXPECT_EQ(status.error_message().find(native), std::string::npos)
          << native << " in: " << status.error_message();
    }
  }
}

// Issue 23: a field the server does not know inside a parameters value (the request's, an
// input's, an output's, RepositoryModelLoad's and Unload's) is refused, and nothing happens.
TEST_F(KserveServerTest, UnknownFieldsInsideParameterMapsAreRefused) {
  auto add_unknown = [](google::protobuf::Message& message) {
    message.GetReflection()->MutableUnknownFields(&message)->AddVarint(99, 1);
  };
  const std::vector<std::pair<std::function<void(ModelInferRequest&)>, std::string>> infer = {
      {[&](auto& r) { add_unknown((*r.mutable_parameters())["timeout"]); },
       "parameters[\"timeout\"] (inference.InferParameter) field 99"},
      {[&](auto& r) {
         auto& size = (*r.mutable_inputs(0)->mutable_parameters())["binary_data_size"];
         size.set_int64_param(static_cast<int64_t>(r.raw_input_contents(0).size()));
         add_unknown(size);
       },
       "inputs[0].parameters[\"binary_data_size\"] (inference.InferParameter) field 99"},
      {[&](auto& r) {
         auto* output = r.add_outputs();
         output->set_name("output");
         add_unknown((*output->mutable_parameters())["binary_data"]);
       },
       "outputs[0].parameters[\"binary_data\"] (inference.InferParameter) field 99"},
  };
  for (const auto& [corrupt, message_part] : infer) {
    SCOPED_TRACE(message_part);
    std::mt19937_64 rng(17);
    ModelInferRequest request = InferRequest(rng, 2);
    corrupt(request);
    grpc::ClientContext context;
    inference::ModelInferResponse response;
    const grpc::Status status = stub_->ModelInfer(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
    EXPECT_NE(status.error_message().find(message_part), std::string::npos)
        << status.error_message();
  }

  inference::RepositoryModelLoadRequest load;
  load.set_model_name("small");
  auto& config = (*load.mutable_parameters())["config"];
  config.set_string_param(
      R"({"spec": {"config": {"embedDim": 8, "numHeads": 2}, "randomInit": {"seed": 5}}})");
  add_unknown(config);
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer s3cret");
    inference::RepositoryModelLoadResponse loaded;
    const grpc::Status status = stub_->RepositoryModelLoad(&context, load, &loaded);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
    EXPECT_NE(status.error_message().find(
                  "parameters[\"config\"] (inference.ModelRepositoryParameter) field 99"),
              std::string::npos)
        << status.error_message();
  }
  EXPECT_FALSE(server_->registry().Get("small").ok()) << "nothing was loaded";

  inference::RepositoryModelUnloadRequest unload;
  unload.set_model_name(kDemoLayerName);
  auto& dependents = (*unload.mutable_parameters())["unload_dependents"];
  dependents.set_bool_param(true);
  add_unknown(dependents);
  {
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer s3cret");
    inference::RepositoryModelUnloadResponse unloaded;
    const grpc::Status status = stub_->RepositoryModelUnload(&context, unload, &unloaded);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << status.error_message();
    EXPECT_NE(status.error_message().find("parameters[\"unload_dependents\"] "
                                          "(inference.ModelRepositoryParameter) field 99"),
              std::string::npos)
        << status.error_message();
  }
  EXPECT_TRUE(server_->registry().Get(kDemoLayerName).ok()) << "nothing was unloaded";
}

TEST_F(KserveServerTest, StatisticsCountComputedRequests) {
  std::mt19937_64 rng(5);
  for (int n = 0; n < 3; ++n) {
    grpc::ClientContext context;
    inference::ModelInferResponse response;
    ASSERT_TRUE(stub_->ModelInfer(&context, InferRequest(rng, 2), &response).ok());
  }
  inference::ModelStatisticsRequest request;
  request.set_name(kDemoLayerName);
  inference::ModelStatisticsResponse statistics;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->ModelStatistics(&context, request, &statistics).ok());
  ASSERT_EQ(statistics.model_stats_size(), 1);
  const inference::ModelStatistics& model = statistics.model_stats(0);
  EXPECT_EQ(model.inference_count(), 3u);
  EXPECT_GE(model.execution_count(), 1u);
  EXPECT_LE(model.execution_count(), 3u);
  EXPECT_EQ(model.inference_stats().success().count(), 3u);
  EXPECT_GT(model.inference_stats().compute_infer().ns(), 0u);
  EXPECT_GT(model.last_inference(), 0u);
}

}  // namespace
}  // namespace attention::server::testing

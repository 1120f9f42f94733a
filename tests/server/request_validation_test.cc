// Request costs from shapes, with overflow-checked arithmetic, and the budgets they meet.
#include "server/validation/request_validation.h"

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "attention/v1/attention.pb.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "inference/grpc_service.pb.h"

namespace attention::server {
namespace {

TEST(CheckedArithmeticTest, SaturatesInsteadOfWrapping) {
  EXPECT_EQ(CheckedProduct({3, 5, 7}), 105);
  EXPECT_EQ(CheckedProduct({}), 1);
  EXPECT_EQ(CheckedProduct({int64_t{1} << 32, int64_t{1} << 31}), kSaturated);  // 2^63
  EXPECT_EQ(CheckedProduct({int64_t{1} << 16, int64_t{1} << 24, int64_t{1} << 24}), kSaturated);
  EXPECT_EQ(CheckedProduct({kSaturated, 1}), kSaturated);
  EXPECT_EQ(CheckedProduct({kSaturated, 0}), 0);
  EXPECT_EQ(CheckedProduct({-1, 4}), kSaturated);  // a negative size is never admitted
  EXPECT_EQ(CheckedSum({1, 2, 3}), 6);
  EXPECT_EQ(CheckedSum({kSaturated, 1}), kSaturated);
  EXPECT_EQ(CheckedSum({kSaturated - 1, 1}), kSaturated);
}

core::MhaConfig Resolved(core::MhaConfig config) { return *core::MhaConfig::Resolve(config); }

TEST(RequestCostTest, MultiHeadAttentionCountsEveryTerm) {
  const core::MhaConfig config = Resolved({.embed_dim = 8, .num_heads = 2});
  const core::AttentionDims dims{2, 2, 2, 3, 3, 4, 4};
  const RequestCost cost =
      MultiHeadAttentionCost(config, dims, core::NeedWeights::kNone, core::DType::kFloat32);
  EXPECT_EQ(cost.output_elements, 2 * 3 * 8);
  EXPECT_EQ(cost.weight_elements, 0);
  EXPECT_EQ(cost.response_bytes, 2 * 3 * 8 * 4);
  // Q, K, V and output projections of 6 tokens, 8 -> 8 each; 36 scores of dk = dv = 4.
  EXPECT_EQ(cost.flops, 4 * (2 * 6 * 8 * 8) + 36 * (2 * (4 + 4) + 8));
  // Per query token: input, Q, attention output, projected output twice; per key token:
  // key and value inputs, K, V.
  EXPECT_EQ(cost.memory_bytes, 4 * (6 * (8 + 8 + 8 + 2 * 8) + 6 * (8 + 8 + 8 + 8)) + 192);

  const RequestCost averaged = MultiHeadAttentionCost(config, dims, core::NeedWeights::kAveraged,
                                                      core::DType::kFloat16);
  EXPECT_EQ(averaged.weight_elements, 2 * 3 * 3);
  EXPECT_EQ(averaged.response_bytes, (48 + 18) * 2);
  // Per-head weights are held before they are averaged.
  EXPECT_EQ(averaged.memory_bytes - cost.memory_bytes, 4 * (36 + 18) + (48 + 18) * 2 - 192);
}

TEST(RequestCostTest, ScaledDotProductAttention) {
  const core::AttentionDims dims{2, 4, 2, 3, 5, 8, 6};
  const RequestCost cost =
      ScaledDotProductAttentionCost(dims, core::NeedWeights::kPerHead, core::DType::kBFloat16);
  EXPECT_EQ(cost.output_elements, 2 * 4 * 3 * 6);
  EXPECT_EQ(cost.weight_elements, 2 * 4 * 3 * 5);
  EXPECT_EQ(cost.response_bytes, (144 + 120) * 2);
  EXPECT_EQ(cost.flops, 120 * (2 * (8 + 6) + 8));
}

// The request that once crashed the server (issue 13): E = 1, H = 65536, dk = 1, a query of
// 2^24 tokens with per-head weights. B*H*Nq*Nk is 2^64: it must saturate, not wrap to 0.
TEST(RequestCostTest, HugeHeadCountSaturatesAndIsRefused) {
  const core::MhaConfig config =
      Resolved({.embed_dim = 1, .num_heads = 65536, .head_dim = 1});
  const int64_t tokens = int64_t{1} << 24;
  const core::AttentionDims dims{1, 65536, 65536, tokens, tokens, 1, 1};
  const RequestCost cost =
      MultiHeadAttentionCost(config, dims, core::NeedWeights::kPerHead, core::DType::kFloat16);
  EXPECT_EQ(cost.weight_elements, kSaturated);
  EXPECT_EQ(cost.response_bytes, kSaturated);
  EXPECT_EQ(cost.memory_bytes, kSaturated);
  const absl::Status status = CheckRequestBudget(cost, RequestBudget{});
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("the answer would be more than 2^63 bytes"), std::string::npos)
      << status;

  // Without weights the answer is small, but the work and the buffers are not.
  const RequestCost no_weights =
      MultiHeadAttentionCost(config, dims, core::NeedWeights::kNone, core::DType::kFloat16);
  EXPECT_EQ(no_weights.response_bytes, tokens * 2);
  const absl::Status work = CheckRequestBudget(no_weights, RequestBudget{});
  EXPECT_EQ(work.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(work.message().find("FLOPs, over the server's per-request limit of 10000000000000 "
                                "(--max_request_flops)"),
            std::string::npos)
      << work;
}

TEST(RequestBudgetTest, EachLimitIsNamed) {
  RequestCost cost{.output_elements = 10, .response_bytes = 40, .flops = 1000,
                   .memory_bytes = 5000};
  RequestBudget budget{.max_response_bytes = 40, .max_request_flops = 1000,
                       .max_request_memory_bytes = 5000};
  EXPECT_TRUE(CheckRequestBudget(cost, budget).ok());
  budget.max_request_memory_bytes = 4999;
  absl::Status status = CheckRequestBudget(cost, budget);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("needs 5000 bytes of working memory, over the server's "
                                  "per-request limit of 4999 (--max_request_memory_bytes)"),
            std::string::npos)
      << status;
  budget.max_request_flops = 999;
  status = CheckRequestBudget(cost, budget);
  EXPECT_NE(status.message().find("needs 1000 FLOPs"), std::string::npos) << status;
  budget.max_response_bytes = 39;
  status = CheckRequestBudget(cost, budget);
  EXPECT_NE(status.message().find("the answer would be 40 bytes"), std::string::npos) << status;

  EXPECT_TRUE(RequestBudget{}.Validate().ok());
  EXPECT_EQ(RequestBudget{.max_request_flops = 0}.Validate().message(),
            "max_request_flops = 0 must be >= 1");
}

TEST(RequestBudgetTest, InlineLayerWeightsCountAsRequestMemory) {
  const RequestBudget budget{.max_request_memory_bytes = 1000};
  EXPECT_TRUE(CheckInlineLayerBytes(1000, budget).ok());
  const absl::Status status = CheckInlineLayerBytes(1001, budget);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("inline_layer needs 1001 bytes of weights"), std::string::npos)
      << status;
}

void AddUnknownField(google::protobuf::Message* message, int number) {
  message->GetReflection()->MutableUnknownFields(message)->AddVarint(number, 1);
}

// The map fields of every message reachable from a request of `service`'s methods.
void CollectMaps(const google::protobuf::Descriptor* message,
                 std::set<const google::protobuf::Descriptor*>* seen,
                 std::set<std::string>* maps) {
  if (!seen->insert(message).second) return;
  for (int i = 0; i < message->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = message->field(i);
    if (field->message_type() == nullptr) continue;
    if (field->is_map()) maps->insert(field->full_name());
    CollectMaps(field->message_type(), seen, maps);
  }
}

// Issue 23: a field the server does not know inside a map value (an InferParameter, a
// ModelRepositoryParameter, a weight Tensor) is refused as anywhere else, the map key in
// the path; one case per map of every request either protocol accepts.
TEST(CheckKnownFieldsTest, UnknownFieldsInsideEveryMapAreRefused) {
  struct Case {
    std::string map;  // the map field's full name
    std::function<std::unique_ptr<google::protobuf::Message>()> make;
    std::string message_part;
  };
  const std::vector<Case> cases = {
      {"attention.v1.LayerWeights.tensors",
       [] {
         auto load = std::make_unique<v1::LoadLayerRequest>();
         AddUnknownField(&(*load->mutable_spec()->mutable_inline_weights()
                                ->mutable_tensors())["q_proj.weight"],
                         33);
         return load;
       },
       "spec.inline_weights.tensors[\"q_proj.weight\"] (attention.v1.Tensor) field 33"},
      {"inference.ModelInferRequest.parameters",
       [] {
         auto infer = std::make_unique<inference::ModelInferRequest>();
         AddUnknownField(&(*infer->mutable_parameters())["timeout"], 9);
         return infer;
       },
       "parameters[\"timeout\"] (inference.InferParameter) field 9"},
      {"inference.ModelInferRequest.InferInputTensor.parameters",
       [] {
         auto infer = std::make_unique<inference::ModelInferRequest>();
         infer->add_inputs();
         AddUnknownField(&(*infer->add_inputs()->mutable_parameters())["binary_data_size"], 10);
         return infer;
       },
       "inputs[1].parameters[\"binary_data_size\"] (inference.InferParameter) field 10"},
      {"inference.ModelInferRequest.InferRequestedOutputTensor.parameters",
       [] {
         auto infer = std::make_unique<inference::ModelInferRequest>();
         AddUnknownField(&(*infer->add_outputs()->mutable_parameters())["classification"], 11);
         return infer;
       },
       "outputs[0].parameters[\"classification\"] (inference.InferParameter) field 11"},
      {"inference.RepositoryModelLoadRequest.parameters",
       [] {
         auto load = std::make_unique<inference::RepositoryModelLoadRequest>();
         AddUnknownField(&(*load->mutable_parameters())["config"], 12);
         return load;
       },
       "parameters[\"config\"] (inference.ModelRepositoryParameter) field 12"},
      {"inference.RepositoryModelUnloadRequest.parameters",
       [] {
         auto unload = std::make_unique<inference::RepositoryModelUnloadRequest>();
         AddUnknownField(&(*unload->mutable_parameters())["unload_dependents"], 13);
         return unload;
       },
       "parameters[\"unload_dependents\"] (inference.ModelRepositoryParameter) field 13"},
  };
  std::set<std::string> tested;
  for (const Case& test : cases) {
    SCOPED_TRACE(test.map);
    tested.insert(test.map);
    const std::unique_ptr<google::protobuf::Message> message = test.make();
    // Through the wire, as the server receives it.
    std::unique_ptr<google::protobuf::Message> received(message->New());
    ASSERT_TRUE(received->ParseFromString(message->SerializeAsString()));
    const google::protobuf::Message& request = *received;  // the server's view is const
    const absl::Status status = CheckKnownFields(request);
    EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
    EXPECT_NE(status.message().find(test.message_part), std::string::npos) << status;
  }
  // Every map a request of either service reaches has its case; a new map needs one.
  std::set<std::string> maps;
  std::set<const google::protobuf::Descriptor*> seen;
  for (const char* name : {"attention.v1.AttentionService", "inference.GRPCInferenceService"}) {
    const google::protobuf::ServiceDescriptor* service =
        google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(name);
    ASSERT_NE(service, nullptr) << name;
    for (int m = 0; m < service->method_count(); ++m) {
      CollectMaps(service->method(m)->input_type(), &seen, &maps);
    }
  }
  EXPECT_EQ(maps, tested);
}

TEST(CheckKnownFieldsTest, MapsWithoutUnknownFieldsPassAndStayIntact) {
  inference::ModelInferRequest request;
  (*request.mutable_parameters())["timeout"].set_int64_param(5);
  (*request.add_inputs()->mutable_parameters())["binary_data_size"].set_int64_param(4);
  EXPECT_TRUE(CheckKnownFields(request).ok());
  EXPECT_EQ(request.parameters().at("timeout").int64_param(), 5);
  EXPECT_EQ(request.inputs(0).parameters().at("binary_data_size").int64_param(), 4);
}

}  // namespace
}  // namespace attention::server

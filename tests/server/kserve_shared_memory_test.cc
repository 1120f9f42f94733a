// Triton's system shared memory extension on the KServe endpoint: every rejection of a
// registration and of a slice with its status and message, reads that fail instead of
// faulting when a caller shrinks its object, and calls through a real server whose inputs
// and outputs pass through shared memory (answers equal the raw call's bitwise).
#include <algorithm>
#include <cstring>
#include <functional>

#include <grpcpp/create_channel.h>

#include "inference/grpc_service.grpc.pb.h"
#include "server/kserve/kserve_convert.h"
#include "server/kserve/shared_memory.h"
#include "tests/core/random_options.h"
#include "tests/server/shared_memory_testing.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

using inference::ModelInferRequest;
using kserve::SharedMemory;

constexpr int64_t kTokens = 3;
constexpr uint64_t kQueryBytes = kTokens * kDemoEmbedDim * sizeof(float);

TEST(SystemSharedMemoryTest, EveryRegistrationRejectionNamesTheFieldAndValues) {
  using C = absl::StatusCode;
  SharedObject object(4096);
  ExpectStatus(SharedMemory(false, 1 << 20).RegisterSystem(Registration("r", object.key(), 0, 8)),
               C::kFailedPrecondition, "start it with --kserve_system_shared_memory");
  SharedMemory regions(true, 1 << 20);
  ExpectStatus(regions.RegisterSystem(Registration("", object.key(), 0, 8)), C::kInvalidArgument,
               "name is empty");
  for (const std::string& key :
       {std::string(), std::string("/"), std::string("/a/b"), "/" + std::string(300, 'k')}) {
    ExpectStatus(regions.RegisterSystem(Registration("r", key, 0, 8)), C::kInvalidArgument,
                 "is not a shared memory object name");
  }
  ExpectStatus(regions.RegisterSystem(Registration("r", object.key(), 0, 0)), C::kInvalidArgument,
               "byte_size is 0 for region \"r\"");
  ExpectStatus(regions.RegisterSystem(Registration("r", object.key(), UINT64_MAX - 3, 8)),
               C::kInvalidArgument, "offset 18446744073709551612 + byte_size 8 is past");
  ExpectStatus(regions.RegisterSystem(Registration("r", "/attention-test-absent", 0, 8)),
               C::kNotFound, "key = \"/attention-test-absent\"");
  ExpectStatus(regions.RegisterSystem(Registration("r", object.key(), 4000, 200)),
               C::kInvalidArgument, "region \"r\" = bytes [4000, 4200) of key");
  EXPECT_TRUE(regions.RegisterSystem(Registration("r", object.key(), 0, 4096)).ok());
  ExpectStatus(regions.RegisterSystem(Registration("r", object.key(), 0, 8)), C::kAlreadyExists,
               "region \"r\" is already registered");
  for (size_t n = 1; n < SharedMemory::kMaxRegions; ++n) {
    ASSERT_TRUE(
        regions.RegisterSystem(Registration("r" + std::to_string(n), object.key(), 0, 8)).ok());
  }
  ExpectStatus(regions.RegisterSystem(Registration("one more", object.key(), 0, 8)),
               C::kResourceExhausted, "256 regions are registered");
}

TEST(SystemSharedMemoryTest, StatusAndUnregister) {
  SharedObject object(64);
  SharedMemory regions(true, 1 << 20);
  ASSERT_TRUE(regions.RegisterSystem(Registration("a", object.key(), 8, 16)).ok());
  ASSERT_TRUE(regions.RegisterSystem(Registration("b", object.key(), 0, 64)).ok());
  inference::SystemSharedMemoryStatusResponse all;
  ASSERT_TRUE(regions.DescribeSystem("", &all).ok());
  ASSERT_EQ(all.regions_size(), 2);
  EXPECT_EQ(all.regions().at("a").key(), object.key());
  EXPECT_EQ(all.regions().at("a").offset(), 8u);
  EXPECT_EQ(all.regions().at("a").byte_size(), 16u);
  inference::SystemSharedMemoryStatusResponse one;
  ASSERT_TRUE(regions.DescribeSystem("b", &one).ok());
  EXPECT_EQ(one.regions_size(), 1);
  inference::SystemSharedMemoryStatusResponse none;
  ExpectStatus(regions.DescribeSystem("c", &none), absl::StatusCode::kNotFound,
               "name = \"c\" is not a registered region");

  // A slice taken before Unregister keeps reading its region.
  auto slice = regions.Find("inputs[\"query\"]", "a", 4, 8);
  ASSERT_TRUE(slice.ok()) << slice.status();
  object.Write(12, "abcdefgh");
  EXPECT_TRUE(regions.UnregisterSystem("a").ok());
  EXPECT_TRUE(regions.UnregisterSystem("a").ok());  // again: nothing to do
  std::string bytes;
  ASSERT_TRUE(kserve::ReadSlice(*slice, &bytes).ok());
  EXPECT_EQ(bytes, "abcdefgh");
  ExpectStatus(regions.Find("inputs[\"query\"]", "a", 0, 8).status(), absl::StatusCode::kNotFound,
               "inputs[\"query\"].parameters[\"shared_memory_region\"] = \"a\" is not a "
               "registered region");
  EXPECT_TRUE(regions.UnregisterSystem("").ok());
  inference::SystemSharedMemoryStatusResponse after;
  ASSERT_TRUE(regions.DescribeSystem("", &after).ok());
  EXPECT_EQ(after.regions_size(), 0);
}

TEST(SystemSharedMemoryTest, AShrunkObjectFailsTheReadInsteadOfFaulting) {
  SharedObject object(4096);
  SharedMemory regions(true, 1 << 20);
  ASSERT_TRUE(regions.RegisterSystem(Registration("r", object.key(), 1024, 2048)).ok());
  auto slice = regions.Find("inputs[\"query\"]", "r", 0, 2048);
  ASSERT_TRUE(slice.ok());
  object.Resize(2000);
  std::string bytes;
  ExpectStatus(kserve::ReadSlice(*slice, &bytes), absl::StatusCode::kFailedPrecondition,
               "inputs[\"query\"]: region \"r\" (key \"" + object.key() +
                   "\") gave 976 of its 2048 bytes; the object shrank");
  ExpectStatus(kserve::WriteSlice(*slice, std::string(2049, 'x')),
               absl::StatusCode::kInvalidArgument,
               "inputs[\"query\"].parameters[\"shared_memory_byte_size\"] = 2048 cannot hold "
               "the answer's 2049 bytes");
}

// A demo-layer request whose query is in region "in" of `object` at `offset`.
ModelInferRequest SharedQueryRequest(uint64_t offset) {
  ModelInferRequest request;
  request.set_model_name(kDemoLayerName);
  auto* query = request.add_inputs();
  query->set_name("query");
  query->set_datatype("FP32");
  for (int64_t dim : {int64_t{1}, kTokens, kDemoEmbedDim}) query->add_shape(dim);
  auto& parameters = *query->mutable_parameters();
  parameters["shared_memory_region"].set_string_param("in");
  parameters["shared_memory_byte_size"].set_uint64_param(kQueryBytes);
  parameters["shared_memory_offset"].set_int64_param(static_cast<int64_t>(offset));
  return request;
}

struct SliceCase {
  std::string name;
  std::function<void(ModelInferRequest&)> corrupt;
  absl::StatusCode code;
  std::string message_part;
};

TEST(SystemSharedMemoryTest, EverySliceRejectionNamesTheFieldAndValues) {
  using C = absl::StatusCode;
  SharedObject object(2 * kQueryBytes);
  SharedMemory regions(true, 3 * kQueryBytes / 2);
  ASSERT_TRUE(regions.RegisterSystem(Registration("in", object.key(), 0, 2 * kQueryBytes)).ok());
  auto query_parameters = [](ModelInferRequest& r) {
    return r.mutable_inputs(0)->mutable_parameters();
  };
  const std::vector<SliceCase> cases = {
      {"size without region", [&](auto& r) { query_parameters(r)->erase("shared_memory_region"); },
       C::kInvalidArgument,
       "inputs[\"query\"].parameters[\"shared_memory_byte_size\"] is given without "
       "parameters[\"shared_memory_region\"]"},
      {"region not a string",
       [&](auto& r) { (*query_parameters(r))["shared_memory_region"].set_int64_param(1); },
       C::kInvalidArgument,
       "inputs[\"query\"].parameters[\"shared_memory_region\"] must be a string parameter"},
      {"no size", [&](auto& r) { query_parameters(r)->erase("shared_memory_byte_size"); },
       C::kInvalidArgument, "inputs[\"query\"].parameters[\"shared_memory_byte_size\"] is missing"},
      {"negative size",
       [&](auto& r) { (*query_parameters(r))["shared_memory_byte_size"].set_int64_param(-4); },
       C::kInvalidArgument,
       "inputs[\"query\"].parameters[\"shared_memory_byte_size\"] = -4 is negative"},
      {"offset a string",
       [&](auto& r) { (*query_parameters(r))["shared_memory_offset"].set_string_param("0"); },
       C::kInvalidArgument,
       "inputs[\"query\"].parameters[\"shared_memory_offset\"] must be an int64 or uint64"},
      {"unknown region",
       [&](auto& r) { (*query_parameters(r))["shared_memory_region"].set_string_param("out"); },
       C::kNotFound,
       "inputs[\"query\"].parameters[\"shared_memory_region\"] = \"out\" is not a registered "
       "region"},
      {"past the region",
       [&](auto& r) {
         (*query_parameters(r))["shared_memory_offset"].set_uint64_param(kQueryBytes + 8);
       },
       C::kInvalidArgument,
       "inputs[\"query\"] asks for bytes [9224, 18440) of region \"in\", "
       "which has 18432"},
      {"raw entry for it too",
       [&](auto& r) { r.add_raw_input_contents(std::string(kQueryBytes, '\0')); },
       C::kInvalidArgument, "raw_input_contents has 1 entries for 0 inputs outside shared memory"},
      {"contents too",
       [&](auto& r) { r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1); },
       C::kInvalidArgument, "inputs[\"query\"] has contents while a shared memory region is used"},
      {"more than a call may send",
       [&](auto& r) {
         *r.add_inputs() = r.inputs(0);
         r.mutable_inputs(1)->set_name("key");
       },
       C::kResourceExhausted,
       "the inputs in shared memory hold 18432 bytes, past the 13824 a call may send"},
      {"output in an unknown region",
       [&](auto& r) {
         auto* output = r.add_outputs();
         output->set_name("output");
         (*output->mutable_parameters())["shared_memory_region"].set_string_param("out");
         (*output->mutable_parameters())["shared_memory_byte_size"].set_int64_param(64);
       },
       C::kNotFound, "outputs[\"output\"].parameters[\"shared_memory_region\"] = \"out\""},
      {"output without a size",
       [&](auto& r) {
         auto* output = r.add_outputs();
         output->set_name("output");
         (*output->mutable_parameters())["shared_memory_region"].set_string_param("in");
       },
       C::kInvalidArgument,
       "outputs[\"output\"].parameters[\"shared_memory_byte_size\"] is missing"},
  };
  for (const SliceCase& test : cases) {
    SCOPED_TRACE(test.name);
    ModelInferRequest request = SharedQueryRequest(0);
    test.corrupt(request);
    v1::MultiHeadAttentionRequest native;
    kserve::OutputPlan plan;
    ExpectStatus(kserve::ToNativeRequest(request, &native, &plan, &regions), test.code,
                 test.message_part);
  }
}

class KserveSharedMemoryServerTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.kserve_system_shared_memory = true;
    return options;
  }
  void SetUp() override {
    ServerTest::SetUp();
    stub_ = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  }
  grpc::Status Register(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size) {
    grpc::ClientContext context;
    inference::SystemSharedMemoryRegisterResponse response;
    return stub_->SystemSharedMemoryRegister(&context, Registration(name, key, offset, byte_size),
                                             &response);
  }
  std::unique_ptr<inference::GRPCInferenceService::Stub> stub_;
};

TEST_F(KserveSharedMemoryServerTest, InputsAndOutputsThroughSharedMemoryEqualTheRawCall) {
  const uint64_t seed = core::testing::TestSeed(2360);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with ATTENTION_TEST_SEED)");
  std::mt19937_64 rng(seed);
  const std::vector<float> query = RandomValues(rng, kTokens * kDemoEmbedDim);
  const std::string query_bytes(reinterpret_cast<const char*>(query.data()), kQueryBytes);
  constexpr uint64_t kOffset = 64;  // the query's place in the input region
  SharedObject input(kOffset + kQueryBytes), output(2 * kQueryBytes);
  input.Write(kOffset, query_bytes);
  ASSERT_TRUE(Register("in", input.key(), 0, kOffset + kQueryBytes).ok());
  ASSERT_TRUE(Register("out", output.key(), 0, 2 * kQueryBytes).ok());

  ModelInferRequest request = SharedQueryRequest(kOffset);
  (*request.mutable_parameters())["causal"].set_bool_param(true);
  auto* requested = request.add_outputs();
  requested->set_name("output");
  (*requested->mutable_parameters())["shared_memory_region"].set_string_param("out");
  (*requested->mutable_parameters())["shared_memory_byte_size"].set_int64_param(2 * kQueryBytes);
  grpc::ClientContext context;
  inference::ModelInferResponse response;
  const grpc::Status status = stub_->ModelInfer(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();

  ModelInferRequest raw = SharedQueryRequest(0);
  raw.mutable_inputs(0)->clear_parameters();
  raw.add_raw_input_contents(query_bytes);
  (*raw.mutable_parameters())["causal"].set_bool_param(true);
  grpc::ClientContext raw_context;
  inference::ModelInferResponse expected;
  const grpc::Status raw_status = stub_->ModelInfer(&raw_context, raw, &expected);
  ASSERT_TRUE(raw_status.ok()) << raw_status.error_message();
  ASSERT_EQ(expected.raw_output_contents_size(), 1);
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.outputs(0).datatype(), "FP32");
  EXPECT_EQ(response.outputs(0).shape(2), kDemoEmbedDim);
  ASSERT_EQ(response.raw_output_contents_size(), 1);  // an empty entry keeps the order
  EXPECT_TRUE(response.raw_output_contents(0).empty());
  EXPECT_EQ(output.Read(0, kQueryBytes), expected.raw_output_contents(0));
  EXPECT_EQ(output.Read(kQueryBytes, kQueryBytes), std::string(kQueryBytes, '\0'));

  // A slice that is not the shape's size is refused where raw contents would be, naming it.
  ModelInferRequest short_query = SharedQueryRequest(kOffset);
  (*short_query.mutable_inputs(0)->mutable_parameters())["shared_memory_byte_size"].set_int64_param(
      64);
  grpc::ClientContext short_context;
  inference::ModelInferResponse short_response;
  const grpc::Status wrong_size = stub_->ModelInfer(&short_context, short_query, &short_response);
  EXPECT_EQ(wrong_size.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(wrong_size.error_message().find("inputs[\"query\"] (shared memory region \"in\")"),
            std::string::npos)
      << wrong_size.error_message();

  // An output slice too small for the answer fails the call naming it.
  (*requested->mutable_parameters())["shared_memory_byte_size"].set_int64_param(100);
  grpc::ClientContext small_context;
  inference::ModelInferResponse small;
  const grpc::Status too_small = stub_->ModelInfer(&small_context, request, &small);
  EXPECT_EQ(too_small.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(too_small.error_message().find("outputs[\"output\"].parameters[\"shared_memory_"
                                           "byte_size\"] = 100 cannot hold the answer's 9216"),
            std::string::npos)
      << too_small.error_message();

  grpc::ClientContext status_context;
  inference::SystemSharedMemoryStatusRequest status_request;
  inference::SystemSharedMemoryStatusResponse regions;
  ASSERT_TRUE(stub_->SystemSharedMemoryStatus(&status_context, status_request, &regions).ok());
  EXPECT_EQ(regions.regions_size(), 2);
  EXPECT_EQ(regions.regions().at("in").key(), input.key());
  grpc::ClientContext unregister_context;
  inference::SystemSharedMemoryUnregisterRequest unregister;
  inference::SystemSharedMemoryUnregisterResponse unregistered;
  ASSERT_TRUE(
      stub_->SystemSharedMemoryUnregister(&unregister_context, unregister, &unregistered).ok());
  grpc::ClientContext after_context;
  inference::ModelInferResponse after;
  const grpc::Status gone = stub_->ModelInfer(&after_context, request, &after);
  EXPECT_EQ(gone.error_code(), grpc::StatusCode::NOT_FOUND) << gone.error_message();
}

TEST_F(KserveSharedMemoryServerTest, RegisterRejectionsReachTheCaller) {
  grpc::ClientContext metadata_context;
  inference::ServerMetadataResponse metadata;
  ASSERT_TRUE(stub_->ServerMetadata(&metadata_context, {}, &metadata).ok());
  EXPECT_NE(
      std::find(metadata.extensions().begin(), metadata.extensions().end(), "system_shared_memory"),
      metadata.extensions().end());
  SharedObject object(64);
  EXPECT_EQ(Register("r", "/attention-test-absent", 0, 8).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Register("r", object.key(), 0, 128).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Register("r", object.key(), 0, 64).ok());
  EXPECT_EQ(Register("r", object.key(), 0, 64).error_code(), grpc::StatusCode::ALREADY_EXISTS);
}

// The default server refuses registrations, naming the flag.
TEST_F(ServerTest, SystemSharedMemoryIsOffByDefault) {
  auto stub = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
  SharedObject object(64);
  grpc::ClientContext context;
  inference::SystemSharedMemoryRegisterResponse response;
  const grpc::Status status =
      stub->SystemSharedMemoryRegister(&context, Registration("r", object.key(), 0, 64), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(status.error_message().find("--kserve_system_shared_memory"), std::string::npos)
      << status.error_message();
  grpc::ClientContext metadata_context;
  inference::ServerMetadataResponse metadata;
  ASSERT_TRUE(stub->ServerMetadata(&metadata_context, {}, &metadata).ok());
  for (const std::string& extension : metadata.extensions()) {
    EXPECT_NE(extension, "system_shared_memory");
  }
}

}  // namespace
}  // namespace attention::server::testing

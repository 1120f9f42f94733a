// Batch invariance over the wire (issue 55): for every kernel set this host runs (forced as
// --float32_kernels and --bf16_kernels force them), a probe's answer is the same bits alone
// as beside concurrent callers that share its forward pass (natively and over KServe), and a
// session step retried beside other sessions' rows is a retry: OK, with the same bits. The core's
// test (tests/core/batch_invariance_test.cc) covers every neighbour size and thread count.
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/create_channel.h>

#include "core/cpu/bf16_linear.h"
#include "core/cpu/float32_linear.h"
#include "inference/grpc_service.grpc.pb.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

constexpr int64_t kEmbed = 128;

// A server kernel set: the float32 projections and the bf16 projections it is forced to.
struct ServerKernels {
  core::Float32Projection float32_projection;
  core::Bf16Projection bf16_projection;
};

void PrintTo(const ServerKernels& set, std::ostream* os) {
  *os << "float32 " << core::Float32ProjectionName(set.float32_projection) << ", bf16 "
      << core::Bf16ProjectionName(set.bf16_projection);
}

// How many of two answers' float32 elements differ in their bits (-1: other sizes).
int64_t DifferingFloats(const std::string& answer, const std::string& expected) {
  if (answer.size() != expected.size()) return -1;
  int64_t differing = 0;
  for (size_t i = 0; i + 4 <= answer.size(); i += 4) {
    differing += answer.compare(i, 4, expected, i, 4) != 0 ? 1 : 0;
  }
  return differing;
}

std::string ServerKernelsName(const ::testing::TestParamInfo<ServerKernels>& info) {
  return std::string("float32_") + core::Float32ProjectionName(info.param.float32_projection) +
         "_bf16_" + core::Bf16ProjectionName(info.param.bf16_projection);
}

// Each float32 set once and each bf16 set once (the core's test crosses them all).
std::vector<ServerKernels> ServerKernelSets() {
  std::vector<ServerKernels> sets = {
      {core::Float32Projection::kOwn, core::Bf16Projection::kFloat32},
      {core::Float32Projection::kOneDnn, core::Bf16Projection::kOneDnn}};
  for (const core::Bf16Projection projection :
       {core::Bf16Projection::kAmx, core::Bf16Projection::kAvx512Bf16}) {
    sets.push_back({core::Float32Projection::kOwn, projection});
  }
  return sets;
}

class BatchInvarianceServerTest : public ServerTest,
                                  public ::testing::WithParamInterface<ServerKernels> {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.demo_layer = false;
    options.cpu_kernels.float32_projection = GetParam().float32_projection;
    options.cpu_kernels.bf16_projection = GetParam().bf16_projection;
    options.cpu_kernels.bf16_layers_as_float32 = false;
    // Callers released together share forward passes.
    options.batcher.limits.max_queue_delay = absl::Milliseconds(20);
    return options;
  }

  void SetUp() override {
    if (!core::CpuSupports(GetParam().bf16_projection)) {
      GTEST_SKIP() << "this CPU does not run "
                   << core::Bf16ProjectionName(GetParam().bf16_projection) << " projections";
    }
    ServerTest::SetUp();
    for (const auto& [name, dtype] :
         {std::pair{"f32", v1::FLOAT32}, std::pair{"b16", v1::BFLOAT16}}) {
      v1::LoadLayerRequest request;
      request.set_name(name);
      v1::LayerConfig* config = request.mutable_spec()->mutable_config();
      config->set_embed_dim(kEmbed);
      config->set_num_heads(4);
      config->set_num_kv_heads(2);
      config->set_rope_theta(10000);
      config->set_always_causal(true);
      config->set_compute_dtype(dtype);
      request.mutable_spec()->mutable_random_init()->set_seed(55);
      const auto loaded = client_->LoadLayer(request);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
    }
  }

  v1::MultiHeadAttentionRequest Request(const std::string& layer, int64_t tokens) {
    v1::MultiHeadAttentionRequest request;
    request.set_layer(layer);
    wire::EncodeTensor(RandomValues(rng_, tokens * kEmbed), {1, tokens, kEmbed},
                       core::DType::kFloat32, request.mutable_query());
    return request;
  }

  // The probe's answer bytes when it is sent at once with `neighbours`, each on its own
  // thread.
  std::string ProbeBeside(const v1::MultiHeadAttentionRequest& probe,
                          const std::vector<v1::MultiHeadAttentionRequest>& neighbours) {
    std::vector<std::thread> callers;
    for (const v1::MultiHeadAttentionRequest& neighbour : neighbours) {
      callers.emplace_back([this, &neighbour] {
        const auto answered = client_->MultiHeadAttention(neighbour);
        EXPECT_TRUE(answered.ok()) << answered.status();
      });
    }
    const auto answered = client_->MultiHeadAttention(probe);
    for (std::thread& caller : callers) caller.join();
    EXPECT_TRUE(answered.ok()) << answered.status();
    return answered.ok() ? answered->output().raw_data() : "";
  }

  v1::SessionStepEntry HiddenEntry(const std::string& session, int64_t layer, int64_t position,
                                   const std::vector<float>& rows) {
    v1::SessionStepEntry entry;
    entry.set_session_id(session);
    entry.set_layer(layer);
    entry.set_position(position);
    const int64_t n = static_cast<int64_t>(rows.size()) / kEmbed;
    wire::EncodeTensor(rows, {n, kEmbed}, core::DType::kFloat32, entry.mutable_hidden_states());
    return entry;
  }

  std::string NewSession(const std::string& layer, int64_t reserved_tokens) {
    v1::CreateSessionRequest request;
    request.mutable_config()->add_layers(layer);
    request.set_reserved_tokens(reserved_tokens);
    const auto created = client_->CreateSession(request);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->session_id() : "";
  }

  // `probe`'s query as a KServe ModelInfer call's answer bytes, sent with `neighbours` at once.
  std::string KserveProbeBeside(const v1::MultiHeadAttentionRequest& probe,
                                const std::vector<v1::MultiHeadAttentionRequest>& neighbours) {
    inference::ModelInferRequest request;
    request.set_model_name(probe.layer());
    auto* query = request.add_inputs();
    query->set_name("query");
    query->set_datatype("FP32");
    for (const int64_t dim : probe.query().shape()) query->add_shape(dim);
    *request.add_raw_input_contents() = probe.query().raw_data();
    std::vector<std::thread> callers;
    for (const v1::MultiHeadAttentionRequest& neighbour : neighbours) {
      callers.emplace_back([this, &neighbour] {
        const auto answered = client_->MultiHeadAttention(neighbour);
        EXPECT_TRUE(answered.ok()) << answered.status();
      });
    }
    const auto kserve = inference::GRPCInferenceService::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(server_->port()), grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    inference::ModelInferResponse response;
    const grpc::Status status = kserve->ModelInfer(&context, request, &response);
    for (std::thread& caller : callers) caller.join();
    EXPECT_TRUE(status.ok()) << status.error_message();
    return status.ok() && response.raw_output_contents_size() > 0 ? response.raw_output_contents(0)
                                                                  : "";
  }

  std::mt19937_64 rng_{55};
};

TEST_P(BatchInvarianceServerTest, StatelessAnswersAreTheSameBitsBesideConcurrentCallers) {
  SCOPED_TRACE("seed 55");
  for (const std::string layer : {"f32", "b16"}) {
    for (const int64_t probe_tokens : {1, 5}) {
      const v1::MultiHeadAttentionRequest probe = Request(layer, probe_tokens);
      const auto alone = client_->MultiHeadAttention(probe);
      ASSERT_TRUE(alone.ok()) << alone.status();
      for (const int64_t rows : {1, 63, 64, 300}) {
        SCOPED_TRACE(layer + " layer, " + std::to_string(probe_tokens) + " tokens beside " +
                     std::to_string(rows) + " rows, twice");
        const std::vector<v1::MultiHeadAttentionRequest> neighbours = {Request(layer, rows),
                                                                       Request(layer, rows)};
        EXPECT_EQ(DifferingFloats(ProbeBeside(probe, neighbours), alone->output().raw_data()), 0);
        EXPECT_EQ(DifferingFloats(KserveProbeBeside(probe, neighbours), alone->output().raw_data()),
                  0)
            << "over KServe";
      }
    }
  }
}

// The report: a step retried beside 64 rows of another session was refused
// (FAILED_PRECONDITION, "already holds other keys or values"), and the reverse order too.
TEST_P(BatchInvarianceServerTest, RetriedSessionStepsBesideOtherSessionsAreRetries) {
  SCOPED_TRACE("seed 55");
  const std::vector<float> token = RandomValues(rng_, kEmbed);
  for (const std::string layer_name : {"f32", "b16"}) {
    SCOPED_TRACE(layer_name + " layer");
    const std::string probe_session = NewSession(layer_name, 64);
    const std::string other = NewSession(layer_name, 512);
    constexpr int64_t layer = 0;
    v1::SessionStepRequest alone;
    *alone.add_entries() = HiddenEntry(probe_session, layer, 0, token);
    const auto first = client_->SessionStep(alone);
    ASSERT_TRUE(first.ok()) << first.status();
    for (const int64_t rows : {63, 64, 300}) {
      SCOPED_TRACE("beside " + std::to_string(rows) + " rows");
      // The other session steps its rows from scratch each time (after a truncate).
      const auto truncated = client_->TruncateSession(other, 0);
      ASSERT_TRUE(truncated.ok()) << truncated.status();
      v1::SessionStepRequest beside;
      *beside.add_entries() = HiddenEntry(other, layer, 0, RandomValues(rng_, rows * kEmbed));
      *beside.add_entries() = HiddenEntry(probe_session, layer, 0, token);
      const auto retried = client_->SessionStep(beside);
      ASSERT_TRUE(retried.ok()) << retried.status();
      EXPECT_EQ(DifferingFloats(retried->results(1).output().raw_data(),
                                first->results(0).output().raw_data()),
                0);
      // And alone again after stepping beside.
      const auto again = client_->SessionStep(alone);
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_EQ(DifferingFloats(again->results(0).output().raw_data(),
                                first->results(0).output().raw_data()),
                0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KernelSets, BatchInvarianceServerTest,
                         ::testing::ValuesIn(ServerKernelSets()), ServerKernelsName);

// The decode kernel's shared prefixes do not depend on the projections' kernel sets: one
// server, with room for 2 x 72 forks of a prefix, each with a block of its own.
class ForkInvarianceServerTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.demo_layer = false;
    options.sessions.kv_cache_bytes = 64 << 20;
    return options;
  }
};

// Forks of one 4,096-token prefix (whole KV blocks, so the forks share them, and four whole
// splits of the decode kernel) each step a token alone; then all of them step again in one request,
// 72 forks of 4 query heads (288 rows, past the 64 from which forks once attended their prefix as
// matrix products, not bitwise): every retry answers its bits alone. In float32 and bf16 KV (bf16
// products where the host has them).
TEST_F(ForkInvarianceServerTest, ForksSteppingTogetherAnswerTheirBitsAlone) {
  SCOPED_TRACE("seed 55");
  std::mt19937_64 rng(55);
  constexpr int64_t kPrefix = 4096, kForks = 72, kHeads = 4, kHeadDim = 16;
  const auto raw_entry = [&rng](const std::string& session, int64_t position, int64_t n) {
    v1::SessionStepEntry entry;
    entry.set_session_id(session);
    entry.set_position(position);
    wire::EncodeTensor(RandomValues(rng, n * kHeads * kHeadDim), {n, kHeads, kHeadDim},
                       core::DType::kFloat32, entry.mutable_query());
    wire::EncodeTensor(RandomValues(rng, n * kHeadDim), {n, 1, kHeadDim}, core::DType::kFloat32,
                       entry.mutable_key());
    wire::EncodeTensor(RandomValues(rng, n * kHeadDim), {n, 1, kHeadDim}, core::DType::kFloat32,
                       entry.mutable_value());
    return entry;
  };
  for (const v1::DataType kv_dtype : {v1::FLOAT32, v1::BFLOAT16}) {
    SCOPED_TRACE(v1::DataType_Name(kv_dtype) + " KV");
    v1::CreateSessionRequest create;
    create.mutable_config()->set_num_layers(1);
    create.mutable_config()->set_num_heads(kHeads);
    create.mutable_config()->set_num_kv_heads(1);
    create.mutable_config()->set_head_dim(kHeadDim);
    create.mutable_config()->set_kv_dtype(kv_dtype);
    create.set_reserved_tokens(kPrefix + 1);
    const auto prefix = client_->CreateSession(create);
    ASSERT_TRUE(prefix.ok()) << prefix.status();
    v1::SessionStepRequest prefill;
    *prefill.add_entries() = raw_entry(prefix->session_id(), 0, kPrefix);
    const auto prefilled = client_->SessionStep(prefill);
    ASSERT_TRUE(prefilled.ok()) << prefilled.status();
    v1::SessionStepRequest together;
    std::vector<std::string> answers_alone;
    for (int64_t f = 0; f < kForks; ++f) {
      v1::ForkSessionRequest fork;
      fork.set_session_id(prefix->session_id());
      fork.set_tokens(kPrefix);
      const auto forked = client_->ForkSession(fork);
      ASSERT_TRUE(forked.ok()) << forked.status();
      v1::SessionStepRequest alone;
      *alone.add_entries() = raw_entry(forked->session_id(), kPrefix, 1);
      const auto answered = client_->SessionStep(alone);
      ASSERT_TRUE(answered.ok()) << answered.status();
      answers_alone.push_back(answered->results(0).output().raw_data());
      *together.add_entries() = alone.entries(0);
    }
    const auto retried = client_->SessionStep(together);
    ASSERT_TRUE(retried.ok()) << retried.status();
    int64_t differing_forks = 0;
    for (int64_t f = 0; f < kForks; ++f) {
      differing_forks +=
          DifferingFloats(retried->results(f).output().raw_data(), answers_alone[f]) != 0 ? 1 : 0;
    }
    EXPECT_EQ(differing_forks, 0) << "of " << kForks << " forks";
  }
}

}  // namespace
}  // namespace attention::server::testing

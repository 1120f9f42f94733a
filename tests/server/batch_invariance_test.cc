// Batch invariance over the wire (issue 55): for every kernel set this host runs (forced as
// --float32_kernels and --bf16_kernels force them), a probe's answer is the same bits alone
// as beside concurrent callers that share its forward pass, and a session step retried
// beside other sessions' rows is a retry: OK, with the same bits. The core's test
// (tests/core/batch_invariance_test.cc) covers every neighbour size and thread count.
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/cpu/bf16_linear.h"
#include "core/cpu/float32_linear.h"
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

}  // namespace
}  // namespace attention::server::testing

// Sessions over served layers (issue 25 §1): hidden states in, the server projects, rotates at
// the cache positions, attends and projects out. Incremental decode over the wire must give
// the one-shot causal forward of the same tokens through the same layer, position by
// position, by FlashAttention's rule; and every rejection has its code and field.
#include <algorithm>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "prometheus/metric_family.h"
#include "tests/core/fidelity.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

constexpr int64_t kEmbed = 64;

// A decoder layer: GQA 4:2, head size 16, RoPE; `window` > 0 adds a sliding window.
v1::LoadLayerRequest DecoderLayer(const std::string& name, uint64_t seed, int64_t window = 0) {
  v1::LoadLayerRequest request;
  request.set_name(name);
  v1::LayerConfig* config = request.mutable_spec()->mutable_config();
  config->set_embed_dim(kEmbed);
  config->set_num_heads(4);
  config->set_num_kv_heads(2);
  config->set_head_dim(16);
  config->set_rope_theta(10000);
  config->set_always_causal(true);
  config->set_sliding_window(window);
  if (seed % 2 == 1) {  // Llama: no biases; the other seeds keep Qwen2-style Q/K/V biases
    config->set_no_qkv_bias(true);
    config->set_no_output_bias(true);
  }
  request.mutable_spec()->mutable_random_init()->set_seed(seed);
  return request;
}

class SessionLayersTest : public ServerTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = ServerTest::Options();
    options.demo_layer = false;
    return options;
  }

  void SetUp() override {
    ServerTest::SetUp();
    stub_ = v1::AttentionService::NewStub(client_->channel());
  }

  void Load(const v1::LoadLayerRequest& request) {
    const auto loaded = client_->LoadLayer(request);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
  }

  grpc::Status Create(const v1::SessionConfig& config, v1::SessionInfo* session) {
    v1::CreateSessionRequest request;
    *request.mutable_config() = config;
    request.set_reserved_tokens(64);
    v1::CreateSessionResponse response;
    grpc::ClientContext context;
    grpc::Status status = stub_->CreateSession(&context, request, &response);
    *session = response.session();
    return status;
  }

  grpc::Status Step(const v1::SessionStepRequest& request, v1::SessionStepResponse* response) {
    grpc::ClientContext context;
    return stub_->SessionStep(&context, request, response);
  }

  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

v1::SessionConfig OverLayers(const std::vector<std::string>& names) {
  v1::SessionConfig config;
  for (const std::string& name : names) config.add_layers(name);
  return config;
}

// hidden_states rows [first, first + n) of `x` ([T, E]) for `layer` at position `first`.
v1::SessionStepEntry HiddenEntry(const std::string& session, int64_t layer,
                                 const std::vector<float>& x, int64_t first, int64_t n) {
  v1::SessionStepEntry entry;
  entry.set_session_id(session);
  entry.set_layer(layer);
  entry.set_position(first);
  const std::vector<float> rows(x.begin() + first * kEmbed, x.begin() + (first + n) * kEmbed);
  wire::EncodeTensor(rows, {n, kEmbed}, core::DType::kFloat32, entry.mutable_hidden_states());
  return entry;
}

TEST_F(SessionLayersTest, IncrementalDecodeIsTheOneShotCausalForward) {
  const uint64_t seed = 2511;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  Load(DecoderLayer("llama", 1));
  Load(DecoderLayer("qwen", 2));
  Load(DecoderLayer("mistral", 3, /*window=*/8));
  // Two sessions over the same two layers (a batch of two sequences), one over a windowed
  // and an unwindowed layer (each keeps its own window, as Gemma's alternate); all three
  // decode in the same steps.
  v1::SessionInfo a, b, windowed;
  ASSERT_TRUE(Create(OverLayers({"llama", "qwen"}), &a).ok());
  ASSERT_TRUE(Create(OverLayers({"llama", "qwen"}), &b).ok());
  grpc::Status created = Create(OverLayers({"mistral", "llama"}), &windowed);
  ASSERT_TRUE(created.ok()) << created.error_message();
  // The heads come from the layers.
  EXPECT_EQ(a.config().num_layers(), 2);
  EXPECT_EQ(a.config().num_heads(), 4);
  EXPECT_EQ(a.config().num_kv_heads(), 2);
  EXPECT_EQ(a.config().head_dim(), 16);
  ASSERT_EQ(a.config().layers_size(), 2);
  EXPECT_EQ(a.config().layers(1), "qwen");
  EXPECT_EQ(a.config().sliding_window(), 0);
  EXPECT_EQ(a.config().layer_sliding_windows_size(), 0) << "one window for all layers";
  EXPECT_EQ(windowed.config().sliding_window(), 0);
  EXPECT_EQ(std::vector<int64_t>(windowed.config().layer_sliding_windows().begin(),
                                 windowed.config().layer_sliding_windows().end()),
            (std::vector<int64_t>{8, 0}));

  constexpr int64_t kTokens = 29, kPrefill = 17;
  struct Sequence {
    std::string id;
    std::vector<std::string> layers;
    std::vector<float> x;                    // [T, E]
    std::vector<std::vector<float>> output;  // per layer, [T, E] as the steps answered
  };
  std::vector<Sequence> sequences = {{a.session_id(), {"llama", "qwen"}, {}, {}},
                                     {b.session_id(), {"llama", "qwen"}, {}, {}},
                                     {windowed.session_id(), {"mistral", "llama"}, {}, {}}};
  for (Sequence& s : sequences) {
    s.x = RandomValues(rng, kTokens * kEmbed);
    s.output.assign(s.layers.size(), std::vector<float>(kTokens * kEmbed));
  }
  // A chunked prefill, then one token per step; every entry of every session in one request.
  v1::SessionStepRequest last;
  for (int64_t first = 0; first < kTokens; first += first == 0 ? kPrefill : 1) {
    const int64_t n = first == 0 ? kPrefill : 1;
    v1::SessionStepRequest request;
    for (const Sequence& s : sequences) {
      for (size_t l = 0; l < s.layers.size(); ++l) {
        *request.add_entries() = HiddenEntry(s.id, static_cast<int64_t>(l), s.x, first, n);
      }
    }
    v1::SessionStepResponse response;
    const grpc::Status status = Step(request, &response);
    ASSERT_TRUE(status.ok()) << "position " << first << ": " << status.error_message();
    int result = 0;
    for (Sequence& s : sequences) {
      for (size_t l = 0; l < s.layers.size(); ++l, ++result) {
        const v1::Tensor& output = response.results(result).output();
        ASSERT_EQ(output.shape_size(), 2);
        EXPECT_EQ(output.shape(0), n);
        EXPECT_EQ(output.shape(1), kEmbed);
        const std::vector<float> values = wire::DecodeFloatTensor(output, "output")->values;
        std::copy(values.begin(), values.end(), s.output[l].begin() + first * kEmbed);
      }
    }
    last = request;
  }
  // A retry of the last step writes nothing and answers the same, bitwise.
  v1::SessionStepResponse retried;
  ASSERT_TRUE(Step(last, &retried).ok());
  const std::vector<float> again =
      wire::DecodeFloatTensor(retried.results(0).output(), "output")->values;
  const std::vector<float> first_answer(sequences[0].output[0].end() - kEmbed,
                                        sequences[0].output[0].end());
  EXPECT_EQ(again, first_answer);

  core::testing::FidelityStats stats("served-layer sessions vs the one-shot forward");
  for (const Sequence& s : sequences) {
    for (size_t l = 0; l < s.layers.size(); ++l) {
      SCOPED_TRACE(::testing::Message() << s.layers[l] << " of " << s.id);
      const auto layer = (*server_->registry().Get(s.layers[l]))->layer;
      core::MhaInput input;
      input.batch = 1;
      input.q_len = input.kv_len = kTokens;
      input.query = s.x;
      input.options.causal = true;
      const auto textbook = layer->ForwardTextbook<float>(input);
      const auto oracle = layer->ForwardTextbook<double>(input);
      EXPECT_TRUE(stats.Check(s.output[l], textbook.output, oracle.output));
    }
  }
}

// Sessions over BFLOAT16 layers (issue 26) keep K and V in bf16 unless the config asks
// otherwise, and decode by the bf16 rule: against the same tokens through the layer's bf16
// textbook (PyTorch's bf16 stages), the float64 oracle being the float32 layer of the same
// weights.
TEST_F(SessionLayersTest, Bf16LayersKeepABf16CacheAndDecodeByTheBf16Rule) {
  const uint64_t seed = 2613;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  v1::LoadLayerRequest bf16 = DecoderLayer("qwen-bf16", 2);
  bf16.mutable_spec()->mutable_config()->set_compute_dtype(v1::BFLOAT16);
  Load(bf16);
  Load(DecoderLayer("qwen", 2));
  v1::SessionInfo session, float_cache;
  ASSERT_TRUE(Create(OverLayers({"qwen-bf16"}), &session).ok());
  EXPECT_EQ(session.config().kv_dtype(), v1::BFLOAT16);
  v1::SessionConfig asked = OverLayers({"qwen-bf16"});
  asked.set_kv_dtype(v1::FLOAT32);
  ASSERT_TRUE(Create(asked, &float_cache).ok());
  EXPECT_EQ(float_cache.config().kv_dtype(), v1::FLOAT32);

  constexpr int64_t kTokens = 23, kPrefill = 11;
  const std::vector<float> x = RandomValues(rng, kTokens * kEmbed);
  std::vector<std::vector<float>> outputs(2, std::vector<float>(kTokens * kEmbed));
  for (int64_t first = 0; first < kTokens; first += first == 0 ? kPrefill : 1) {
    const int64_t n = first == 0 ? kPrefill : 1;
    v1::SessionStepRequest request;
    *request.add_entries() = HiddenEntry(session.session_id(), 0, x, first, n);
    *request.add_entries() = HiddenEntry(float_cache.session_id(), 0, x, first, n);
    v1::SessionStepResponse response;
    const grpc::Status status = Step(request, &response);
    ASSERT_TRUE(status.ok()) << "position " << first << ": " << status.error_message();
    for (int e = 0; e < 2; ++e) {
      const std::vector<float> values =
          wire::DecodeFloatTensor(response.results(e).output(), "output")->values;
      std::copy(values.begin(), values.end(), outputs[e].begin() + first * kEmbed);
    }
  }
  core::MhaInput input;
  input.batch = 1;
  input.q_len = input.kv_len = kTokens;
  input.query = x;
  input.options.causal = true;
  const auto reference = (*server_->registry().Get("qwen-bf16"))->layer->ForwardBf16Textbook(input);
  const auto oracle = (*server_->registry().Get("qwen"))->layer->ForwardTextbook<double>(input);
  core::testing::FidelityStats stats("bf16 served-layer sessions vs the bf16 one-shot forward");
  EXPECT_TRUE(stats.CheckBf16(outputs[0], reference.output, oracle.output)) << "bf16 cache";
  EXPECT_TRUE(stats.CheckBf16(outputs[1], reference.output, oracle.output)) << "float32 cache";
}

TEST_F(SessionLayersTest, EveryRefusalNamesItsField) {
  Load(DecoderLayer("llama", 1));
  Load(DecoderLayer("mistral", 3, /*window=*/8));
  v1::LoadLayerRequest cross = DecoderLayer("cross", 5);
  cross.mutable_spec()->mutable_config()->set_kdim(32);
  Load(cross);
  v1::LoadLayerRequest dynamic = DecoderLayer("dynamic", 7);
  v1::RopeScaling* scaling = dynamic.mutable_spec()->mutable_config()->mutable_rope_scaling();
  scaling->set_rope_type("dynamic");
  scaling->set_factor(2);
  scaling->set_original_max_position_embeddings(64);
  Load(dynamic);
  v1::LoadLayerRequest wider = DecoderLayer("wider", 9);
  wider.mutable_spec()->mutable_config()->set_num_heads(8);
  Load(wider);

  struct Case {
    std::string what;
    v1::SessionConfig config;
    grpc::StatusCode code;
    std::string message;
  };
  std::vector<Case> cases = {
      {"an unknown layer", OverLayers({"llama", "nope"}), grpc::StatusCode::NOT_FOUND,
       "config.layers[1]"},
      {"layers of other heads", OverLayers({"llama", "wider"}), grpc::StatusCode::INVALID_ARGUMENT,
       "config.layers[1] ('wider') has 8 heads"},
      {"one window over layers of other windows", OverLayers({"llama", "mistral"}),
       grpc::StatusCode::INVALID_ARGUMENT,
       "config.sliding_window = 8 but config.layers have different windows"},
      {"keys from another input", OverLayers({"cross"}), grpc::StatusCode::FAILED_PRECONDITION,
       "config.layers[0] ('cross'): a session projects keys and values from the hidden states"},
      {"dynamic RoPE", OverLayers({"dynamic"}), grpc::StatusCode::FAILED_PRECONDITION,
       "rope_scaling is dynamic"},
  };
  cases[2].config.set_sliding_window(8);
  Case windows{"windows that disagree", OverLayers({"llama", "mistral"}),
               grpc::StatusCode::INVALID_ARGUMENT,
               "config.layer_sliding_windows differ from config.layers' windows"};
  windows.config.add_layer_sliding_windows(8);
  windows.config.add_layer_sliding_windows(8);
  cases.push_back(windows);
  Case heads{"heads that disagree", OverLayers({"llama"}), grpc::StatusCode::INVALID_ARGUMENT,
             "config.num_heads = 3 but config.layers have 4"};
  heads.config.set_num_heads(3);
  cases.push_back(heads);
  Case layers{"a layer count that disagrees", OverLayers({"llama"}),
              grpc::StatusCode::INVALID_ARGUMENT, "config.num_layers = 2"};
  layers.config.set_num_layers(2);
  cases.push_back(layers);
  Case scale{"a scale", OverLayers({"llama"}), grpc::StatusCode::INVALID_ARGUMENT,
             "config.scale = 0.5"};
  scale.config.set_scale(0.5f);
  cases.push_back(scale);
  for (const Case& c : cases) {
    v1::SessionInfo session;
    const grpc::Status status = Create(c.config, &session);
    EXPECT_EQ(status.error_code(), c.code) << c.what << ": " << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), c.message))
        << c.what << ": " << status.error_message();
  }

  // Steps: the wrong inputs for the session's kind, the wrong width, a layer past the end.
  v1::SessionInfo served, raw;
  ASSERT_TRUE(Create(OverLayers({"llama"}), &served).ok());
  v1::SessionConfig raw_config;
  raw_config.set_num_heads(4);
  raw_config.set_num_kv_heads(2);
  raw_config.set_head_dim(16);
  raw_config.set_num_layers(1);
  ASSERT_TRUE(Create(raw_config, &raw).ok());
  std::mt19937_64 rng(7);
  const std::vector<float> x = RandomValues(rng, 2 * kEmbed);
  struct StepCase {
    std::string what;
    v1::SessionStepEntry entry;
    std::string message;
  };
  std::vector<StepCase> steps;
  StepCase with_query{"query for a served session", HiddenEntry(served.session_id(), 0, x, 0, 1),
                      "entries[0] gives query, key or value, but the session runs over served"};
  wire::EncodeTensor(std::vector<float>(4 * 16), {1, 4, 16}, core::DType::kFloat32,
                     with_query.entry.mutable_query());
  steps.push_back(with_query);
  steps.push_back({"hidden states for a raw session", HiddenEntry(raw.session_id(), 0, x, 0, 1),
                   "entries[0].hidden_states is for sessions over served layers"});
  StepCase narrow{"the wrong width", HiddenEntry(served.session_id(), 0, x, 0, 1),
                  "entries[0].hidden_states.shape [1, 63] must be [n, embed_dim] = [n, 64]"};
  wire::EncodeTensor(std::vector<float>(63), {1, 63}, core::DType::kFloat32,
                     narrow.entry.mutable_hidden_states());
  steps.push_back(narrow);
  steps.push_back({"a layer past the end", HiddenEntry(served.session_id(), 1, x, 0, 1),
                   "entries[0].layer = 1 is outside [0, 1)"});
  for (const StepCase& c : steps) {
    v1::SessionStepRequest request;
    *request.add_entries() = c.entry;
    v1::SessionStepResponse response;
    const grpc::Status status = Step(request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << c.what << ": " << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), c.message))
        << c.what << ": " << status.error_message();
  }
  // Placement is refused before the hidden states are projected (4,096 of them at a gap
  // once took 0.44 s to refuse).
  const std::vector<float> rows = RandomValues(rng, 65 * kEmbed);
  v1::SessionStepEntry gap = HiddenEntry(served.session_id(), 0, rows, 0, 3);
  gap.set_position(5);
  const std::vector<std::tuple<std::string, v1::SessionStepEntry, std::string>> placements = {
      {"a gap", gap, "entries[0]: position = 5 leaves a gap: layer 0 of the session holds 0"},
      {"past the reservation", HiddenEntry(served.session_id(), 0, rows, 0, 65),
       "entries[0]: position + num_tokens = 65 is past the session's reservation of 64"}};
  for (const auto& [what, entry, message] : placements) {
    v1::SessionStepRequest request;
    *request.add_entries() = entry;
    v1::SessionStepResponse response;
    const grpc::Status status = Step(request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::OUT_OF_RANGE)
        << what << ": " << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), message))
        << what << ": " << status.error_message();
  }
  // Nothing was written by the refused steps.
  const auto info = client_->GetSession(served.session_id());
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->length(), 0);
}

// A session pins its layers: loading another layer under the same name changes nothing for
// it, and unloading the name does not end it.
TEST_F(SessionLayersTest, SessionsKeepTheLayersTheyWereCreatedWith) {
  std::mt19937_64 rng(99);
  Load(DecoderLayer("llama", 1));
  v1::SessionInfo session;
  ASSERT_TRUE(Create(OverLayers({"llama"}), &session).ok());
  const std::vector<float> x = RandomValues(rng, 3 * kEmbed);
  v1::SessionStepRequest prefill;
  *prefill.add_entries() = HiddenEntry(session.session_id(), 0, x, 0, 2);
  v1::SessionStepResponse response;
  ASSERT_TRUE(Step(prefill, &response).ok());
  v1::SessionStepRequest decode;
  *decode.add_entries() = HiddenEntry(session.session_id(), 0, x, 2, 1);
  v1::SessionStepResponse before, after;
  ASSERT_TRUE(Step(decode, &before).ok());
  ASSERT_TRUE(client_->TruncateSession(session.session_id(), 2).ok());
  Load(DecoderLayer("llama", 11));  // other weights under the same name
  ASSERT_TRUE(client_->UnloadLayer("llama").ok());
  ASSERT_TRUE(Step(decode, &after).ok());
  EXPECT_EQ(wire::DecodeFloatTensor(after.results(0).output(), "output")->values,
            wire::DecodeFloatTensor(before.results(0).output(), "output")->values);
}

// Sessions pin their layers, so a layer unloaded or replaced while sessions hold it stays in
// memory; it counts against --max_weight_bytes until the last of them ends (issue 38), and
// in attention_layer_weight_bytes.
class SessionLayersBudgetTest : public SessionLayersTest {
 protected:
  ServerOptions Options() override {
    ServerOptions options = SessionLayersTest::Options();
    options.device = "cpu";  // the budget below is a CPU layer's, with its packed copy
    options.registry.max_weight_bytes = max_weight_bytes_;
    return options;
  }

  void Restart(int64_t max_weight_bytes) {
    stub_.reset();
    client_.reset();
    server_.reset();
    max_weight_bytes_ = max_weight_bytes;
    SetUp();
  }

  double WeightGauge() {
    for (const prometheus::MetricFamily& family : server_->metrics().registry().Collect()) {
      if (family.name == "attention_layer_weight_bytes") return family.metric[0].gauge.value;
    }
    return -1;
  }

  int64_t max_weight_bytes_ = 0;
};

TEST_F(SessionLayersBudgetTest, LayersThatSessionsStillHoldCountAgainstTheWeightBudget) {
  Load(DecoderLayer("llama", 1));
  const core::MhaLayer& probe = *(*server_->registry().Get("llama"))->layer;
  const int64_t host = probe.HostBytes(), weights = probe.WeightBytes();
  const int64_t estimate = LayerRegistry::EstimatedHostBytes(weights, "cpu");
  // Room for two such layers: LoadLayer checks the estimate, Publish the built size.
  const int64_t budget = host + std::max(host, estimate);
  Restart(budget);
  Load(DecoderLayer("llama", 1));
  v1::SessionInfo session;
  ASSERT_TRUE(Create(OverLayers({"llama"}), &session).ok());
  Load(DecoderLayer("llama", 11));  // the session keeps the first weights in memory
  EXPECT_EQ(server_->registry().weight_bytes(), 2 * weights);
  // A second layer would fit beside the loaded one, but not beside the one the session holds.
  const absl::Status refused = client_->LoadLayer(DecoderLayer("other", 3)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(
      refused.message(),
      absl::StrCat("max_weight_bytes = ", budget, " are free (", 2 * host,
                   " in use by 1 other layer(s), ", host,
                   " by 1 unloaded or replaced layer(s) that sessions still hold); unload a "
                   "layer, drop the sessions over retired layers or raise --max_weight_bytes")))
      << refused;
  EXPECT_EQ(WeightGauge(), 2 * weights);
  // Once the session ends its weights are freed, and the load fits.
  ASSERT_TRUE(client_->DropSession(session.session_id()).ok());
  EXPECT_EQ(server_->registry().weight_bytes(), weights);
  Load(DecoderLayer("other", 3));
  // Unloading a layer a session holds keeps it counted too, with no layer of its name loaded.
  ASSERT_TRUE(Create(OverLayers({"other"}), &session).ok());
  ASSERT_TRUE(client_->UnloadLayer("other").ok());
  EXPECT_EQ(server_->registry().weight_bytes(), 2 * weights);
  EXPECT_EQ(client_->LoadLayer(DecoderLayer("third", 5)).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(client_->DropSession(session.session_id()).ok());
  EXPECT_EQ(server_->registry().weight_bytes(), weights);
  Load(DecoderLayer("third", 5));
}

}  // namespace
}  // namespace attention::server::testing

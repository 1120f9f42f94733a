// LoadLayer from the model repository: every naming convention against a native load of the
// same weights, path confinement, malformed files, persistence across restarts, the weight
// budget, and load / reload / unload under traffic. Each server is in-process on port 0 with
// its own temporary repository.
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/devices.h"
#include "core/safetensors.h"
#include "absl/strings/match.h"
#include "server/models/model_repository.h"
#include "server/models/layer_config.h"
#include "server/validation/wire_convert.h"
#include "tests/server/test_server.h"

namespace attention::server::testing {
namespace {

namespace fs = std::filesystem;
using wire::DecodeFloatTensor;
using wire::EncodeTensor;

struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

std::vector<float> Concat(std::initializer_list<const std::vector<float>*> parts) {
  std::vector<float> out;
  for (const auto* part : parts) out.insert(out.end(), part->begin(), part->end());
  return out;
}

// Writes `tensors` as a safetensors file of `dtype` at `path`.
void WriteSafetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                      core::DType dtype = core::DType::kFloat32) {
  std::vector<std::string> bytes;
  for (const NamedTensor& t : tensors) bytes.push_back(core::EncodeFloats(t.values, dtype));
  std::vector<core::SafetensorsEntry> entries;
  for (size_t i = 0; i < tensors.size(); ++i) {
    entries.push_back({tensors[i].name, dtype, tensors[i].shape, bytes[i]});
  }
  auto image = core::SerializeSafetensors(entries, {{"format", "pt"}});
  ASSERT_TRUE(image.ok()) << image.status();
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << *image;
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// The tensors of `w` as each convention names them (written out here independently of the
// server's mapping, from the PyTorch / Hugging Face module definitions).
std::vector<NamedTensor> ConventionTensors(v1::WeightNaming naming, const core::MhaConfig& c,
                                           const core::MhaWeights& w, const std::string& p) {
  const int64_t q = c.QWidth(), k = c.KWidth(), v = c.VWidth(), e = c.embed_dim;
  std::vector<NamedTensor> out;
  switch (naming) {
    case v1::WEIGHT_NAMING_NATIVE:
      for (const auto& slot : core::MhaWeights::Slots(c)) {
        out.push_back({p + slot.name, slot.shape, w.*slot.member});
      }
      break;
    case v1::WEIGHT_NAMING_TORCH_MHA:
      if (c.kdim == e && c.vdim == e) {
        out.push_back({p + "in_proj_weight", {q + k + v, e},
                       Concat({&w.q_weight, &w.k_weight, &w.v_weight})});
      } else {
        out.push_back({p + "q_proj_weight", {q, e}, w.q_weight});
        out.push_back({p + "k_proj_weight", {k, c.kdim}, w.k_weight});
        out.push_back({p + "v_proj_weight", {v, c.vdim}, w.v_weight});
      }
      out.push_back({p + "in_proj_bias", {q + k + v}, Concat({&w.q_bias, &w.k_bias, &w.v_bias})});
      out.push_back({p + "out_proj.weight", {c.output_dim, c.AttentionWidth()}, w.out_weight});
      out.push_back({p + "out_proj.bias", {c.output_dim}, w.out_bias});
      break;
    case v1::WEIGHT_NAMING_HF_BERT:
      out.push_back({p + "attention.self.query.weight", {q, e}, w.q_weight});
      out.push_back({p + "attention.self.query.bias", {q}, w.q_bias});
      out.push_back({p + "attention.self.key.weight", {k, c.kdim}, w.k_weight});
      out.push_back({p + "attention.self.key.bias", {k}, w.k_bias});
      out.push_back({p + "attention.self.value.weight", {v, c.vdim}, w.v_weight});
      out.push_back({p + "attention.self.value.bias", {v}, w.v_bias});
      out.push_back({p + "attention.output.dense.weight", {c.output_dim, c.AttentionWidth()},
                     w.out_weight});
      out.push_back({p + "attention.output.dense.bias", {c.output_dim}, w.out_bias});
      // The rest of a BERT layer, which the loader must leave alone.
      out.push_back({p + "attention.output.LayerNorm.weight", {e}, std::vector<float>(e, 1.0f)});
      out.push_back({p + "intermediate.dense.weight", {2 * e, e}, std::vector<float>(2 * e * e, 0.5f)});
      break;
    case v1::WEIGHT_NAMING_HF_LLAMA:
      out.push_back({p + "self_attn.q_proj.weight", {q, e}, w.q_weight});
      out.push_back({p + "self_attn.k_proj.weight", {k, e}, w.k_weight});
      out.push_back({p + "self_attn.v_proj.weight", {v, e}, w.v_weight});
      out.push_back({p + "self_attn.o_proj.weight", {e, c.AttentionWidth()}, w.out_weight});
      out.push_back({p + "input_layernorm.weight", {e}, std::vector<float>(e, 1.0f)});
      break;
    default:
      break;
  }
  return out;
}

// Weights that every storage dtype represents exactly, so loads in any format agree bit for
// bit with the native float32 load.
core::MhaWeights ExactWeights(const core::MhaConfig& config, uint64_t seed) {
  core::MhaWeights weights = core::MhaWeights::Random(config, seed);
  for (const auto& slot : core::MhaWeights::Slots(config)) {
    for (float& value : weights.*slot.member) {
      value = core::BFloat16ToFloat(core::FloatToBFloat16(value));
    }
  }
  return weights;
}

v1::LayerConfig ToProto(const core::MhaConfig& config) {
  v1::LayerConfig out;
  out.set_embed_dim(config.embed_dim);
  out.set_num_heads(config.num_heads);
  out.set_num_kv_heads(config.num_kv_heads);
  out.set_head_dim(config.head_dim);
  out.set_always_causal(config.always_causal);
  out.set_kdim(config.kdim);
  out.set_vdim(config.vdim);
  out.set_no_qkv_bias(!config.qkv_bias);
  out.set_no_output_bias(!config.output_bias);
  out.set_rope_theta(config.rope_theta);
  return out;
}

class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "model_repository_test.XXXXXX";
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& relative) const { return path_ + "/" + relative; }

 private:
  std::string path_;
};

class RepositoryTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(); }

  ServerOptions Options() const {
    ServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.metrics_address = "";
    options.compute_threads = 2;
    options.demo_layer = false;
    options.registry.model_repository = repository_.path();
    return options;
  }

  void Start(const ServerOptions& options) {
    client_.reset();
    server_.reset();
    auto started = AttentionServer::Start(options);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(*started);
    client_ = std::make_unique<client::AttentionClient>("127.0.0.1:" +
                                                        std::to_string(server_->port()));
  }
  void Start() { Start(Options()); }

  absl::StatusOr<v1::LayerInfo> LoadFromFile(const std::string& name, const core::MhaConfig& config,
                                             const std::string& path, v1::WeightNaming naming,
                                             const std::string& prefix = "", bool persist = false) {
    v1::LoadLayerRequest request;
    request.set_name(name);
    request.set_persist(persist);
    *request.mutable_spec()->mutable_config() = ToProto(config);
    v1::SafetensorsSource* source = request.mutable_spec()->mutable_safetensors();
    source->set_path(path);
    source->set_naming(naming);
    source->set_prefix(prefix);
    return client_->LoadLayer(request);
  }

  absl::StatusOr<v1::LayerInfo> LoadInline(const std::string& name, const core::MhaConfig& config,
                                           const std::vector<NamedTensor>& tensors,
                                           v1::WeightNaming naming, const std::string& prefix = "",
                                           bool persist = false) {
    v1::LoadLayerRequest request;
    request.set_name(name);
    request.set_persist(persist);
    *request.mutable_spec()->mutable_config() = ToProto(config);
    v1::LayerWeights* weights = request.mutable_spec()->mutable_inline_weights();
    weights->set_naming(naming);
    weights->set_prefix(prefix);
    for (const NamedTensor& t : tensors) {
      EncodeTensor(t.values, t.shape, core::DType::kFloat32, &(*weights->mutable_tensors())[t.name]);
    }
    return client_->LoadLayer(request);
  }

  absl::StatusOr<v1::LayerInfo> LoadRandom(const std::string& name, int64_t embed_dim,
                                           uint64_t seed, bool persist = false) {
    v1::LoadLayerRequest request = RandomLayerRequest(name, embed_dim, seed);
    request.set_persist(persist);
    return client_->LoadLayer(request);
  }

  // Output of `layer` for a seeded input (self-attention, or cross-attention with kdim/vdim).
  std::vector<float> Run(const std::string& layer, const core::MhaConfig& config,
                         uint64_t seed = 5) {
    std::mt19937_64 rng(seed);
    v1::MultiHeadAttentionRequest request;
    request.set_layer(layer);
    const int64_t batch = 2, q_len = 3, kv_len = 4;
    EncodeTensor(RandomValues(rng, batch * q_len * config.embed_dim),
                 std::vector<int64_t>{batch, q_len, config.embed_dim}, core::DType::kFloat32,
                 request.mutable_query());
    if (config.kdim != config.embed_dim || config.vdim != config.embed_dim) {
      EncodeTensor(RandomValues(rng, batch * kv_len * config.kdim),
                   std::vector<int64_t>{batch, kv_len, config.kdim}, core::DType::kFloat32,
                   request.mutable_key());
      EncodeTensor(RandomValues(rng, batch * kv_len * config.vdim),
                   std::vector<int64_t>{batch, kv_len, config.vdim}, core::DType::kFloat32,
                   request.mutable_value());
    }
    auto response = client_->MultiHeadAttention(request);
    EXPECT_TRUE(response.ok()) << layer << ": " << response.status();
    if (!response.ok()) return {};
    return DecodeFloatTensor(response->output(), "output")->values;
  }

  TempDir repository_;
  std::unique_ptr<AttentionServer> server_;
  std::unique_ptr<client::AttentionClient> client_;
};

void ExpectStatus(const absl::Status& status, absl::StatusCode code, const std::string& part) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(status.message().find(part), std::string::npos)
      << "expected \"" << part << "\" in \"" << status.message() << "\"";
}

struct ConventionCase {
  std::string label;
  v1::WeightNaming naming;
  core::MhaConfig config;
  std::string prefix;
  core::DType file_dtype;
};

std::vector<ConventionCase> ConventionCases() {
  core::MhaConfig self;
  self.embed_dim = 8, self.num_heads = 2;
  core::MhaConfig cross = self;
  cross.kdim = 6, cross.vdim = 5;
  core::MhaConfig llama;
  llama.embed_dim = 16, llama.num_heads = 4, llama.num_kv_heads = 2;
  llama.qkv_bias = false, llama.output_bias = false, llama.rope_theta = 10000.0;
  return {
      {"native", v1::WEIGHT_NAMING_NATIVE, self, "blocks.3.attn.", core::DType::kFloat32},
      {"torch self-attention", v1::WEIGHT_NAMING_TORCH_MHA, self, "encoder.layers.0.self_attn.",
       core::DType::kFloat32},
      {"torch cross-attention", v1::WEIGHT_NAMING_TORCH_MHA, cross, "", core::DType::kFloat16},
      {"bert", v1::WEIGHT_NAMING_HF_BERT, self, "bert.encoder.layer.1.", core::DType::kBFloat16},
      {"llama gqa rope", v1::WEIGHT_NAMING_HF_LLAMA, llama, "model.layers.1.", core::DType::kBFloat16},
  };
}

TEST_F(RepositoryTest, EveryNamingConventionMatchesANativeLoadOfTheSameWeights) {
  int index = 0;
  for (const ConventionCase& test_case : ConventionCases()) {
    SCOPED_TRACE(test_case.label);
    const core::MhaConfig config = *core::MhaConfig::Resolve(test_case.config);
    const core::MhaWeights weights = ExactWeights(config, 100 + index);
    const core::MhaWeights decoy = ExactWeights(config, 200 + index);
    // The checkpoint also holds another layer under a neighbouring prefix: the prefix must
    // pick the right one.
    std::vector<NamedTensor> tensors =
        ConventionTensors(test_case.naming, config, weights, test_case.prefix);
    if (!test_case.prefix.empty()) {
      for (NamedTensor& t : ConventionTensors(test_case.naming, config, decoy, "decoy.")) {
        tensors.push_back(std::move(t));
      }
    }
    const std::string file = "checkpoints/case" + std::to_string(index) + ".safetensors";
    WriteSafetensors(repository_ / file, tensors, test_case.file_dtype);
    const std::string suffix = std::to_string(index++);

    ASSERT_TRUE(LoadInline("native" + suffix, config,
                           ConventionTensors(v1::WEIGHT_NAMING_NATIVE, config, weights, ""),
                           v1::WEIGHT_NAMING_NATIVE)
                    .ok());
    auto from_file = LoadFromFile("file" + suffix, config, file, test_case.naming, test_case.prefix);
    ASSERT_TRUE(from_file.ok()) << from_file.status();
    EXPECT_EQ(from_file->parameter_count(), config.ParameterCount());
    EXPECT_FALSE(from_file->persisted());
    if (test_case.naming != v1::WEIGHT_NAMING_HF_BERT &&
        test_case.naming != v1::WEIGHT_NAMING_HF_LLAMA) {
      // Inline weights must all be used, so BERT / Llama extras (LayerNorm) stay file-only.
      auto inline_load =
          LoadInline("inline" + suffix, config,
                     ConventionTensors(test_case.naming, config, weights, test_case.prefix),
                     test_case.naming, test_case.prefix);
      ASSERT_TRUE(inline_load.ok()) << inline_load.status();
      EXPECT_EQ(Run("inline" + suffix, config), Run("native" + suffix, config));
    }

    const std::vector<float> native = Run("native" + suffix, config);
    ASSERT_FALSE(native.empty());
    EXPECT_EQ(Run("file" + suffix, config), native);
    // And both agree with the double-precision reference on the same weights.
    const auto layer = *core::MhaLayer::Create(config, weights, std::make_shared<core::CpuBackend>(1));
    std::mt19937_64 rng(5);
    core::MhaInput input;
    input.batch = 2, input.q_len = 3, input.kv_len = 3;
    const std::vector<float> query = RandomValues(rng, 2 * 3 * config.embed_dim);
    std::vector<float> key, value;
    input.query = query;
    if (config.kdim != config.embed_dim || config.vdim != config.embed_dim) {
      input.kv_len = 4;
      key = RandomValues(rng, 2 * 4 * config.kdim);
      value = RandomValues(rng, 2 * 4 * config.vdim);
      input.key = key;
      input.value = value;
    }
    const std::vector<float> reference = layer->ForwardReference(input).output;
    ASSERT_EQ(reference.size(), native.size());
    for (size_t i = 0; i < native.size(); ++i) ASSERT_NEAR(native[i], reference[i], 1e-4) << i;
  }
}

TEST_F(RepositoryTest, MissingOrMisShapedTensorsNameTheTensorAndBothShapes) {
  core::MhaConfig config;
  config.embed_dim = 8, config.num_heads = 2;
  config = *core::MhaConfig::Resolve(config);
  const core::MhaWeights weights = ExactWeights(config, 1);
  std::vector<NamedTensor> tensors =
      ConventionTensors(v1::WEIGHT_NAMING_HF_BERT, config, weights, "bert.encoder.layer.0.");
  tensors[2].shape = {8, 4, 2};  // attention.self.key.weight
  WriteSafetensors(repository_ / "bert.safetensors", tensors);
  ExpectStatus(LoadFromFile("x", config, "bert.safetensors", v1::WEIGHT_NAMING_HF_BERT,
                            "bert.encoder.layer.0.")
                   .status(),
               absl::StatusCode::kInvalidArgument,
               "spec.safetensors: tensor \"bert.encoder.layer.0.attention.self.key.weight\" in "
               "\"bert.safetensors\" has shape [8, 4, 2]; expected [8, 8]");
  ExpectStatus(LoadFromFile("x", config, "bert.safetensors", v1::WEIGHT_NAMING_HF_BERT,
                            "bert.encoder.layer.7.")
                   .status(),
               absl::StatusCode::kInvalidArgument,
               "tensor \"bert.encoder.layer.7.attention.self.query.weight\" in \"bert.safetensors\" "
               "is missing; WEIGHT_NAMING_HF_BERT expects shape [8, 8] (nearest prefix with a "
               "WEIGHT_NAMING_HF_BERT layer: \"bert.encoder.layer.0.\"");
  // Llama checkpoints have no biases; a config that asks for them says how to fix it.
  WriteSafetensors(repository_ / "llama.safetensors",
                   ConventionTensors(v1::WEIGHT_NAMING_HF_LLAMA, config, weights, ""));
  ExpectStatus(LoadFromFile("x", config, "llama.safetensors", v1::WEIGHT_NAMING_HF_LLAMA).status(),
               absl::StatusCode::kInvalidArgument,
               "tensor \"self_attn.q_proj.bias\" in \"llama.safetensors\" is missing; "
               "WEIGHT_NAMING_HF_LLAMA expects shape [8] (for checkpoints without biases set "
               "config.no_qkv_bias");
  // TORCH_MHA with kdim != embed_dim wants the separate projections.
  core::MhaConfig cross = config;
  cross.kdim = 6;
  WriteSafetensors(repository_ / "torch.safetensors",
                   ConventionTensors(v1::WEIGHT_NAMING_TORCH_MHA, config, weights, ""));
  ExpectStatus(LoadFromFile("x", cross, "torch.safetensors", v1::WEIGHT_NAMING_TORCH_MHA).status(),
               absl::StatusCode::kInvalidArgument,
               "tensor \"q_proj_weight\" in \"torch.safetensors\" is missing; "
               "WEIGHT_NAMING_TORCH_MHA expects shape [8, 8]");
  // add_bias_kv has no equivalent here.
  std::vector<NamedTensor> with_bias_kv =
      ConventionTensors(v1::WEIGHT_NAMING_TORCH_MHA, config, weights, "");
  with_bias_kv.push_back({"bias_k", {1, 1, 8}, std::vector<float>(8)});
  WriteSafetensors(repository_ / "bias_kv.safetensors", with_bias_kv);
  ExpectStatus(LoadFromFile("x", config, "bias_kv.safetensors", v1::WEIGHT_NAMING_TORCH_MHA).status(),
               absl::StatusCode::kInvalidArgument,
               "tensor \"bias_k\" in \"bias_kv.safetensors\": nn.MultiheadAttention(add_bias_kv=True) "
               "is not supported");
  // A weight stored as F64 is refused by dtype name.
  {
    std::string bytes(8 * 8 * 8, '\0');
    std::vector<core::SafetensorsEntry> entries = {
        {"q_proj.weight", core::DType::kFloat32, {16, 8}, bytes}};
    std::string image = *core::SerializeSafetensors(entries, {});
    const size_t at = image.find("\"F32\"");
    image.replace(at, 5, "\"F64\"");
    image.replace(image.find("[16,8]"), 6, "[8,8] ");
    WriteBytes(repository_ / "f64.safetensors", image);
    ExpectStatus(LoadFromFile("x", config, "f64.safetensors", v1::WEIGHT_NAMING_NATIVE).status(),
                 absl::StatusCode::kInvalidArgument,
                 "f64.safetensors: tensor \"q_proj.weight\" has dtype F64; only F32, F16 and BF16");
  }
  // Inline weights: a stray tensor is a typo, refused by name.
  std::vector<NamedTensor> stray = ConventionTensors(v1::WEIGHT_NAMING_NATIVE, config, weights, "");
  stray.push_back({"q_proj.weigth", {1}, {0.0f}});
  ExpectStatus(LoadInline("x", config, stray, v1::WEIGHT_NAMING_NATIVE).status(),
               absl::StatusCode::kInvalidArgument,
               "spec.inline_weights.tensors[\"q_proj.weigth\"] is not a weight of this layer config "
               "under WEIGHT_NAMING_NATIVE");
  EXPECT_EQ(client_->GetLayer("x").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RepositoryTest, PathsAreConfinedToTheRepository) {
  core::MhaConfig config;
  config.embed_dim = 8, config.num_heads = 2;
  config = *core::MhaConfig::Resolve(config);
  const auto tensors = ConventionTensors(v1::WEIGHT_NAMING_NATIVE, config, ExactWeights(config, 3), "");
  TempDir outside;
  WriteSafetensors(outside / "secret.safetensors", tensors);
  WriteSafetensors(repository_ / "models/ok.safetensors", tensors);
  ASSERT_EQ(::symlink((outside / "secret.safetensors").c_str(),
                      (repository_ / "escape.safetensors").c_str()), 0);
  ASSERT_EQ(::symlink(outside.path().c_str(), (repository_ / "outdir").c_str()), 0);
  ASSERT_EQ(::symlink("models/ok.safetensors", (repository_ / "alias.safetensors").c_str()), 0);
  const std::string absolute = outside / "secret.safetensors";
  using C = absl::StatusCode;
  const struct {
    std::string path;
    C code;
    std::string message_part;
  } cases[] = {
      {absolute, C::kInvalidArgument,
       "spec.safetensors.path = \"" + absolute + "\" is absolute; give a path relative to the model repository"},
      {"../secret.safetensors", C::kInvalidArgument,
       "spec.safetensors.path = \"../secret.safetensors\" contains \"..\""},
      {"models/../../x.safetensors", C::kInvalidArgument, "contains \"..\""},
      {"escape.safetensors", C::kPermissionDenied,
       "spec.safetensors.path = \"escape.safetensors\" resolves outside the model repository"},
      {"outdir/secret.safetensors", C::kPermissionDenied,
       "spec.safetensors.path = \"outdir/secret.safetensors\" resolves outside the model repository"},
      {"models/missing.safetensors", C::kNotFound,
       "spec.safetensors.path = \"models/missing.safetensors\" does not exist in the model repository"},
      {"", C::kInvalidArgument, "spec.safetensors.path is empty"},
      {"models", C::kInvalidArgument, "spec.safetensors.path: models is not a regular file"},
  };
  for (const auto& test_case : cases) {
    SCOPED_TRACE(test_case.path);
    ExpectStatus(LoadFromFile("x", config, test_case.path, v1::WEIGHT_NAMING_NATIVE).status(),
                 test_case.code, test_case.message_part);
  }
  EXPECT_TRUE(LoadFromFile("x", config, "models/ok.safetensors", v1::WEIGHT_NAMING_NATIVE).ok());
  EXPECT_TRUE(LoadFromFile("y", config, "./alias.safetensors", v1::WEIGHT_NAMING_NATIVE).ok())
      << "a symlink that stays inside the repository is fine";
}

TEST_F(RepositoryTest, MalformedFilesAreInvalidArgumentThroughTheApi) {
  core::MhaConfig config;
  config.embed_dim = 8, config.num_heads = 2;
  config = *core::MhaConfig::Resolve(config);
  WriteSafetensors(repository_ / "good.safetensors",
                   ConventionTensors(v1::WEIGHT_NAMING_NATIVE, config, ExactWeights(config, 4), ""));
  std::string good;
  {
    std::ifstream in(repository_ / "good.safetensors", std::ios::binary);
    good.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto with_header = [](const std::string& header, const std::string& data) {
    std::string out(8, '\0');
    const uint64_t length = header.size();
    std::memcpy(out.data(), &length, 8);
    return out + header + data;
  };
  std::string huge = good;
  const uint64_t huge_length = uint64_t{1} << 50;
  std::memcpy(huge.data(), &huge_length, 8);
  const struct {
    std::string name;
    std::string bytes;
    std::string message_part;
  } cases[] = {
      {"truncated", good.substr(0, good.size() - 10), "past the end of the data buffer"},
      {"huge_header", huge, "exceeds the limit of 100000000 bytes"},
      {"bad_json", with_header("{\"q_proj.weight\": {", ""), "header is not valid JSON"},
      {"overlap",
       with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                   R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", std::string(12, '\0')),
       "overlap tensor \"a\""},
      {"hole",
       with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                   R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", std::string(12, '\0')),
       "belong to no tensor"},
      {"wrong_dtype", with_header(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}})", "x"),
       "unknown dtype \"Q4\""},
      {"past_end", with_header(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", "12345678"),
       "past the end of the data buffer (8 bytes)"},
  };
  for (const auto& test_case : cases) {
    SCOPED_TRACE(test_case.name);
    const std::string file = "bad/" + test_case.name + ".safetensors";
    fs::create_directories(repository_ / "bad");
    WriteBytes(repository_ / file, test_case.bytes);
    const absl::Status status =
        LoadFromFile("x", config, file, v1::WEIGHT_NAMING_NATIVE).status();
    ExpectStatus(status, absl::StatusCode::kInvalidArgument, test_case.message_part);
    ExpectStatus(status, absl::StatusCode::kInvalidArgument, "spec.safetensors.path: " + file);
  }
  EXPECT_TRUE(LoadFromFile("x", config, "good.safetensors", v1::WEIGHT_NAMING_NATIVE).ok())
      << "the server still answers";
}

TEST_F(RepositoryTest, PersistedLayersComeBackAfterARestart) {
  core::MhaConfig bert;
  bert.embed_dim = 8, bert.num_heads = 2;
  bert = *core::MhaConfig::Resolve(bert);
  WriteSafetensors(repository_ / "bert.safetensors",
                   ConventionTensors(v1::WEIGHT_NAMING_HF_BERT, bert, ExactWeights(bert, 9), "l.0."),
                   core::DType::kBFloat16);
  core::MhaConfig random;
  random.embed_dim = 12, random.num_heads = 2;
  random = *core::MhaConfig::Resolve(random);

  auto from_file = LoadFromFile("bert", bert, "bert.safetensors", v1::WEIGHT_NAMING_HF_BERT, "l.0.",
                                /*persist=*/true);
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  EXPECT_TRUE(from_file->persisted());
  auto seeded = LoadRandom("seeded", 12, 77, /*persist=*/true);
  ASSERT_TRUE(seeded.ok()) << seeded.status();
  ASSERT_TRUE(LoadRandom("ephemeral", 12, 78).ok());
  EXPECT_TRUE(client_->GetLayer("seeded")->persisted());
  EXPECT_FALSE(client_->GetLayer("ephemeral")->persisted());
  const std::vector<float> bert_before = Run("bert", bert);
  const std::vector<float> seeded_before = Run("seeded", random);
  EXPECT_TRUE(fs::is_regular_file(repository_ / "persisted/bert.safetensors"));
  EXPECT_TRUE(fs::is_regular_file(repository_ / "persisted/seeded.safetensors"));
  EXPECT_FALSE(fs::exists(repository_ / "persisted/ephemeral.safetensors"));
  for (const auto& entry : fs::directory_iterator(repository_ / "persisted")) {
    EXPECT_EQ(entry.path().extension(), ".safetensors") << "temporary file left: " << entry.path();
  }

  Start();  // destroys the first server, starts a new one on the same repository
  EXPECT_TRUE(server_->startup_problems().empty()) << server_->startup_problems()[0];
  auto layers = client_->ListLayers();
  ASSERT_TRUE(layers.ok()) << layers.status();
  ASSERT_EQ(layers->size(), 2u);
  EXPECT_EQ((*layers)[0].name(), "bert");
  EXPECT_EQ((*layers)[1].name(), "seeded");
  EXPECT_TRUE((*layers)[0].persisted());
  EXPECT_EQ((*layers)[0].config().embed_dim(), 8);
  EXPECT_EQ(Run("bert", bert), bert_before);
  EXPECT_EQ(Run("seeded", random), seeded_before);

  // A persisted file is a valid native checkpoint too.
  EXPECT_TRUE(LoadFromFile("copy", bert, "persisted/bert.safetensors", v1::WEIGHT_NAMING_NATIVE).ok());
  EXPECT_EQ(Run("copy", bert), bert_before);

  // Unload deletes the file; reloading without persist deletes the older version's file.
  ASSERT_TRUE(client_->UnloadLayer("bert").ok());
  EXPECT_FALSE(fs::exists(repository_ / "persisted/bert.safetensors"));
  auto replaced = LoadRandom("seeded", 12, 79);
  ASSERT_TRUE(replaced.ok());
  EXPECT_FALSE(replaced->persisted());
  EXPECT_FALSE(fs::exists(repository_ / "persisted/seeded.safetensors"));
  Start();
  auto after = client_->ListLayers();
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->empty()) << (*after)[0].name();
}

// A BFLOAT16 layer persists as bf16 tensors (half the file of float32) and comes back a
// BFLOAT16 layer answering the same bits.
TEST_F(RepositoryTest, ABf16LayerPersistsInBf16AndComesBackTheSame) {
  core::MhaConfig config;
  config.embed_dim = 32, config.num_heads = 4;
  config = *core::MhaConfig::Resolve(config);
  for (const bool bf16 : {false, true}) {
    v1::LoadLayerRequest request = RandomLayerRequest(bf16 ? "half" : "full", 32, 11);
    if (bf16) request.mutable_spec()->mutable_config()->set_compute_dtype(v1::BFLOAT16);
    request.set_persist(true);
    ASSERT_TRUE(client_->LoadLayer(request).ok());
  }
  const std::vector<float> before = Run("half", config);
  const auto half_bytes = fs::file_size(repository_ / "persisted/half.safetensors");
  const auto full_bytes = fs::file_size(repository_ / "persisted/full.safetensors");
  EXPECT_LT(half_bytes, 0.6 * full_bytes) << half_bytes << " vs " << full_bytes;
  Start();
  auto reloaded = client_->GetLayer("half");
  ASSERT_TRUE(reloaded.ok()) << reloaded.status();
  EXPECT_EQ(reloaded->dtype(), v1::BFLOAT16);
  EXPECT_EQ(Run("half", config), before);
}

TEST_F(RepositoryTest, ALayersBatchingPolicyIsPersistedAndTheRestFollowsTheFlags) {
  v1::LoadLayerRequest request = RandomLayerRequest("tuned", 8, 4);
  request.set_persist(true);
  request.mutable_batching()->set_max_batch_requests(3);
  request.mutable_batching()->set_max_queue_delay_us(0);
  ASSERT_TRUE(client_->LoadLayer(request).ok());

  // Restarted with other flags: the layer keeps what it set and takes the new flags for
  // the rest.
  ServerOptions options = Options();
  options.batcher.limits.max_batch_requests = 50;
  options.batcher.limits.max_batch_tokens = 500;
  options.batcher.limits.max_queue_delay = absl::Milliseconds(7);
  Start(options);
  EXPECT_TRUE(server_->startup_problems().empty()) << server_->startup_problems()[0];
  auto layer = client_->GetLayer("tuned");
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_EQ(layer->batching().max_batch_requests(), 3);
  EXPECT_EQ(layer->batching().max_queue_delay_us(), 0);
  EXPECT_EQ(layer->batching().max_batch_tokens(), 500);
  EXPECT_EQ(layer->batching().max_queue_requests(), options.batcher.limits.max_queue_requests);
}

TEST_F(RepositoryTest, APersistedLayerGoesBackToTheDeviceItWasLoadedWith) {
  v1::LoadLayerRequest pinned = RandomLayerRequest("pinned", 8, 1);
  pinned.set_persist(true);
  pinned.set_device("cpu");
  ASSERT_TRUE(client_->LoadLayer(pinned).ok());
  ASSERT_TRUE(LoadRandom("follows", 8, 2, /*persist=*/true).ok());
  // A layer persisted on a GPU this machine does not have (a node that lost one).
  core::MhaConfig config;
  config.embed_dim = 8, config.num_heads = 2;
  config = *core::MhaConfig::Resolve(config);
  core::Devices devices(1);
  auto repository = ModelRepository::Open(repository_.path());
  ASSERT_TRUE(repository.ok()) << repository.status();
  const auto gpu_layer =
      *core::MhaLayer::Create(config, core::MhaWeights::Random(config, 3), devices.cpu());
  ASSERT_TRUE((*repository)->Persist("moved", *gpu_layer, {}, "cuda:7").ok());
  auto device_in_file = [&](const std::string& name) {
    auto file = (*repository)->OpenSafetensors(PersistedPath(name), "test");
    EXPECT_TRUE(file.ok()) << file.status();
    const auto& metadata = (*file)->metadata();
    auto found = metadata.find(kDeviceKey);
    return found == metadata.end() ? std::string("(none)") : found->second;
  };
  EXPECT_EQ(device_in_file("pinned"), "cpu");
  EXPECT_EQ(device_in_file("follows"), "(none)") << "no device named: follows --device";

  ServerOptions options = Options();
  options.device = "auto";  // a GPU where there is one: only "follows" and "moved" go there
  Start(options);
  const std::string default_device = (*devices.Get("auto"))->name();
  EXPECT_EQ(client_->GetLayer("pinned")->device(), "cpu");
  EXPECT_EQ(client_->GetLayer("follows")->device(), default_device);
  EXPECT_EQ(client_->GetLayer("moved")->device(), default_device);
  EXPECT_EQ(Run("moved", config).size(), 2u * 3 * 8) << "it serves where it was placed";
  const std::vector<std::string>& problems = server_->startup_problems();
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(problems[0], "persisted/moved.safetensors: loaded with device "
                                            "\"cuda:7\", which cannot be used: "))
      << problems[0];
  EXPECT_TRUE(absl::EndsWith(problems[0], absl::StrCat("; placed on ", default_device,
                                                       " (the server's --device) instead; "
                                                       "the file is kept")))
      << problems[0];
  EXPECT_EQ(device_in_file("moved"), "cuda:7") << "kept, to go back once the GPU is";
}

TEST_F(RepositoryTest, CorruptPersistedFilesAreSkippedAtStartUp) {
  ASSERT_TRUE(LoadRandom("good", 8, 1, /*persist=*/true).ok());
  ASSERT_TRUE(LoadRandom("torn", 8, 2, /*persist=*/true).ok());
  ASSERT_TRUE(LoadRandom("empty", 8, 3, /*persist=*/true).ok());
  core::MhaConfig config;
  config.embed_dim = 8, config.num_heads = 2;
  config = *core::MhaConfig::Resolve(config);
  const std::vector<float> good_before = Run("good", config);
  server_.reset();  // as a crash would, but with the files below damaged

  const std::string torn = repository_ / "persisted/torn.safetensors";
  fs::resize_file(torn, fs::file_size(torn) - 7);  // half-written
  fs::resize_file(repository_ / "persisted/empty.safetensors", 0);
  WriteBytes(repository_ / "persisted/.good.safetensors.tmp.123.0", "partial");  // killed mid-write
  WriteBytes(repository_ / "persisted/README", "not a layer");
  WriteSafetensors(repository_ / "persisted/foreign.safetensors",
                   ConventionTensors(v1::WEIGHT_NAMING_NATIVE, config, ExactWeights(config, 1), ""));

  Start();
  auto serving = client_->IsServing();
  ASSERT_TRUE(serving.ok() && *serving);
  auto layers = client_->ListLayers();
  ASSERT_TRUE(layers.ok());
  ASSERT_EQ(layers->size(), 1u);
  EXPECT_EQ((*layers)[0].name(), "good");
  EXPECT_EQ(Run("good", config), good_before);

  const std::vector<std::string>& problems = server_->startup_problems();
  ASSERT_EQ(problems.size(), 5u);
  auto mentions = [&](const std::string& part) {
    return std::any_of(problems.begin(), problems.end(), [&](const std::string& problem) {
      return problem.find(part) != std::string::npos;
    });
  };
  EXPECT_TRUE(mentions("persisted/torn.safetensors: tensor")) << problems[4];
  EXPECT_TRUE(mentions("past the end of the data buffer")) << problems[4];
  EXPECT_TRUE(mentions("persisted/empty.safetensors has 0 bytes"));
  EXPECT_TRUE(mentions("persisted/.good.safetensors.tmp.123.0: temporary file of an interrupted write; removed"));
  EXPECT_TRUE(mentions("persisted/README: not a .safetensors file; ignored"));
  EXPECT_TRUE(mentions("persisted/foreign.safetensors has no __metadata__[\"attention_service.layer_config\"]"));
  EXPECT_FALSE(fs::exists(repository_ / "persisted/.good.safetensors.tmp.123.0"));
  EXPECT_TRUE(fs::exists(torn)) << "a damaged file is reported, not deleted";
  // Persisting the same name again replaces the damaged file.
  ASSERT_TRUE(LoadRandom("torn", 8, 2, /*persist=*/true).ok());
  Start();
  EXPECT_EQ(client_->ListLayers()->size(), 2u);
}

TEST_F(RepositoryTest, OddNamesSurviveRestartsAndAPersistedDemoNameWins) {
  // Names that look like temporary files or dot files are still layers.
  for (const std::string name : {".x.safetensors.tmp.1.2", "..", "a.safetensors"}) {
    auto loaded = LoadRandom(name, 8, 1, /*persist=*/true);
    ASSERT_TRUE(loaded.ok()) << name << ": " << loaded.status();
  }
  ASSERT_TRUE(LoadRandom(kDemoLayerName, 8, 2, /*persist=*/true).ok());
  ServerOptions options = Options();
  options.demo_layer = true;
  Start(options);
  EXPECT_TRUE(server_->startup_problems().empty()) << server_->startup_problems()[0];
  auto layers = client_->ListLayers();
  ASSERT_TRUE(layers.ok());
  ASSERT_EQ(layers->size(), 4u);
  auto demo = client_->GetLayer(kDemoLayerName);
  ASSERT_TRUE(demo.ok());
  EXPECT_EQ(demo->config().embed_dim(), 8) << "the persisted layer, not the built-in demo";
  EXPECT_TRUE(demo->persisted());
}

TEST_F(RepositoryTest, InlineLayersCanNameARepositoryFile) {
  core::MhaConfig config;
  config.embed_dim = 8, config.num_heads = 2;
  config = *core::MhaConfig::Resolve(config);
  WriteSafetensors(repository_ / "m.safetensors",
                   ConventionTensors(v1::WEIGHT_NAMING_TORCH_MHA, config, ExactWeights(config, 6), ""));
  ASSERT_TRUE(LoadFromFile("loaded", config, "m.safetensors", v1::WEIGHT_NAMING_TORCH_MHA).ok());
  std::mt19937_64 rng(5);
  v1::MultiHeadAttentionRequest request;
  *request.mutable_inline_layer()->mutable_config() = ToProto(config);
  request.mutable_inline_layer()->mutable_safetensors()->set_path("m.safetensors");
  request.mutable_inline_layer()->mutable_safetensors()->set_naming(v1::WEIGHT_NAMING_TORCH_MHA);
  EncodeTensor(RandomValues(rng, 2 * 3 * 8), std::vector<int64_t>{2, 3, 8}, core::DType::kFloat32,
               request.mutable_query());
  auto response = client_->MultiHeadAttention(request);
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_EQ(DecodeFloatTensor(response->output(), "output")->values, Run("loaded", config));
  request.mutable_inline_layer()->mutable_safetensors()->set_path("../m.safetensors");
  ExpectStatus(client_->MultiHeadAttention(request).status(), absl::StatusCode::kInvalidArgument,
               "inline_layer.safetensors.path = \"../m.safetensors\" contains \"..\"");
}

TEST_F(RepositoryTest, WeightBudgetRefusesLoadsPastIt) {
  // E = 8, H = 2 with biases: 4 * 64 + 4 * 8 = 288 parameters = 1152 bytes, plus the CPU
  // backend's packed copy of them in host memory.
  constexpr int64_t kLayerBytes = 1152;
  core::MhaConfig config;
  config.embed_dim = 8;
  config.num_heads = 2;
  const core::MhaConfig resolved = *core::MhaConfig::Resolve(config);
  core::Devices devices(1);
  const int64_t host_bytes =
      (*core::MhaLayer::Create(resolved, core::MhaWeights::Random(resolved, 1), devices.cpu()))
          ->HostBytes();
  ASSERT_GT(host_bytes, kLayerBytes);
  ServerOptions options = Options();
  options.device = "cpu";  // host_bytes above is a CPU layer's, with its packed copy
  options.registry.max_weight_bytes = 2 * host_bytes + 100;
  Start(options);
  auto first = LoadRandom("a", 8, 1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->weight_bytes(), kLayerBytes);
  ASSERT_TRUE(LoadRandom("b", 8, 2).ok());
  ExpectStatus(LoadRandom("c", 8, 3).status(), absl::StatusCode::kResourceExhausted,
               // Refused on the estimate, before the weights are built.
               absl::StrCat("layer \"c\" needs ",
                            LayerRegistry::EstimatedHostBytes(kLayerBytes, "cpu"),
                            " bytes of host memory for its weights (with the CPU's packed copy) "
                            "but only 100 of max_weight_bytes = ", 2 * host_bytes + 100,
                            " are free (", 2 * host_bytes, " in use by 2 other layer(s))"));
  ExpectStatus(LoadRandom("c", 8, 3, /*persist=*/true).status(),
               absl::StatusCode::kResourceExhausted,
               absl::StrCat("max_weight_bytes = ", 2 * host_bytes + 100));
  EXPECT_FALSE(fs::exists(repository_ / "persisted/c.safetensors")) << "nothing written";
  EXPECT_EQ(client_->GetLayer("c").status().code(), absl::StatusCode::kNotFound);
  // Replacing a layer counts only the new version.
  EXPECT_TRUE(LoadRandom("b", 8, 4).ok());
  ASSERT_TRUE(client_->UnloadLayer("a").ok());
  EXPECT_TRUE(LoadRandom("c", 8, 3, /*persist=*/true).ok());
  EXPECT_EQ(server_->registry().weight_bytes(), 2 * kLayerBytes);

  // At start-up, persisted layers past the budget are skipped (and their files kept).
  ASSERT_TRUE(LoadRandom("b", 8, 4, /*persist=*/true).ok());
  options.registry.max_weight_bytes = host_bytes;
  Start(options);
  EXPECT_EQ(client_->ListLayers()->size(), 1u);
  ASSERT_EQ(server_->startup_problems().size(), 1u);
  EXPECT_NE(server_->startup_problems()[0].find(
                absl::StrCat("persisted/c.safetensors: layer \"c\" needs ", host_bytes)),
            std::string::npos)
      << server_->startup_problems()[0];
  EXPECT_TRUE(fs::exists(repository_ / "persisted/c.safetensors"));
}

TEST_F(RepositoryTest, OptionsAreValidatedAtStart) {
  ServerOptions options = Options();
  options.registry.max_weight_bytes = -1;
  ExpectStatus(AttentionServer::Start(options).status(), absl::StatusCode::kInvalidArgument,
               "max_weight_bytes = -1 must be >= 0");
  options = Options();
  options.registry.model_repository = repository_ / "nope";
  ExpectStatus(AttentionServer::Start(options).status(), absl::StatusCode::kInvalidArgument,
               "model_repository = \"" + (repository_ / "nope") + "\" does not exist");
  WriteBytes(repository_ / "file", "x");
  options.registry.model_repository = repository_ / "file";
  ExpectStatus(AttentionServer::Start(options).status(), absl::StatusCode::kInvalidArgument,
               "is not a directory");
}

TEST_F(RepositoryTest, LoadReloadAndUnloadUnderTraffic) {
  // Callers hammer one layer while it is reloaded (with and without persist) and unloaded:
  // every answer is either a success from some version or NOT_FOUND while it is unloaded.
  core::MhaConfig config;
  config.embed_dim = 8, config.num_heads = 2;
  config = *core::MhaConfig::Resolve(config);
  ASSERT_TRUE(LoadRandom("hot", 8, 0).ok());
  std::atomic<bool> done{false};
  std::atomic<int> ok{0}, not_found{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 3; ++t) {
    callers.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      for (int r = 0; r < 400 && !done.load(); ++r) {
        v1::MultiHeadAttentionRequest request;
        request.set_layer("hot");
        EncodeTensor(RandomValues(rng, 2 * 8), std::vector<int64_t>{1, 2, 8},
                     core::DType::kFloat32, request.mutable_query());
        const auto response = client_->MultiHeadAttention(request);
        if (response.ok()) {
          ++ok;
        } else {
          EXPECT_EQ(response.status().code(), absl::StatusCode::kNotFound) << response.status();
          ++not_found;
        }
      }
    });
  }
  uint64_t last_version = 0;
  for (int round = 0; round < 30; ++round) {
    auto loaded = LoadRandom("hot", 8, round, /*persist=*/round % 2 == 0);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_GT(loaded->version(), last_version);
    last_version = loaded->version();
    if (round % 5 == 4) {
      ASSERT_TRUE(client_->UnloadLayer("hot").ok());
    }
  }
  ASSERT_TRUE(LoadRandom("hot", 8, 99).ok());
  done = true;
  for (std::thread& caller : callers) caller.join();
  EXPECT_GT(ok.load(), 0);
  // The final version answers, and it was not persisted, so no file is left behind.
  EXPECT_FALSE(Run("hot", config).empty());
  EXPECT_FALSE(fs::exists(repository_ / "persisted/hot.safetensors"));
}


// ---- Hugging Face checkpoint directories -----------------------------------------------------

// Writes a save_pretrained-style directory: config.json and the tensors, in one
// model.safetensors or split over `shards` files with model.safetensors.index.json.
void WriteHfCheckpoint(const std::string& dir, const std::string& config_json,
                       const std::vector<NamedTensor>& tensors, int shards = 1) {
  fs::create_directories(dir);
  WriteBytes(dir + "/config.json", config_json);
  if (shards == 1) {
    WriteSafetensors(dir + "/model.safetensors", tensors);
    return;
  }
  std::string weight_map;
  for (int shard = 0; shard < shards; ++shard) {
    const std::string name = "model-0000" + std::to_string(shard + 1) + "-of-0000" +
                             std::to_string(shards) + ".safetensors";
    std::vector<NamedTensor> part;
    for (size_t i = shard; i < tensors.size(); i += shards) {
      part.push_back(tensors[i]);
      weight_map += (weight_map.empty() ? "" : ", ") + ("\"" + tensors[i].name + "\": \"" + name + "\"");
    }
    WriteSafetensors(absl::StrCat(dir, "/", name), part);
  }
  WriteBytes(dir + "/model.safetensors.index.json",
             "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {" + weight_map + "}}");
}

constexpr char kBertConfig[] = R"({"architectures": ["BertModel"], "model_type": "bert",
  "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 2})";
// head_dim 8 != hidden_size / heads = 4, GQA.
constexpr char kLlamaConfig[] = R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
  "num_hidden_layers": 2, "rope_theta": 5000.0, "attention_bias": false})";

core::MhaConfig BertLayerConfig() {
  core::MhaConfig config;
  config.embed_dim = 8, config.num_heads = 2;
  return *core::MhaConfig::Resolve(config);
}

core::MhaConfig LlamaLayerConfig() {
  core::MhaConfig config;
  config.embed_dim = 16, config.num_heads = 4, config.num_kv_heads = 2, config.head_dim = 8;
  config.qkv_bias = false, config.output_bias = false, config.rope_theta = 5000.0;
  config.always_causal = true;
  return *core::MhaConfig::Resolve(config);
}

// Two layers of `naming` under `wrapper`, each with its own weights (seed + layer).
std::vector<NamedTensor> TwoLayers(v1::WeightNaming naming, const core::MhaConfig& config,
                                   const std::string& wrapper, uint64_t seed) {
  std::vector<NamedTensor> tensors = {{wrapper + "embeddings.weight", {3, config.embed_dim},
                                       std::vector<float>(3 * config.embed_dim, 0.25f)}};
  const std::string block = naming == v1::WEIGHT_NAMING_HF_BERT ? "encoder.layer." : "layers.";
  for (int layer = 0; layer < 2; ++layer) {
    for (NamedTensor& t : ConventionTensors(naming, config, ExactWeights(config, seed + layer),
                                            wrapper + block + std::to_string(layer) + ".")) {
      tensors.push_back(std::move(t));
    }
  }
  return tensors;
}

class HfCheckpointTest : public RepositoryTest {
 protected:
  absl::StatusOr<v1::LayerInfo> LoadHf(const std::string& name, const std::string& path,
                                       int64_t layer_index, const v1::LayerConfig& config = {}) {
    v1::LoadLayerRequest request;
    request.set_name(name);
    *request.mutable_spec()->mutable_config() = config;
    request.mutable_spec()->mutable_hf_checkpoint()->set_path(path);
    request.mutable_spec()->mutable_hf_checkpoint()->set_layer_index(layer_index);
    return client_->LoadLayer(request);
  }
};

TEST_F(HfCheckpointTest, DirectoriesLoadByLayerIndexWithTheirOwnConfig) {
  const core::MhaConfig bert = BertLayerConfig();
  const core::MhaConfig llama = LlamaLayerConfig();
  // A plain BertModel export (no "bert." wrapper) and a sharded LlamaForCausalLM ("model.").
  const std::vector<NamedTensor> bert_tensors = TwoLayers(v1::WEIGHT_NAMING_HF_BERT, bert, "", 10);
  const std::vector<NamedTensor> llama_tensors =
      TwoLayers(v1::WEIGHT_NAMING_HF_LLAMA, llama, "model.", 20);
  WriteHfCheckpoint(repository_ / "hf/bert", kBertConfig, bert_tensors);
  WriteHfCheckpoint(repository_ / "hf/llama", kLlamaConfig, llama_tensors, /*shards=*/3);
  WriteSafetensors(repository_ / "bert.safetensors", bert_tensors);
  WriteSafetensors(repository_ / "llama.safetensors", llama_tensors);

  auto info = LoadHf("bert1", "hf/bert/", 1);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->config().embed_dim(), 8);
  EXPECT_EQ(info->config().num_heads(), 2);
  EXPECT_FALSE(info->config().no_qkv_bias());
  EXPECT_FALSE(info->config().always_causal());
  ASSERT_TRUE(LoadFromFile("bert1-file", bert, "bert.safetensors", v1::WEIGHT_NAMING_HF_BERT,
                           "encoder.layer.1.")
                  .ok());
  ASSERT_TRUE(LoadFromFile("bert0-file", bert, "bert.safetensors", v1::WEIGHT_NAMING_HF_BERT,
                           "encoder.layer.0.")
                  .ok());
  const std::vector<float> bert_output = Run("bert1", bert);
  ASSERT_FALSE(bert_output.empty());
  EXPECT_EQ(bert_output, Run("bert1-file", bert));
  EXPECT_NE(bert_output, Run("bert0-file", bert)) << "layer 1, not layer 0";

  // A config sent alongside that agrees is fine.
  v1::LayerConfig agreeing;
  agreeing.set_num_heads(4);
  agreeing.set_head_dim(8);
  agreeing.set_no_qkv_bias(true);
  info = LoadHf("llama0", "hf/llama", 0, agreeing);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->config().num_kv_heads(), 2);
  EXPECT_EQ(info->config().head_dim(), 8);
  EXPECT_EQ(info->config().rope_theta(), 5000.0);
  EXPECT_TRUE(info->config().always_causal());
  EXPECT_TRUE(info->config().no_output_bias());
  v1::LoadLayerRequest file_load;
  file_load.set_name("llama0-file");
  *file_load.mutable_spec()->mutable_config() = ConfigToProto(llama);
  file_load.mutable_spec()->mutable_safetensors()->set_path("llama.safetensors");
  file_load.mutable_spec()->mutable_safetensors()->set_naming(v1::WEIGHT_NAMING_HF_LLAMA);
  file_load.mutable_spec()->mutable_safetensors()->set_prefix("model.layers.0.");
  ASSERT_TRUE(client_->LoadLayer(file_load).ok());
  const std::vector<float> llama_output = Run("llama0", llama);
  ASSERT_FALSE(llama_output.empty());
  EXPECT_EQ(llama_output, Run("llama0-file", llama));
}

TEST_F(HfCheckpointTest, RefusalsNameTheFieldTheFileAndTheValues) {
  const core::MhaConfig bert = BertLayerConfig();
  const std::vector<NamedTensor> tensors = TwoLayers(v1::WEIGHT_NAMING_HF_BERT, bert, "bert.", 1);
  WriteHfCheckpoint(repository_ / "m", kBertConfig, tensors);
  WriteHfCheckpoint(repository_ / "sharded", kBertConfig, tensors, 2);
  using C = absl::StatusCode;
  v1::LayerConfig six_heads;  // the issue's wrong head count
  six_heads.set_num_heads(1);
  ExpectStatus(LoadHf("x", "m", 0, six_heads).status(), C::kInvalidArgument,
               "spec.config.num_heads = 1 disagrees with \"m/config.json\", which gives 2 "
               "(num_attention_heads)");
  ExpectStatus(LoadHf("x", "m", 2).status(), C::kInvalidArgument,
               "spec.hf_checkpoint.layer_index = 2 is outside [0, 2)");
  ExpectStatus(LoadHf("x", "m/model.safetensors", 0).status(), C::kInvalidArgument,
               "spec.hf_checkpoint.path = \"m/model.safetensors\" is a file; hf_checkpoint reads "
               "a checkpoint directory");
  ExpectStatus(LoadHf("x", "../m", 0).status(), C::kInvalidArgument,
               "spec.hf_checkpoint.path = \"../m\" contains \"..\"");
  ExpectStatus(LoadHf("x", "absent", 0).status(), C::kNotFound,
               "spec.hf_checkpoint.path = \"absent\" does not exist in the model repository");
  TempDir outside;
  WriteHfCheckpoint(outside / "m", kBertConfig, tensors);
  ASSERT_EQ(::symlink((outside / "m").c_str(), (repository_ / "escape").c_str()), 0);
  ExpectStatus(LoadHf("x", "escape", 0).status(), C::kPermissionDenied,
               "resolves outside the model repository");
  // A directory with a config but no safetensors, and one with weights but no config.
  fs::create_directories(repository_ / "bin-only");
  WriteBytes(repository_ / "bin-only/config.json", kBertConfig);
  WriteBytes(repository_ / "bin-only/pytorch_model.bin", "x");
  ExpectStatus(LoadHf("x", "bin-only", 0).status(), C::kNotFound,
               "holds neither model.safetensors nor model.safetensors.index.json");
  fs::create_directories(repository_ / "no-config");
  WriteSafetensors(repository_ / "no-config/model.safetensors", tensors);
  ExpectStatus(LoadHf("x", "no-config", 0).status(), C::kNotFound,
               "spec.hf_checkpoint.path = \"no-config\" has no config.json");
  // Unsupported models, by name.
  fs::create_directories(repository_ / "gpt2");
  WriteBytes(repository_ / "gpt2/config.json", R"({"model_type": "gpt2", "n_layer": 2})");
  WriteSafetensors(repository_ / "gpt2/model.safetensors", tensors);
  ExpectStatus(LoadHf("x", "gpt2", 0).status(), C::kInvalidArgument,
               "spec.hf_checkpoint: \"gpt2/config.json\": model_type \"gpt2\" is not supported");
  // Broken indexes: a tensor its shard lacks, a shard outside the directory, a tensor twice.
  const std::string index = repository_ / "sharded/model.safetensors.index.json";
  WriteBytes(index, R"({"weight_map": {"nope": "model-00001-of-00002.safetensors"}})");
  ExpectStatus(LoadHf("x", "sharded", 0).status(), C::kInvalidArgument,
               "\"sharded/model.safetensors.index.json\" puts tensor \"nope\" in "
               "\"model-00001-of-00002.safetensors\", which does not hold it");
  WriteBytes(index, R"({"weight_map": {"a": "../m/model.safetensors"}})");
  ExpectStatus(LoadHf("x", "sharded", 0).status(), C::kInvalidArgument, "contains \"..\"");
  WriteBytes(index, R"({"weight_map": [1]})");
  ExpectStatus(LoadHf("x", "sharded", 0).status(), C::kInvalidArgument,
               "is not a JSON object with a \"weight_map\" object");
  WriteSafetensors(repository_ / "sharded/copy.safetensors", tensors);
  WriteBytes(index, R"({"weight_map": {"bert.embeddings.weight": "model-00001-of-00002.safetensors",
    "bert.encoder.layer.0.attention.self.query.weight": "copy.safetensors"}})");
  ExpectStatus(LoadHf("x", "sharded", 0).status(), C::kInvalidArgument,
               "spec.hf_checkpoint: tensor \"bert.embeddings.weight\" is in both");
  // Without a repository there is nothing to read.
  ServerOptions options = Options();
  options.registry.model_repository = "";
  Start(options);
  ExpectStatus(LoadHf("x", "m", 0).status(), C::kFailedPrecondition,
               "spec.hf_checkpoint: the server has no model repository");
  EXPECT_EQ(client_->ListLayers()->size(), 0u);
}

TEST_F(HfCheckpointTest, AMissingTensorSuggestsTheNearestPrefix) {
  const core::MhaConfig bert = BertLayerConfig();
  WriteSafetensors(repository_ / "plain.safetensors",
                   TwoLayers(v1::WEIGHT_NAMING_HF_BERT, bert, "", 1));
  using C = absl::StatusCode;
  // The old proto example's prefix on a plain BertModel export.
  ExpectStatus(LoadFromFile("x", bert, "plain.safetensors", v1::WEIGHT_NAMING_HF_BERT,
                            "bert.encoder.layer.1.")
                   .status(),
               C::kInvalidArgument,
               "is missing; WEIGHT_NAMING_HF_BERT expects shape [8, 8] (nearest prefix with a "
               "WEIGHT_NAMING_HF_BERT layer: \"encoder.layer.1.\"; InspectCheckpoint lists them "
               "all)");
  // A missing trailing dot.
  ExpectStatus(LoadFromFile("x", bert, "plain.safetensors", v1::WEIGHT_NAMING_HF_BERT,
                            "encoder.layer.0")
                   .status(),
               C::kInvalidArgument, "layer: \"encoder.layer.0.\"");
  // The wrong naming for the file.
  ExpectStatus(LoadFromFile("x", bert, "plain.safetensors", v1::WEIGHT_NAMING_HF_LLAMA,
                            "encoder.layer.0.")
                   .status(),
               C::kInvalidArgument,
               "(no WEIGHT_NAMING_HF_LLAMA layer in the source; it has WEIGHT_NAMING_HF_BERT "
               "layers, e.g. prefix \"encoder.layer.0.\")");
}

TEST_F(HfCheckpointTest, TensorsTheConfigWouldIgnoreAreRefusedByName) {
  // A Qwen2 layer: q/k/v biases, no o_proj bias.
  core::MhaConfig qwen = LlamaLayerConfig();
  qwen.qkv_bias = true;
  const core::MhaWeights weights = ExactWeights(qwen, 4);
  std::vector<NamedTensor> tensors =
      ConventionTensors(v1::WEIGHT_NAMING_HF_LLAMA, qwen, weights, "model.layers.0.");
  tensors.push_back({"model.layers.0.self_attn.q_proj.bias", {qwen.QWidth()}, weights.q_bias});
  tensors.push_back({"model.layers.0.self_attn.k_proj.bias", {qwen.KWidth()}, weights.k_bias});
  tensors.push_back({"model.layers.0.self_attn.v_proj.bias", {qwen.VWidth()}, weights.v_bias});
  WriteSafetensors(repository_ / "qwen.safetensors", tensors);
  ExpectStatus(LoadFromFile("x", LlamaLayerConfig(), "qwen.safetensors",
                            v1::WEIGHT_NAMING_HF_LLAMA, "model.layers.0.")
                   .status(),
               absl::StatusCode::kInvalidArgument,
               "spec.safetensors: tensor \"model.layers.0.self_attn.q_proj.bias\" in "
               "\"qwen.safetensors\": the layer holds tensors that this config would ignore: "
               "\"model.layers.0.self_attn.q_proj.bias\", \"model.layers.0.self_attn.k_proj.bias\", "
               "\"model.layers.0.self_attn.v_proj.bias\"");
  auto loaded = LoadFromFile("qwen", qwen, "qwen.safetensors", v1::WEIGHT_NAMING_HF_LLAMA,
                             "model.layers.0.");
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  // An output bias under no_output_bias, too.
  core::MhaConfig bert = BertLayerConfig();
  WriteSafetensors(repository_ / "bert.safetensors",
                   ConventionTensors(v1::WEIGHT_NAMING_HF_BERT, bert, ExactWeights(bert, 2), ""));
  bert.output_bias = false;
  ExpectStatus(LoadFromFile("x", bert, "bert.safetensors", v1::WEIGHT_NAMING_HF_BERT).status(),
               absl::StatusCode::kInvalidArgument,
               "would ignore: \"attention.output.dense.bias\" (check config.no_qkv_bias");
}

TEST_F(HfCheckpointTest, InspectListsTensorsLayersAndTheConfig) {
  const core::MhaConfig llama = LlamaLayerConfig();
  const std::vector<NamedTensor> tensors =
      TwoLayers(v1::WEIGHT_NAMING_HF_LLAMA, llama, "model.", 3);
  WriteHfCheckpoint(repository_ / "llama", kLlamaConfig, tensors, 2);
  v1::InspectCheckpointRequest request;
  request.set_path("llama");
  auto listed = client_->InspectCheckpoint(request);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->total_tensors(), static_cast<int64_t>(tensors.size()));
  ASSERT_EQ(listed->tensors_size(), listed->total_tensors());
  EXPECT_FALSE(listed->truncated());
  for (int i = 1; i < listed->tensors_size(); ++i) {
    EXPECT_LT(listed->tensors(i - 1).name(), listed->tensors(i).name());
  }
  const v1::TensorInfo& q = listed->tensors(2);  // after embeddings and input_layernorm
  EXPECT_EQ(q.name(), "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(std::vector<int64_t>(q.shape().begin(), q.shape().end()),
            (std::vector<int64_t>{16, 16}));  // Hkv * dk = 2 * 8 rows
  EXPECT_EQ(q.dtype(), "F32");
  EXPECT_TRUE(absl::StartsWith(q.file(), "model-0000")) << q.file();
  ASSERT_EQ(listed->layers_size(), 1);
  EXPECT_EQ(listed->layers(0).naming(), v1::WEIGHT_NAMING_HF_LLAMA);
  EXPECT_EQ(std::vector<std::string>(listed->layers(0).prefixes().begin(),
                                     listed->layers(0).prefixes().end()),
            (std::vector<std::string>{"model.layers.0.", "model.layers.1."}));
  EXPECT_EQ(listed->model_type(), "llama");
  EXPECT_EQ(listed->num_layers(), 2);
  EXPECT_EQ(listed->layer_config().head_dim(), 8);
  EXPECT_TRUE(listed->config_problem().empty());
  // Paging.
  request.set_offset(2);
  request.set_max_tensors(3);
  listed = client_->InspectCheckpoint(request);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->tensors_size(), 3);
  EXPECT_EQ(listed->tensors(0).name(), "model.layers.0.self_attn.k_proj.weight");
  EXPECT_TRUE(listed->truncated());
  // A single file, BERT-named under "bert.", with an unsupported config next to it.
  const core::MhaConfig bert = BertLayerConfig();
  WriteSafetensors(repository_ / "b.safetensors", TwoLayers(v1::WEIGHT_NAMING_HF_BERT, bert, "bert.", 1));
  request = {};
  request.set_path("b.safetensors");
  listed = client_->InspectCheckpoint(request);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->layers_size(), 1);
  EXPECT_EQ(listed->layers(0).naming(), v1::WEIGHT_NAMING_HF_BERT);
  EXPECT_EQ(listed->layers(0).prefixes(1), "bert.encoder.layer.1.");
  EXPECT_EQ(listed->tensors(0).file(), "");
  fs::create_directories(repository_ / "odd");
  WriteBytes(repository_ / "odd/config.json", R"({"model_type": "t5"})");
  WriteSafetensors(repository_ / "odd/model.safetensors", TwoLayers(v1::WEIGHT_NAMING_HF_BERT, bert, "", 1));
  request.set_path("odd");
  listed = client_->InspectCheckpoint(request);
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_NE(listed->config_problem().find("model_type \"t5\" is not supported"),
            std::string::npos)
      << listed->config_problem();
  // Refusals.
  using C = absl::StatusCode;
  request.set_offset(-1);
  ExpectStatus(client_->InspectCheckpoint(request).status(), C::kInvalidArgument,
               "offset = -1 must be >= 0");
  request.set_offset(0);
  request.set_max_tensors(10001);
  ExpectStatus(client_->InspectCheckpoint(request).status(), C::kInvalidArgument,
               "max_tensors = 10001 must be in [0, 10000]");
  request.set_max_tensors(0);
  request.set_path("../x");
  ExpectStatus(client_->InspectCheckpoint(request).status(), C::kInvalidArgument,
               "path = \"../x\" contains \"..\"");
  request.set_path("missing.safetensors");
  ExpectStatus(client_->InspectCheckpoint(request).status(), C::kNotFound,
               "path = \"missing.safetensors\" does not exist");
  ServerOptions options = Options();
  options.registry.model_repository = "";
  Start(options);
  request.set_path("llama");
  ExpectStatus(client_->InspectCheckpoint(request).status(), C::kFailedPrecondition,
               "InspectCheckpoint reads the model repository");
}

TEST_F(HfCheckpointTest, RopeScalingAndWindowsAreValidatedThroughTheApi) {
  v1::LoadLayerRequest request = RandomLayerRequest("scaled", 16, 3);
  v1::LayerConfig& config = *request.mutable_spec()->mutable_config();
  config.set_rope_theta(10000.0);
  config.mutable_rope_scaling()->set_rope_type("yarn");
  config.mutable_rope_scaling()->set_factor(4.0);
  ExpectStatus(client_->LoadLayer(request).status(), absl::StatusCode::kInvalidArgument,
               "spec.config.rope_scaling.rope_type = \"yarn\" is not implemented (linear, "
               "dynamic, llama3); refused rather than approximated");
  config.mutable_rope_scaling()->set_rope_type("llama3");
  ExpectStatus(client_->LoadLayer(request).status(), absl::StatusCode::kInvalidArgument,
               "spec.config.rope_scaling.original_max_position_embeddings = 0 must be >= 1");
  config.mutable_rope_scaling()->set_original_max_position_embeddings(32);
  config.mutable_rope_scaling()->set_low_freq_factor(1.0);
  config.mutable_rope_scaling()->set_high_freq_factor(4.0);
  config.set_sliding_window(4);
  ExpectStatus(client_->LoadLayer(request).status(), absl::StatusCode::kInvalidArgument,
               "spec.config.sliding_window = 4 needs config.always_causal");
  config.set_always_causal(true);
  auto loaded = client_->LoadLayer(request);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->config().rope_scaling().rope_type(), "llama3");
  EXPECT_EQ(loaded->config().rope_scaling().original_max_position_embeddings(), 32);
  EXPECT_EQ(loaded->config().sliding_window(), 4);
}

TEST_F(HfCheckpointTest, ComputeDtypeIsValidatedThroughTheApi) {
  v1::LoadLayerRequest request = RandomLayerRequest("precise", 16, 3);
  v1::LayerConfig& config = *request.mutable_spec()->mutable_config();
  for (v1::DataType refused : {v1::FLOAT16, v1::BOOL}) {
    config.set_compute_dtype(refused);
    ExpectStatus(client_->LoadLayer(request).status(), absl::StatusCode::kInvalidArgument,
                 "spec.config.compute_dtype = " + v1::DataType_Name(refused) +
                     " is not a compute precision; expected FLOAT32 or BFLOAT16");
  }
  config.set_compute_dtype(static_cast<v1::DataType>(99));
  ExpectStatus(client_->LoadLayer(request).status(), absl::StatusCode::kInvalidArgument,
               "spec.config.compute_dtype = 99 is not a known DataType");
  config.set_compute_dtype(v1::DATA_TYPE_UNSPECIFIED);
  const auto float32 = client_->LoadLayer(request);
  ASSERT_TRUE(float32.ok()) << float32.status();
  EXPECT_EQ(float32->dtype(), v1::FLOAT32);
  EXPECT_EQ(float32->config().compute_dtype(), v1::FLOAT32);
  config.set_compute_dtype(v1::BFLOAT16);
  const auto bf16 = client_->LoadLayer(request);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->dtype(), v1::BFLOAT16);
  EXPECT_EQ(bf16->config().compute_dtype(), v1::BFLOAT16);
  EXPECT_LT(bf16->weight_bytes(), 0.55 * float32->weight_bytes());
}

TEST_F(HfCheckpointTest, InspectStopsBeforeTheResponseGrowsPastItsBound) {
  // 3000 tensors with 1000-character names: 3 MB of names, listed 1 MiB at a time.
  std::vector<NamedTensor> tensors;
  for (int i = 0; i < 3000; ++i) {
    char number[8];
    std::snprintf(number, sizeof(number), "%04d", i);
    tensors.push_back({std::string(996, 'n') + number, {1}, {0.0f}});
  }
  WriteSafetensors(repository_ / "wide.safetensors", tensors);
  v1::InspectCheckpointRequest request;
  request.set_path("wide.safetensors");
  request.set_max_tensors(10000);
  int64_t seen = 0;
  for (int page = 0; page < 10; ++page) {
    request.set_offset(seen);
    auto listed = client_->InspectCheckpoint(request);
    ASSERT_TRUE(listed.ok()) << listed.status();
    EXPECT_LE(listed->ByteSizeLong(), size_t{1} << 21);
    ASSERT_GT(listed->tensors_size(), 0);
    seen += listed->tensors_size();
    if (!listed->truncated()) break;
    EXPECT_LT(listed->tensors_size(), 3000);
  }
  EXPECT_EQ(seen, 3000);
  // A name that alone passes the bound is refused by index, not answered with empty pages.
  WriteSafetensors(repository_ / "huge.safetensors",
                   {{"a", {1}, {0.0f}}, {std::string(1 << 20, 'n'), {1}, {0.0f}}});
  request.set_path("huge.safetensors");
  request.set_offset(0);
  auto first = client_->InspectCheckpoint(request);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->tensors_size(), 1);
  EXPECT_TRUE(first->truncated());
  request.set_offset(1);
  ExpectStatus(client_->InspectCheckpoint(request).status(), absl::StatusCode::kOutOfRange,
               "tensor 1 of \"huge.safetensors\" takes 1048605 bytes to describe; "
               "InspectCheckpoint lists at most 1048576");
}

}  // namespace
}  // namespace attention::server::testing

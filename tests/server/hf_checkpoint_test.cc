// Hugging Face config.json parsing, agreement with a sent config, and layer prefixes: every
// supported model family, both transformers 4 and 5 spellings, and every refusal.
#include "server/models/hf_checkpoint.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace attention::server {
namespace {

using Json = nlohmann::json;

void ExpectInvalid(const absl::Status& status, const std::string& part) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find(part), std::string::npos)
      << "expected \"" << part << "\" in \"" << status.message() << "\"";
}

// all-MiniLM-L6-v2's config.json, as its checkpoint ships it (abridged).
Json MiniLm() {
  return Json::parse(R"({
    "architectures": ["BertModel"], "model_type": "bert", "hidden_size": 384,
    "num_attention_heads": 12, "num_hidden_layers": 6, "intermediate_size": 1536,
    "position_embedding_type": "absolute", "hidden_act": "gelu", "vocab_size": 30522})");
}

Json Llama() {
  return Json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
    "num_hidden_layers": 3, "rope_theta": 500000.0, "attention_bias": false,
    "rope_scaling": null, "max_position_embeddings": 2048})");
}

Json Qwen2() {
  return Json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 1, "num_hidden_layers": 2,
    "rope_theta": 1000000.0, "use_sliding_window": false, "sliding_window": 4096,
    "max_window_layers": 28})");
}

absl::StatusOr<HfLayerConfig> Parse(const Json& config, int64_t layer = 0) {
  return ParseHfConfig(config.dump(), layer, "\"m/config.json\"");
}

TEST(HfConfigTest, BertTakesItsSizesAndHasEveryBias) {
  auto parsed = Parse(MiniLm(), 5);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->model_type, "bert");
  EXPECT_EQ(parsed->num_layers, 6);
  EXPECT_EQ(parsed->naming, v1::WEIGHT_NAMING_HF_BERT);
  const v1::LayerConfig& c = parsed->config;
  EXPECT_EQ(c.embed_dim(), 384);
  EXPECT_EQ(c.num_heads(), 12);
  EXPECT_EQ(c.num_kv_heads(), 12);
  EXPECT_EQ(c.head_dim(), 32);
  EXPECT_FALSE(c.no_qkv_bias());
  EXPECT_FALSE(c.no_output_bias());
  EXPECT_FALSE(c.always_causal());
  EXPECT_EQ(c.rope_theta(), 0.0);
}

TEST(HfConfigTest, LlamaTakesGqaHeadDimRopeThetaAndIsCausalWithoutBiases) {
  auto parsed = Parse(Llama(), 2);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->naming, v1::WEIGHT_NAMING_HF_LLAMA);
  const v1::LayerConfig& c = parsed->config;
  EXPECT_EQ(c.embed_dim(), 64);
  EXPECT_EQ(c.num_heads(), 8);
  EXPECT_EQ(c.num_kv_heads(), 2);
  EXPECT_EQ(c.head_dim(), 16);  // != 64 / 8
  EXPECT_EQ(c.output_dim(), 64);
  EXPECT_EQ(c.rope_theta(), 500000.0);
  EXPECT_TRUE(c.no_qkv_bias());
  EXPECT_TRUE(c.no_output_bias());
  EXPECT_TRUE(c.always_causal());

  Json biased = Llama();
  biased["attention_bias"] = true;
  parsed = Parse(biased);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_FALSE(parsed->config.no_qkv_bias());
  EXPECT_FALSE(parsed->config.no_output_bias());
}

TEST(HfConfigTest, DefaultsAndTransformers5Spellings) {
  Json config = Llama();
  config.erase("num_key_value_heads");
  config.erase("head_dim");
  config.erase("rope_theta");
  config.erase("rope_scaling");
  config["rope_parameters"] = Json::parse(R"({"rope_type": "default", "rope_theta": 1234.0})");
  auto parsed = Parse(config);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.num_kv_heads(), 8);
  EXPECT_EQ(parsed->config.head_dim(), 8);
  EXPECT_EQ(parsed->config.rope_theta(), 1234.0);
  config.erase("rope_parameters");
  parsed = Parse(config);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.rope_theta(), 10000.0) << "transformers' default";
  // No model_type: the architecture says it.
  config.erase("model_type");
  parsed = Parse(config);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->model_type, "llama");
}

TEST(HfConfigTest, Qwen2HasQkvBiasesButNoOutputBiasAndMistralNone) {
  auto parsed = Parse(Qwen2(), 1);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_FALSE(parsed->config.no_qkv_bias());
  EXPECT_TRUE(parsed->config.no_output_bias());
  EXPECT_EQ(parsed->config.num_kv_heads(), 1);  // MQA
  Json mistral = Qwen2();
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = nullptr;
  parsed = Parse(mistral);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->config.no_qkv_bias());
  EXPECT_TRUE(parsed->config.no_output_bias());
}

TEST(HfConfigTest, RefusesWhatTheLayerCannotComputeByName) {
  const struct {
    const char* label;
    Json config;
    int64_t layer;
    const char* message;
  } cases[] = {
      {"not json", Json("x"), 0, "\"m/config.json\" is not a JSON object"},
      {"model type", Json::parse(R"({"model_type": "gpt2"})"), 0,
       "model_type \"gpt2\" is not supported; supported: bert, roberta"},
      {"architecture", Json::parse(R"({"architectures": ["T5Model"]})"), 0,
       "architectures[0] \"T5Model\" is not supported"},
      {"nothing", Json::parse("{}"), 0, "neither \"model_type\" nor \"architectures\""},
      {"missing", [] { Json c = MiniLm(); c.erase("hidden_size"); return c; }(), 0,
       "\"m/config.json\": \"hidden_size\" is missing"},
      {"not an integer", [] { Json c = MiniLm(); c["num_attention_heads"] = 1.5; return c; }(), 0,
       "\"num_attention_heads\" = \"1.5\" must be an integer in [1, "},
      {"layer index", MiniLm(), 6,
       "layer_index = 6 is outside [0, 6): \"m/config.json\" has num_hidden_layers = 6"},
      {"negative layer index", MiniLm(), -1, "layer_index = -1 is outside [0, 6)"},
      {"relative positions",
       [] { Json c = MiniLm(); c["position_embedding_type"] = "relative_key"; return c; }(), 0,
       "\"position_embedding_type\" = \"relative_key\" is not supported"},
      {"bert decoder", [] { Json c = MiniLm(); c["is_decoder"] = true; return c; }(), 0,
       "\"is_decoder\" = true is not supported"},
      {"partial rotary", [] { Json c = Llama(); c["partial_rotary_factor"] = 0.5; return c; }(), 0,
       "\"partial_rotary_factor\" = \"0.5\" is not supported"},
      {"rope type", [] {
         Json c = Llama();
         c["rope_scaling"] = Json::parse(R"({"rope_type": "yarn", "factor": 4.0})");
         return c;
       }(), 0, "rope_type \"yarn\" is not implemented by this server (default, linear, "
               "dynamic, llama3)"},
      {"llama3 without its context", [] {
         Json c = Llama();
         c["rope_scaling"] = Json::parse(R"({"rope_type": "llama3", "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0})");
         return c;
       }(), 0, "\"original_max_position_embeddings\" is missing"},
      {"scaling without factor", [] {
         Json c = Llama();
         c["rope_scaling"] = Json::parse(R"({"type": "linear"})");
         return c;
       }(), 0, "rope scaling \"factor\" = \"null\" must be a positive number"},
      {"dynamic without max positions", [] {
         Json c = Llama();
         c.erase("max_position_embeddings");
         c["rope_scaling"] = Json::parse(R"({"rope_type": "dynamic", "factor": 2.0})");
         return c;
       }(), 0, "\"max_position_embeddings\" is missing"},
      {"layer types", [] {
         Json c = Qwen2();
         c["layer_types"] = Json::parse(R"(["full_attention"])");
         return c;
       }(), 1, "\"layer_types\" has no string for layer 1"},
      {"bad theta", [] { Json c = Llama(); c["rope_theta"] = -1; return c; }(), 0,
       "\"rope_theta\" = \"-1\" must be a positive number"},
      {"heads do not divide", [] { Json c = MiniLm(); c["num_attention_heads"] = 7; return c; }(),
       0, "\"m/config.json\" gives an invalid layer: config.num_heads = 7 does not divide "
       "config.embed_dim = 384"},
      {"kv heads do not divide",
       [] { Json c = Llama(); c["num_key_value_heads"] = 3; return c; }(), 0,
       "\"m/config.json\" gives an invalid layer: config.num_kv_heads"},
  };
  for (const auto& test_case : cases) {
    SCOPED_TRACE(test_case.label);
    ExpectInvalid(Parse(test_case.config, test_case.layer).status(), test_case.message);
  }
}

TEST(HfConfigTest, RopeScalingIsReadInBothSpellings) {
  Json config = Llama();
  config["rope_scaling"] = Json::parse(R"({"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})");
  auto parsed = Parse(config);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  const v1::RopeScaling& llama3 = parsed->config.rope_scaling();
  EXPECT_EQ(llama3.rope_type(), "llama3");
  EXPECT_EQ(llama3.factor(), 8.0);
  EXPECT_EQ(llama3.low_freq_factor(), 1.0);
  EXPECT_EQ(llama3.high_freq_factor(), 4.0);
  EXPECT_EQ(llama3.original_max_position_embeddings(), 8192);
  // transformers 5: rope_parameters, and "type" for the rope type in older files.
  config.erase("rope_scaling");
  config.erase("rope_theta");
  config["rope_parameters"] = Json::parse(R"({"rope_type": "dynamic", "factor": 2.0,
      "rope_theta": 500000.0})");
  parsed = Parse(config);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.rope_theta(), 500000.0);
  EXPECT_EQ(parsed->config.rope_scaling().rope_type(), "dynamic");
  EXPECT_EQ(parsed->config.rope_scaling().original_max_position_embeddings(), 2048)
      << "dynamic scales against max_position_embeddings";
  config["rope_parameters"] = Json::parse(R"({"type": "linear", "factor": 4.0})");
  parsed = Parse(config);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->config.rope_scaling().rope_type(), "linear");
  EXPECT_EQ(parsed->config.rope_scaling().factor(), 4.0);
  EXPECT_FALSE(Parse(Llama())->config.has_rope_scaling());
}

TEST(HfConfigTest, SlidingWindowAppliesWhereTheModelSaysSo) {
  // Qwen2 (transformers 4 spelling): from max_window_layers on, when use_sliding_window.
  Json qwen = Qwen2();
  qwen["num_hidden_layers"] = 4;
  qwen["use_sliding_window"] = true;
  qwen["max_window_layers"] = 2;
  qwen["sliding_window"] = 16;
  EXPECT_EQ(Parse(qwen, 1)->config.sliding_window(), 0);
  EXPECT_EQ(Parse(qwen, 2)->config.sliding_window(), 16);
  EXPECT_TRUE(Parse(qwen, 2)->config.always_causal());
  qwen["use_sliding_window"] = false;
  EXPECT_EQ(Parse(qwen, 3)->config.sliding_window(), 0) << "sliding_window alone does not apply";
  // transformers 5 writes layer_types, which win.
  qwen["layer_types"] = Json::parse(
      R"(["sliding_attention", "full_attention", "full_attention", "full_attention"])");
  EXPECT_EQ(Parse(qwen, 0)->config.sliding_window(), 16);
  EXPECT_EQ(Parse(qwen, 3)->config.sliding_window(), 0);
  // Mistral: every layer; none when null. Llama never.
  Json mistral = Qwen2();
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = 4096;
  EXPECT_EQ(Parse(mistral, 1)->config.sliding_window(), 4096);
  mistral["sliding_window"] = nullptr;
  EXPECT_EQ(Parse(mistral, 1)->config.sliding_window(), 0);
  Json llama = Llama();
  llama["sliding_window"] = 8;
  EXPECT_EQ(Parse(llama, 0)->config.sliding_window(), 0);
}

TEST(HfConfigTest, AgreementComparesOnlyTheFieldsTheCallerSets) {
  const v1::LayerConfig file = Parse(Llama())->config;
  v1::LayerConfig sent;
  EXPECT_TRUE(CheckConfigAgreement(sent, file, "spec.config", "f").ok()) << "nothing sent";
  sent.set_embed_dim(64);
  sent.set_num_heads(8);
  sent.set_head_dim(16);
  sent.set_no_qkv_bias(true);
  sent.set_rope_theta(500000.0);
  EXPECT_TRUE(CheckConfigAgreement(sent, file, "spec.config", "f").ok());
  sent.set_num_heads(4);
  ExpectInvalid(CheckConfigAgreement(sent, file, "spec.config", "\"m/config.json\""),
                "spec.config.num_heads = 4 disagrees with \"m/config.json\", which gives 8 "
                "(num_attention_heads)");
  sent.set_num_heads(8);
  sent.set_rope_theta(10000.0);
  ExpectInvalid(CheckConfigAgreement(sent, file, "spec.config", "f"),
                "spec.config.rope_theta = 10000 disagrees with f, which gives 500000 (rope_theta)");
  sent.set_rope_theta(0.0);
  const v1::LayerConfig bert = Parse(MiniLm())->config;
  v1::LayerConfig no_bias;
  no_bias.set_no_qkv_bias(true);
  ExpectInvalid(CheckConfigAgreement(no_bias, bert, "spec.config", "f"),
                "spec.config.no_qkv_bias = true disagrees with f, which gives false");
  v1::LayerConfig causal;
  causal.set_always_causal(true);
  ExpectInvalid(CheckConfigAgreement(causal, bert, "spec.config", "f"),
                "spec.config.always_causal = true disagrees");
  // A rope scaling that the file does not have, or has otherwise.
  v1::LayerConfig scaled;
  scaled.mutable_rope_scaling()->set_rope_type("linear");
  scaled.mutable_rope_scaling()->set_factor(2.0);
  ExpectInvalid(CheckConfigAgreement(scaled, file, "spec.config", "f"),
                "spec.config.rope_scaling = {rope_type: \"linear\" factor: 2} disagrees with f, "
                "which gives none (rope_scaling or rope_parameters)");
  v1::LayerConfig window;
  window.set_sliding_window(8);
  ExpectInvalid(CheckConfigAgreement(window, file, "spec.config", "f"),
                "spec.config.sliding_window = 8 disagrees with f, which gives 0");
}

TEST(HfConfigTest, LayerPrefixIsFoundUnderAnyWrapper) {
  const std::vector<std::string> bert_suffixes = {
      "attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight",
      "attention.output.dense.weight"};
  for (const std::string wrapper : {"", "bert.", "roberta."}) {
    SCOPED_TRACE(wrapper);
    std::vector<std::string> names = {wrapper + "embeddings.word_embeddings.weight"};
    for (int layer = 0; layer < 12; ++layer) {
      for (const std::string& suffix : bert_suffixes) {
        names.push_back(wrapper + "encoder.layer." + std::to_string(layer) + "." + suffix);
      }
    }
    auto prefix = LayerPrefixFor(v1::WEIGHT_NAMING_HF_BERT, names, 1, "f");
    ASSERT_TRUE(prefix.ok()) << prefix.status();
    EXPECT_EQ(*prefix, wrapper + "encoder.layer.1.") << "not layer 11 or 10";
    const std::vector<std::string> all = FindLayerPrefixes(v1::WEIGHT_NAMING_HF_BERT, names);
    ASSERT_EQ(all.size(), 12u);
    EXPECT_EQ(all[2], wrapper + "encoder.layer.2.") << "numeric order";
    EXPECT_EQ(all[11], wrapper + "encoder.layer.11.");
    ExpectInvalid(LayerPrefixFor(v1::WEIGHT_NAMING_HF_BERT, names, 12, "f").status(),
                  "f has no WEIGHT_NAMING_HF_BERT layer 12; its layer prefixes: \"" + wrapper +
                      "encoder.layer.0.\"");
    EXPECT_TRUE(FindLayerPrefixes(v1::WEIGHT_NAMING_HF_LLAMA, names).empty());
  }
  // An encoder-decoder checkpoint has two layers 0: refused, listing both.
  std::vector<std::string> both;
  for (const std::string stack : {"model.encoder.layers.0.", "model.decoder.layers.0."}) {
    for (const char* p : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      both.push_back(stack + "self_attn." + p + ".weight");
    }
  }
  ExpectInvalid(LayerPrefixFor(v1::WEIGHT_NAMING_HF_LLAMA, both, 0, "f").status(),
                "f has several WEIGHT_NAMING_HF_LLAMA layers 0: \"model.decoder.layers.0.\", "
                "\"model.encoder.layers.0.\"");
  // A layer missing its value projection is not a layer.
  both.erase(both.begin() + 2);
  EXPECT_EQ(FindLayerPrefixes(v1::WEIGHT_NAMING_HF_LLAMA, both),
            std::vector<std::string>{"model.decoder.layers.0."});
}

TEST(HfConfigTest, FusedConventionsFindTheirLayers) {
  const std::vector<std::string> torch = {"layers.0.self_attn.in_proj_weight",
                                          "layers.0.self_attn.in_proj_bias",
                                          "layers.0.self_attn.out_proj.weight"};
  EXPECT_EQ(FindLayerPrefixes(v1::WEIGHT_NAMING_TORCH_MHA, torch),
            std::vector<std::string>{"layers.0.self_attn."});
  EXPECT_TRUE(FindLayerPrefixes(v1::WEIGHT_NAMING_NATIVE, torch).empty());
  const std::vector<std::string> native = {"qkv_proj.weight", "out_proj.weight"};
  EXPECT_EQ(FindLayerPrefixes(v1::WEIGHT_NAMING_NATIVE, native), std::vector<std::string>{""});
  // Half a name is not a prefix.
  EXPECT_TRUE(FindLayerPrefixes(v1::WEIGHT_NAMING_NATIVE, {"xqkv_proj.weight", "xout_proj.weight"})
                  .empty());
}

TEST(HfConfigTest, NaturalOrderComparesDigitRunsAsNumbers) {
  EXPECT_TRUE(NaturalLess("layers.2.", "layers.10."));
  EXPECT_FALSE(NaturalLess("layers.10.", "layers.2."));
  EXPECT_TRUE(NaturalLess("a.1.", "b.0."));
  EXPECT_FALSE(NaturalLess("x", "x"));
  EXPECT_TRUE(NaturalLess("x", "x.0"));
}

}  // namespace
}  // namespace attention::server

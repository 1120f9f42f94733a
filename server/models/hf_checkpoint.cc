#include "server/models/hf_checkpoint.h"

#include <map>
#include <optional>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/text_format.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/mha_types.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"
#include "server/common/status_util.h"
#include "server/models/layer_config.h"

namespace attention::server {
namespace {

using Json = nlohmann::json;

constexpr int64_t kMaxJsonBytes = 64 << 20;  // an index of a very large model is ~1 MiB
constexpr int64_t kMaxShards = 4096;
constexpr int64_t kDefaultInspectTensors = 1000;
constexpr int64_t kMaxInspectTensors = 10000;
constexpr size_t kMaxInspectBytes = 1 << 20;
constexpr size_t kMaxInspectPrefixes = 10000;
constexpr int64_t kMaxDimension = int64_t{1} << 20;  // MhaConfig::Resolve bounds it further

// How a model type computes attention.
enum class Family {
  kBert,     // biases everywhere, bidirectional, no rotary
  kLlama,    // attention_bias for all four projections, causal, rotary
  kMistral,  // no biases, causal, rotary, sliding_window on every layer
  kQwen2,    // q/k/v biases, no o_proj bias, causal, rotary, sliding window on upper layers
};

struct ModelType {
  const char* model_type;
  const char* architecture_prefix;  // when config.json has no model_type
  Family family;
};

constexpr ModelType kModelTypes[] = {
    {"bert", "Bert", Family::kBert},         {"roberta", "Roberta", Family::kBert},
    {"xlm-roberta", "XLMRoberta", Family::kBert}, {"electra", "Electra", Family::kBert},
    {"llama", "Llama", Family::kLlama},      {"mistral", "Mistral", Family::kMistral},
    {"mixtral", "Mixtral", Family::kMistral}, {"qwen2", "Qwen2", Family::kQwen2},
};

std::string SupportedTypes() {
  std::string list;
  for (const ModelType& type : kModelTypes) {
    absl::StrAppend(&list, list.empty() ? "" : ", ", type.model_type);
  }
  return list;
}

// A value as messages quote it: strings without their JSON quotes.
std::string ValueText(const Json& value) {
  return value.is_string() ? value.get<std::string>() : value.dump();
}

// `object[key]`, or nullptr when absent or null (save_pretrained writes unset keys as null).
const Json* Get(const Json& object, const char* key) {
  const auto found = object.find(key);
  if (found == object.end() || found->is_null()) return nullptr;
  return &*found;
}

absl::StatusOr<int64_t> PositiveInt(const Json& object, const char* key, absl::string_view where,
                                    std::optional<int64_t> fallback = std::nullopt) {
  const Json* value = Get(object, key);
  if (value == nullptr) {
    if (fallback) return *fallback;
    return Invalid(where, ": \"", key, "\" is missing");
  }
  if (!value->is_number_integer() || value->get<int64_t>() < 1 ||
      value->get<int64_t>() > kMaxDimension) {
    return Invalid(where, ": \"", key, "\" = ", Quoted(ValueText(*value)),
                   " must be an integer in [1, ", kMaxDimension, "]");
  }
  return value->get<int64_t>();
}

absl::StatusOr<bool> Bool(const Json& object, const char* key, absl::string_view where,
                          bool fallback) {
  const Json* value = Get(object, key);
  if (value == nullptr) return fallback;
  if (!value->is_boolean()) {
    return Invalid(where, ": \"", key, "\" = ", Quoted(ValueText(*value)), " must be true or false");
  }
  return value->get<bool>();
}

absl::StatusOr<Family> FamilyOf(const Json& config, absl::string_view where,
                                std::string* model_type) {
  if (const Json* type = Get(config, "model_type"); type != nullptr) {
    if (!type->is_string()) {
      return Invalid(where, ": \"model_type\" = ", Quoted(ValueText(*type)), " must be a string");
    }
    *model_type = type->get<std::string>();
    for (const ModelType& known : kModelTypes) {
      if (*model_type == known.model_type) return known.family;
    }
    return Invalid(where, ": model_type ", Quoted(*model_type), " is not supported; supported: ",
                   SupportedTypes());
  }
  if (const Json* architectures = Get(config, "architectures");
      architectures != nullptr && architectures->is_array() && !architectures->empty() &&
      (*architectures)[0].is_string()) {
    const std::string architecture = (*architectures)[0].get<std::string>();
    for (const ModelType& known : kModelTypes) {
      if (absl::StartsWith(architecture, known.architecture_prefix)) {
        *model_type = known.model_type;
        return known.family;
      }
    }
    return Invalid(where, ": architectures[0] ", Quoted(architecture),
                   " is not supported (and there is no model_type); supported model types: ",
                   SupportedTypes());
  }
  return Invalid(where, ": neither \"model_type\" nor \"architectures\" says what model this is");
}

// Rotary settings: rope_theta at the top level (transformers 4) or in rope_parameters
// (transformers 5); rope scaling in rope_scaling or rope_parameters.
absl::Status ReadRotary(const Json& config, absl::string_view where, v1::LayerConfig* out) {
  const Json* parameters = Get(config, "rope_parameters");
  if (parameters != nullptr && !parameters->is_object()) {
    return Invalid(where, ": \"rope_parameters\" must be an object");
  }
  double theta = 10000.0;  // transformers' default for every supported rotary model
  const Json* theta_value = Get(config, "rope_theta");
  if (theta_value == nullptr && parameters != nullptr) theta_value = Get(*parameters, "rope_theta");
  if (theta_value != nullptr) {
    if (!theta_value->is_number() || !(theta_value->get<double>() > 0.0)) {
      return Invalid(where, ": \"rope_theta\" = ", Quoted(ValueText(*theta_value)),
                     " must be a positive number");
    }
    theta = theta_value->get<double>();
  }
  out->set_rope_theta(theta);
  if (const Json* partial = Get(config, "partial_rotary_factor");
      partial != nullptr && !(partial->is_number() && partial->get<double>() == 1.0)) {
    return Invalid(where, ": \"partial_rotary_factor\" = ", Quoted(ValueText(*partial)),
                   " is not supported (rotary on every channel only)");
  }
  const Json* scaling = Get(config, "rope_scaling");
  if (scaling == nullptr) scaling = parameters;
  if (scaling == nullptr) return absl::OkStatus();
  if (!scaling->is_object()) return Invalid(where, ": \"rope_scaling\" must be an object or null");
  const Json* type = Get(*scaling, "rope_type");
  if (type == nullptr) type = Get(*scaling, "type");
  const std::string rope_type = type != nullptr && type->is_string() ? type->get<std::string>()
                                : type == nullptr                   ? "default"
                                                                    : ValueText(*type);
  if (rope_type == "default") return absl::OkStatus();
  if (rope_type != "linear" && rope_type != "dynamic" && rope_type != "llama3") {
    return Invalid(where, ": rope_type ", Quoted(rope_type),
                   " is not implemented by this server (default, linear, dynamic, llama3); "
                   "refused rather than approximated");
  }
  v1::RopeScaling* out_scaling = out->mutable_rope_scaling();
  out_scaling->set_rope_type(rope_type);
  const Json* factor = Get(*scaling, "factor");
  if (factor == nullptr || !factor->is_number() || !(factor->get<double>() > 0.0)) {
    return Invalid(where, ": rope scaling \"factor\" = ",
                   Quoted(factor == nullptr ? "null" : ValueText(*factor)),
                   " must be a positive number");
  }
  out_scaling->set_factor(factor->get<double>());
  if (rope_type == "dynamic") {
    // transformers scales against max_position_embeddings for dynamic NTK.
    ASSIGN_OR_RETURN(const int64_t max_positions,
                     PositiveInt(config, "max_position_embeddings", where));
    out_scaling->set_original_max_position_embeddings(max_positions);
  } else if (rope_type == "llama3") {
    ASSIGN_OR_RETURN(const int64_t original,
                     PositiveInt(*scaling, "original_max_position_embeddings", where));
    out_scaling->set_original_max_position_embeddings(original);
    for (const char* key : {"low_freq_factor", "high_freq_factor"}) {
      const Json* value = Get(*scaling, key);
      if (value == nullptr || !value->is_number()) {
        return Invalid(where, ": llama3 rope scaling needs a number \"", key, "\"");
      }
      if (std::string(key) == "low_freq_factor") {
        out_scaling->set_low_freq_factor(value->get<double>());
      } else {
        out_scaling->set_high_freq_factor(value->get<double>());
      }
    }
  }
  return absl::OkStatus();
}

// The sliding window config.json applies to layer `layer_index`, or 0.
absl::StatusOr<int64_t> SlidingWindow(const Json& config, Family family, int64_t layer_index,
                                      absl::string_view where) {
  if (family == Family::kBert || family == Family::kLlama) return 0;
  bool applies = false;
  if (const Json* types = Get(config, "layer_types"); types != nullptr) {
    // transformers 5 writes which layers slide.
    if (!types->is_array() || static_cast<int64_t>(types->size()) <= layer_index ||
        !(*types)[layer_index].is_string()) {
      return Invalid(where, ": \"layer_types\" has no string for layer ", layer_index);
    }
    applies = (*types)[layer_index].get<std::string>() == "sliding_attention";
  } else if (family == Family::kQwen2) {
    ASSIGN_OR_RETURN(const bool use, Bool(config, "use_sliding_window", where, false));
    ASSIGN_OR_RETURN(const int64_t from,
                     PositiveInt(config, "max_window_layers", where, int64_t{1} << 20));
    applies = use && layer_index >= from;
  } else {
    applies = true;  // Mistral: every layer, when sliding_window is set
  }
  if (!applies || Get(config, "sliding_window") == nullptr) return 0;
  return PositiveInt(config, "sliding_window", where);
}

// The config.json key a LayerConfig field comes from, for messages.
std::string JsonSource(absl::string_view field) {
  static const std::map<std::string, std::string, std::less<>> kKeys = {
      {"embed_dim", "hidden_size"},
      {"num_heads", "num_attention_heads"},
      {"num_kv_heads", "num_key_value_heads, else num_attention_heads"},
      {"head_dim", "head_dim, else hidden_size / num_attention_heads"},
      {"rope_theta", "rope_theta"},
      {"no_qkv_bias", "the model type's q/k/v biases, or attention_bias"},
      {"no_output_bias", "the model type's output bias, or attention_bias"},
      {"always_causal", "the model type: decoder layers are causal"},
      {"rope_scaling", "rope_scaling or rope_parameters"},
      {"sliding_window", "sliding_window, where layer_types / use_sliding_window apply it"},
  };
  const auto found = kKeys.find(field);
  return found != kKeys.end() ? found->second : "implied by the model type";
}

std::string FieldText(const google::protobuf::Message& message,
                      const google::protobuf::FieldDescriptor* field) {
  if (field->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE) {
    if (!message.GetReflection()->HasField(message, field)) return "none";
    return absl::StrCat(
        "{", message.GetReflection()->GetMessage(message, field).ShortDebugString(), "}");
  }
  std::string text;
  google::protobuf::TextFormat::PrintFieldValueToString(message, field, -1, &text);
  return text;
}

// The directory part of a relative path without trailing slashes; "" stays "".
std::string TrimSlashes(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  return std::string(path);
}

std::string Join(absl::string_view directory, absl::string_view name) {
  return directory.empty() || directory == "." ? std::string(name)
                                               : absl::StrCat(directory, "/", name);
}

}  // namespace

absl::StatusOr<HfLayerConfig> ParseHfConfig(absl::string_view json_text, int64_t layer_index,
                                            absl::string_view where,
                                            absl::string_view layer_field) {
  const Json config = Json::parse(json_text.begin(), json_text.end(), nullptr,
                                  /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return Invalid(where, " is not a JSON object");
  }
  HfLayerConfig parsed;
  ASSIGN_OR_RETURN(const Family family, FamilyOf(config, where, &parsed.model_type));
  ASSIGN_OR_RETURN(parsed.num_layers, PositiveInt(config, "num_hidden_layers", where));
  if (layer_index < 0 || layer_index >= parsed.num_layers) {
    return Invalid(layer_field, " = ", layer_index, " is outside [0, ", parsed.num_layers,
                   "): ", where, " has num_hidden_layers = ", parsed.num_layers);
  }
  v1::LayerConfig& out = parsed.config;
  ASSIGN_OR_RETURN(const int64_t hidden, PositiveInt(config, "hidden_size", where));
  ASSIGN_OR_RETURN(const int64_t heads, PositiveInt(config, "num_attention_heads", where));
  out.set_embed_dim(hidden);
  out.set_num_heads(heads);
  if (family == Family::kBert) {
    parsed.naming = v1::WEIGHT_NAMING_HF_BERT;
    if (const Json* position = Get(config, "position_embedding_type");
        position != nullptr && *position != "absolute") {
      return Invalid(where, ": \"position_embedding_type\" = ", Quoted(ValueText(*position)),
                     " is not supported (only \"absolute\", which is outside the attention layer)");
    }
    ASSIGN_OR_RETURN(const bool decoder, Bool(config, "is_decoder", where, false));
    if (decoder) return Invalid(where, ": \"is_decoder\" = true is not supported");
  } else {
    parsed.naming = v1::WEIGHT_NAMING_HF_LLAMA;
    ASSIGN_OR_RETURN(const int64_t kv_heads,
                     PositiveInt(config, "num_key_value_heads", where, heads));
    out.set_num_kv_heads(kv_heads);
    if (Get(config, "head_dim") != nullptr) {
      ASSIGN_OR_RETURN(const int64_t head_dim, PositiveInt(config, "head_dim", where));
      out.set_head_dim(head_dim);
    }
    bool qkv_bias = false, output_bias = false;
    if (family == Family::kLlama) {
      ASSIGN_OR_RETURN(qkv_bias, Bool(config, "attention_bias", where, false));
      output_bias = qkv_bias;
    } else if (family == Family::kQwen2) {
      qkv_bias = true;
    }
    out.set_no_qkv_bias(!qkv_bias);
    out.set_no_output_bias(!output_bias);
    out.set_always_causal(true);
    RETURN_IF_ERROR(ReadRotary(config, where, &out));
    ASSIGN_OR_RETURN(const int64_t window, SlidingWindow(config, family, layer_index, where));
    out.set_sliding_window(window);
  }
  auto converted = ConvertConfig(out);
  auto resolved = converted.ok() ? core::MhaConfig::Resolve(*converted) : converted;
  if (!resolved.ok()) return Invalid(where, " gives an invalid layer: ", resolved.status().message());
  out = ConfigToProto(*resolved);
  return parsed;
}

absl::Status CheckConfigAgreement(const v1::LayerConfig& sent, const v1::LayerConfig& file,
                                  absl::string_view sent_field, absl::string_view where) {
  const google::protobuf::Descriptor* descriptor = v1::LayerConfig::descriptor();
  const google::protobuf::Reflection* reflection = v1::LayerConfig::GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = descriptor->field(i);
    // proto3: a scalar "has" its field when it is not the default (zero, false).
    if (!reflection->HasField(sent, field)) continue;
    // The precision is the caller's choice, not the checkpoint's.
    if (field->number() == v1::LayerConfig::kComputeDtypeFieldNumber) continue;
    const std::string given = FieldText(sent, field);
    const std::string read = FieldText(file, field);
    if (given != read) {
      return Invalid(sent_field, ".", field->name(), " = ", given, " disagrees with ", where,
                     ", which gives ", read, " (", JsonSource(field->name()), ")");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LayerPrefixFor(v1::WeightNaming naming,
                                           const std::vector<std::string>& names,
                                           int64_t layer_index, absl::string_view where) {
  const std::vector<std::string> prefixes = FindLayerPrefixes(naming, names);
  const std::string index = absl::StrCat(layer_index, ".");
  std::vector<std::string> matching;
  for (const std::string& prefix : prefixes) {
    if (prefix == index || absl::EndsWith(prefix, absl::StrCat(".", index))) {
      matching.push_back(prefix);
    }
  }
  if (matching.size() == 1) return matching.front();
  if (matching.empty()) {
    return Invalid(where, " has no ", v1::WeightNaming_Name(naming), " layer ", layer_index,
                   "; its layer prefixes: ", QuotedListForMessage(prefixes));
  }
  return Invalid(where, " has several ", v1::WeightNaming_Name(naming), " layers ", layer_index,
                 ": ", QuotedListForMessage(matching),
                 "; load one with safetensors.path and safetensors.prefix");
}

std::vector<const core::SafetensorsFile*> Checkpoint::FilePointers() const {
  std::vector<const core::SafetensorsFile*> pointers;
  for (const auto& file : files) pointers.push_back(file.get());
  return pointers;
}

absl::StatusOr<Checkpoint> OpenCheckpoint(const ModelRepository& repository,
                                          absl::string_view path, absl::string_view path_field) {
  Checkpoint checkpoint;
  ASSIGN_OR_RETURN(checkpoint.is_directory, repository.IsDirectory(path, path_field));
  if (!checkpoint.is_directory) {
    ASSIGN_OR_RETURN(auto file, repository.OpenSafetensors(path, path_field));
    checkpoint.files.push_back(std::move(file));
    checkpoint.file_names.push_back("");
    return checkpoint;
  }
  const std::string directory = TrimSlashes(path);
  checkpoint.config_path = Join(directory, "config.json");
  auto config = repository.ReadSmallFile(checkpoint.config_path, path_field, kMaxJsonBytes);
  if (config.ok()) {
    checkpoint.config_json = *std::move(config);
  } else if (config.status().code() != absl::StatusCode::kNotFound) {
    return config.status();
  }
  const std::string index_path = Join(directory, "model.safetensors.index.json");
  auto index_text = repository.ReadSmallFile(index_path, path_field, kMaxJsonBytes);
  if (!index_text.ok() && index_text.status().code() != absl::StatusCode::kNotFound) {
    return index_text.status();
  }
  if (!index_text.ok()) {
    auto file = repository.OpenSafetensors(Join(directory, "model.safetensors"), path_field);
    if (!file.ok() && file.status().code() == absl::StatusCode::kNotFound) {
      return absl::NotFoundError(absl::StrCat(
          path_field, " = ", Quoted(path),
          " holds neither model.safetensors nor model.safetensors.index.json (only safetensors "
          "checkpoints are read: save_pretrained(..., safe_serialization=True))"));
    }
    if (!file.ok()) return file.status();
    checkpoint.files.push_back(*std::move(file));
    checkpoint.file_names.push_back("model.safetensors");
    return checkpoint;
  }
  const Json index = Json::parse(index_text->begin(), index_text->end(), nullptr, false);
  const Json* weight_map = index.is_object() ? Get(index, "weight_map") : nullptr;
  if (weight_map == nullptr || !weight_map->is_object()) {
    return Invalid(path_field, ": ", Quoted(index_path),
                   " is not a JSON object with a \"weight_map\" object");
  }
  std::map<std::string, std::vector<std::string>> shards;  // shard -> tensors listed in it
  for (const auto& [tensor, shard] : weight_map->items()) {
    if (!shard.is_string()) {
      return Invalid(path_field, ": ", Quoted(index_path), " maps ", Quoted(tensor),
                     " to a non-string");
    }
    shards[shard.get<std::string>()].push_back(tensor);
  }
  if (shards.empty() || static_cast<int64_t>(shards.size()) > kMaxShards) {
    return Invalid(path_field, ": ", Quoted(index_path), " names ", shards.size(),
                   " shards; expected 1 to ", kMaxShards);
  }
  for (const auto& [shard, tensors] : shards) {
    ASSIGN_OR_RETURN(auto file, repository.OpenSafetensors(Join(directory, shard), path_field));
    for (const std::string& tensor : tensors) {
      if (file->Find(tensor) == nullptr) {
        return Invalid(path_field, ": ", Quoted(index_path), " puts tensor ", Quoted(tensor),
                       " in ", Quoted(shard), ", which does not hold it");
      }
    }
    checkpoint.files.push_back(std::move(file));
    checkpoint.file_names.push_back(shard);
  }
  return checkpoint;
}

absl::StatusOr<HfLayer> OpenHfLayer(const ModelRepository& repository,
                                    const v1::HuggingFaceCheckpoint& source,
                                    const v1::LayerConfig& sent_config, absl::string_view field,
                                    absl::string_view config_field) {
  HfLayer layer;
  const std::string path_field = absl::StrCat(field, ".path");
  ASSIGN_OR_RETURN(layer.checkpoint, OpenCheckpoint(repository, source.path(), path_field));
  if (!layer.checkpoint.is_directory) {
    return Invalid(path_field, " = ", Quoted(source.path()),
                   " is a file; hf_checkpoint reads a checkpoint directory with config.json "
                   "(load a single file with safetensors.path, naming and prefix)");
  }
  if (layer.checkpoint.config_json.empty()) {
    return absl::NotFoundError(absl::StrCat(path_field, " = ", Quoted(source.path()),
                                            " has no config.json"));
  }
  const std::string config_path = Quoted(layer.checkpoint.config_path);
  ASSIGN_OR_RETURN(layer.parsed, ParseHfConfig(layer.checkpoint.config_json, source.layer_index(),
                                               absl::StrCat(field, ": ", config_path),
                                               absl::StrCat(field, ".layer_index")));
  RETURN_IF_ERROR(
      CheckConfigAgreement(sent_config, layer.parsed.config, config_field, config_path));
  layer.parsed.config.set_compute_dtype(sent_config.compute_dtype());
  ASSIGN_OR_RETURN(SafetensorsTensorSource tensors,
                   SafetensorsTensorSource::FromShards(layer.checkpoint.FilePointers(),
                                                       std::string(field), source.path()));
  layer.source = std::make_unique<SafetensorsTensorSource>(std::move(tensors));
  ASSIGN_OR_RETURN(layer.prefix,
                   LayerPrefixFor(layer.parsed.naming, layer.source->Names(), source.layer_index(),
                                  absl::StrCat(field, ": ", Quoted(source.path()))));
  return layer;
}

absl::Status InspectCheckpoint(const ModelRepository& repository,
                               const v1::InspectCheckpointRequest& request,
                               v1::InspectCheckpointResponse* response) {
  if (request.offset() < 0) return Invalid("offset = ", request.offset(), " must be >= 0");
  if (request.max_tensors() < 0 || request.max_tensors() > kMaxInspectTensors) {
    return Invalid("max_tensors = ", request.max_tensors(), " must be in [0, ",
                   kMaxInspectTensors, "] (0 = ", kDefaultInspectTensors, ")");
  }
  const int64_t max_tensors =
      request.max_tensors() == 0 ? kDefaultInspectTensors : request.max_tensors();
  ASSIGN_OR_RETURN(const Checkpoint checkpoint,
                   OpenCheckpoint(repository, request.path(), "path"));
  ASSIGN_OR_RETURN(const SafetensorsTensorSource source,
                   SafetensorsTensorSource::FromShards(checkpoint.FilePointers(), "path",
                                                       request.path()));
  std::map<const core::SafetensorsFile*, std::string> file_names;
  for (size_t i = 0; i < checkpoint.files.size(); ++i) {
    file_names[checkpoint.files[i].get()] = checkpoint.file_names[i];
  }
  const std::vector<std::string> names = source.Names();
  response->set_total_tensors(static_cast<int64_t>(names.size()));
  size_t bytes = 0;
  int64_t next = request.offset();
  for (; next < static_cast<int64_t>(names.size()) && next - request.offset() < max_tensors;
       ++next) {
    const core::SafetensorsFile* file = nullptr;
    const core::SafetensorsTensor* tensor = source.Find(names[next], &file);
    const std::string& file_name = file_names[file];
    const size_t size = tensor->name.size() + tensor->dtype.size() + file_name.size() +
                        10 * tensor->shape.size() + 16;
    if (bytes + size > kMaxInspectBytes) {
      // A description that alone passes the bound could never be listed: say so, rather
      // than answer an empty page that a paging caller would ask for again and again.
      if (bytes == 0) {
        return absl::OutOfRangeError(absl::StrCat(
            "tensor ", next, " of ", Quoted(request.path()), " takes ", size,
            " bytes to describe; InspectCheckpoint lists at most ", kMaxInspectBytes));
      }
      break;
    }
    bytes += size;
    v1::TensorInfo* info = response->add_tensors();
    info->set_name(tensor->name);
    info->mutable_shape()->Add(tensor->shape.begin(), tensor->shape.end());
    info->set_dtype(tensor->dtype);
    info->set_file(file_name);
  }
  response->set_truncated(next < static_cast<int64_t>(names.size()));
  for (int value = v1::WeightNaming_MIN; value <= v1::WeightNaming_MAX; ++value) {
    if (!v1::WeightNaming_IsValid(value)) continue;
    const auto naming = static_cast<v1::WeightNaming>(value);
    std::vector<std::string> prefixes = FindLayerPrefixes(naming, names);
    if (prefixes.empty()) continue;
    v1::LayerPrefixes* layers = response->add_layers();
    layers->set_naming(naming);
    for (std::string& prefix : prefixes) {
      // Prefixes are shorter than the names they come from, so this bound is rarely reached.
      bytes += prefix.size() + 4;
      if (layers->prefixes_size() >= static_cast<int>(kMaxInspectPrefixes) ||
          bytes > 2 * kMaxInspectBytes) {
        break;
      }
      layers->add_prefixes(std::move(prefix));
    }
  }
  if (!checkpoint.config_json.empty()) {
    auto parsed = ParseHfConfig(checkpoint.config_json, 0, Quoted(checkpoint.config_path));
    if (parsed.ok()) {
      response->set_model_type(parsed->model_type);
      response->set_num_layers(parsed->num_layers);
      *response->mutable_layer_config() = parsed->config;
    } else {
      response->set_config_problem(BoundedMessage(parsed.status().message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace attention::server

// Hugging Face checkpoints in the model repository: a save_pretrained directory (config.json
// and model.safetensors, or model.safetensors.index.json and its shards) read without
// guesswork. config.json gives the layer's sizes, biases and rotary settings and the naming;
// the tensor names give the layer's prefix. Also InspectCheckpoint's listing.
#ifndef ATTENTION_SERVER_MODELS_HF_CHECKPOINT_H_
#define ATTENTION_SERVER_MODELS_HF_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "core/safetensors.h"
#include "server/models/model_repository.h"
#include "server/models/weight_naming.h"

namespace attention::server {

// What config.json says about one layer.
struct HfLayerConfig {
  std::string model_type;
  int64_t num_layers = 0;
  v1::WeightNaming naming = v1::WEIGHT_NAMING_HF_BERT;
  // Every field resolved (v_head_dim, kdim, ... filled in), as GetLayer reports it.
  v1::LayerConfig config;
};

// Reads layer `layer_index` of config.json's text. `where` names the file in messages and
// `layer_field` the index.
// INVALID_ARGUMENT naming the key for malformed JSON, a missing or out-of-range size, an
// unsupported model_type, or a setting the layer cannot compute faithfully (relative
// position embeddings, partial rotary, an unimplemented rope_type, ...).
absl::StatusOr<HfLayerConfig> ParseHfConfig(absl::string_view json_text, int64_t layer_index,
                                            absl::string_view where,
                                            absl::string_view layer_field = "layer_index");

// OK when every field `sent` sets (non-zero, true) equals `file`'s; else INVALID_ARGUMENT
// "<sent_field>.<field> = <sent> disagrees with <where>, which gives <file> (<json key>)".
absl::Status CheckConfigAgreement(const v1::LayerConfig& sent, const v1::LayerConfig& file,
                                  absl::string_view sent_field, absl::string_view where);

// The one prefix among `names` that holds layer `layer_index` under `naming`: a prefix that
// FindLayerPrefixes finds and whose last component is the index ("encoder.layer.3.",
// "model.layers.3."). INVALID_ARGUMENT listing what there is when none or several match.
absl::StatusOr<std::string> LayerPrefixFor(v1::WeightNaming naming,
                                           const std::vector<std::string>& names,
                                           int64_t layer_index, absl::string_view where);

// The safetensors files of a checkpoint, opened through the repository's path rules.
struct Checkpoint {
  bool is_directory = false;
  // config.json's text; empty for a single file, or a directory without one.
  std::string config_json;
  std::string config_path;  // relative to the repository
  std::vector<std::unique_ptr<core::SafetensorsFile>> files;
  // Each file's path relative to the checkpoint's path ("" for a single file).
  std::vector<std::string> file_names;

  std::vector<const core::SafetensorsFile*> FilePointers() const;
};

// Opens `path`: a safetensors file, or a directory with model.safetensors.index.json (and the
// shards it names) or model.safetensors, and its config.json when present. NOT_FOUND when
// the directory holds no safetensors checkpoint; INVALID_ARGUMENT for a malformed index or
// one naming a tensor its shard lacks. `path_field` names the path in errors.
absl::StatusOr<Checkpoint> OpenCheckpoint(const ModelRepository& repository,
                                          absl::string_view path, absl::string_view path_field);

// A layer of a Hugging Face checkpoint directory, ready for ConvertWeights.
struct HfLayer {
  Checkpoint checkpoint;
  std::unique_ptr<SafetensorsTensorSource> source;  // points into checkpoint.files
  HfLayerConfig parsed;
  std::string prefix;
};

// Opens `source` (field e.g. "spec.hf_checkpoint"), reads the layer's config from
// config.json, checks `sent_config` (field `config_field`) agrees with it and finds the
// layer's prefix.
absl::StatusOr<HfLayer> OpenHfLayer(const ModelRepository& repository,
                                    const v1::HuggingFaceCheckpoint& source,
                                    const v1::LayerConfig& sent_config, absl::string_view field,
                                    absl::string_view config_field);

// InspectCheckpoint (the caller checks access and that there is a repository): `response` lists the tensors from request.offset, the layer prefixes of
// every naming and, for a directory with config.json, layer 0's config.
absl::Status InspectCheckpoint(const ModelRepository& repository,
                               const v1::InspectCheckpointRequest& request,
                               v1::InspectCheckpointResponse* response);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_MODELS_HF_CHECKPOINT_H_

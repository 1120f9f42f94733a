// Weight naming conventions: how the tensors of a checkpoint (PyTorch nn.MultiheadAttention,
// Hugging Face BERT or Llama, or this project's own names) map onto core::MhaWeights. The
// tensors come from a TensorSource, so inline wire tensors and safetensors files share one
// mapping and one set of error messages.
#ifndef ATTENTION_SERVER_MODELS_WEIGHT_NAMING_H_
#define ATTENTION_SERVER_MODELS_WEIGHT_NAMING_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "core/mha_layer.h"
#include "core/safetensors.h"
#include "tensor_codec.h"

namespace attention::server {

// A read-only set of named tensors. Implementations are thread-compatible.
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  virtual bool Contains(const std::string& name) const = 0;
  // Every tensor name, sorted.
  virtual std::vector<std::string> Names() const = 0;
  // Shape and float32 values of a tensor that Contains(); errors name the tensor.
  virtual absl::StatusOr<wire::FloatTensor> Read(const std::string& name) const = 0;
  // How error messages name tensor `name`, e.g. `spec.inline_weights.tensors["q_proj.weight"]`.
  virtual std::string Describe(const std::string& name) const = 0;
  // Whether every tensor must be used (inline weights: a stray tensor is a typo), or other
  // tensors are expected (a checkpoint file holds the rest of the model too).
  virtual bool Strict() const = 0;
};

// LayerWeights.tensors; `field` is the request field, e.g. "spec.inline_weights".
class WireTensorSource final : public TensorSource {
 public:
  WireTensorSource(const v1::LayerWeights& weights, std::string field)
      : weights_(weights), field_(std::move(field)) {}
  bool Contains(const std::string& name) const override;
  std::vector<std::string> Names() const override;
  absl::StatusOr<wire::FloatTensor> Read(const std::string& name) const override;
  std::string Describe(const std::string& name) const override;
  bool Strict() const override { return true; }

 private:
  const v1::LayerWeights& weights_;
  std::string field_;
};

// The tensors of a safetensors file, or of the shards of one checkpoint; `field` is the
// request field, e.g. "spec.safetensors". The files must outlive the source.
class SafetensorsTensorSource final : public TensorSource {
 public:
  SafetensorsTensorSource(const core::SafetensorsFile& file, std::string field);
  // INVALID_ARGUMENT naming both files when a tensor name is in two shards. `display` names
  // the checkpoint where a tensor is in none of them.
  static absl::StatusOr<SafetensorsTensorSource> FromShards(
      const std::vector<const core::SafetensorsFile*>& files, std::string field,
      std::string display);
  bool Contains(const std::string& name) const override;
  std::vector<std::string> Names() const override;
  absl::StatusOr<wire::FloatTensor> Read(const std::string& name) const override;
  std::string Describe(const std::string& name) const override;
  bool Strict() const override { return false; }
  // The tensor and the file holding it; nullptr when absent.
  const core::SafetensorsTensor* Find(const std::string& name,
                                      const core::SafetensorsFile** file = nullptr) const;

 private:
  SafetensorsTensorSource(std::string field, std::string display)
      : field_(std::move(field)), display_(std::move(display)) {}
  struct Located {
    const core::SafetensorsFile* file;
    const core::SafetensorsTensor* tensor;
  };
  std::map<std::string, Located> tensors_;
  std::string field_;
  std::string display_;
};

// The prefixes under which `naming`'s Q, K and V projection weights (or its fused one) are
// all among `names`: the layers a checkpoint holds. Sorted with numbers in numeric order
// ("layers.2." before "layers.10.").
std::vector<std::string> FindLayerPrefixes(v1::WeightNaming naming,
                                           const std::vector<std::string>& names);

// Orders strings as FindLayerPrefixes does: digit runs compare as numbers.
bool NaturalLess(absl::string_view a, absl::string_view b);

// Reads the weights `config` (resolved) needs from `source` under `naming`, each tensor
// named `prefix` + the convention's name. INVALID_ARGUMENT naming the tensor for a missing
// tensor, a wrong shape (with the expected and the actual shape), an unsupported dtype, a
// feature the layer cannot express (PyTorch add_bias_kv), a tensor of the convention under
// `prefix` that the config would ignore (a bias with qkv_bias off, say), or, for a strict
// source, any tensor the layer does not use. A missing tensor's message suggests the
// nearest prefix the source has for `naming` (or another naming's, when it has none).
//
//   NATIVE     q_proj / k_proj / v_proj / out_proj .weight / .bias, or fused qkv_proj.*
//   TORCH_MHA  in_proj_weight [3E, E] (q/k/v_proj_weight when kdim or vdim != E),
//              in_proj_bias, out_proj.weight, out_proj.bias
//   HF_BERT    attention.self.{query,key,value}.{weight,bias},
//              attention.output.dense.{weight,bias} (the residual and LayerNorm that follow
//              in BertSelfOutput are not part of this layer)
//   HF_LLAMA   self_attn.{q,k,v,o}_proj.weight; biases only where the config has them
//              (Llama has none: set no_qkv_bias and no_output_bias); GQA via num_kv_heads,
//              rotary positions via rope_theta in the config
absl::StatusOr<core::MhaWeights> ConvertWeights(v1::WeightNaming naming,
                                                const TensorSource& source,
                                                absl::string_view prefix,
                                                const core::MhaConfig& config,
                                                absl::string_view naming_field);

}  // namespace attention::server

#endif  // ATTENTION_SERVER_MODELS_WEIGHT_NAMING_H_

#include "server/weight_naming.h"

#include <algorithm>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace attention::server {
namespace {

using core::MhaConfig;
using core::MhaWeights;
using wire::ShapeString;

// One source tensor and the weights it fills: its rows (the elements, for a bias) are split
// in order among `parts`, so a fused [Q+K+V, E] projection fills q, k and v.
struct Part {
  std::vector<float> MhaWeights::*member;
  int64_t rows;
};
struct SourceTensor {
  std::string name;  // without the prefix
  std::vector<int64_t> shape;
  std::vector<Part> parts;
  bool is_bias = false;
};

// When a convention stores Q, K and V as one tensor.
enum class Fusion {
  kNever,
  kWhenPresent,    // NATIVE: qkv_proj.weight if the source has it
  kWhenSameDims,   // TORCH_MHA: in_proj_weight iff kdim == vdim == embed_dim
};

struct Convention {
  const char* q_weight;
  const char* k_weight;
  const char* v_weight;
  const char* q_bias;  // nullptr: the bias is only ever fused (TORCH_MHA in_proj_bias)
  const char* k_bias;
  const char* v_bias;
  const char* out_weight;
  const char* out_bias;
  Fusion fusion;
  const char* fused_weight;
  const char* fused_bias;
};

const Convention& ConventionFor(v1::WeightNaming naming) {
  static const Convention kNative = {
      "q_proj.weight",   "k_proj.weight", "v_proj.weight",       "q_proj.bias",
      "k_proj.bias",     "v_proj.bias",   "out_proj.weight",     "out_proj.bias",
      Fusion::kWhenPresent, "qkv_proj.weight", "qkv_proj.bias"};
  static const Convention kTorchMha = {
      "q_proj_weight",   "k_proj_weight", "v_proj_weight",       nullptr,
      nullptr,           nullptr,         "out_proj.weight",     "out_proj.bias",
      Fusion::kWhenSameDims, "in_proj_weight", "in_proj_bias"};
  static const Convention kHfBert = {
      "attention.self.query.weight", "attention.self.key.weight",
      "attention.self.value.weight", "attention.self.query.bias",
      "attention.self.key.bias",     "attention.self.value.bias",
      "attention.output.dense.weight", "attention.output.dense.bias",
      Fusion::kNever, nullptr, nullptr};
  static const Convention kHfLlama = {
      "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
      "self_attn.q_proj.bias",   "self_attn.k_proj.bias",   "self_attn.v_proj.bias",
      "self_attn.o_proj.weight", "self_attn.o_proj.bias",
      Fusion::kNever, nullptr, nullptr};
  switch (naming) {
    case v1::WEIGHT_NAMING_TORCH_MHA:
      return kTorchMha;
    case v1::WEIGHT_NAMING_HF_BERT:
      return kHfBert;
    case v1::WEIGHT_NAMING_HF_LLAMA:
      return kHfLlama;
    default:
      return kNative;
  }
}

// The source tensors `config` needs under `convention`.
absl::StatusOr<std::vector<SourceTensor>> Plan(const Convention& convention,
                                               const TensorSource& source,
                                               absl::string_view prefix, const MhaConfig& c) {
  const int64_t q = c.QWidth(), k = c.KWidth(), v = c.VWidth();
  const bool same_dims = c.kdim == c.embed_dim && c.vdim == c.embed_dim;
  bool fused = false;
  switch (convention.fusion) {
    case Fusion::kNever:
      break;
    case Fusion::kWhenPresent:
      fused = source.Contains(absl::StrCat(prefix, convention.fused_weight));
      if (fused && !same_dims) {
        return Invalid(source.Describe(absl::StrCat(prefix, convention.fused_weight)),
                       ": a fused projection needs kdim (", c.kdim, ") and vdim (", c.vdim,
                       ") equal to embed_dim (", c.embed_dim, ")");
      }
      break;
    case Fusion::kWhenSameDims:
      fused = same_dims;
      break;
  }
  std::vector<SourceTensor> plan;
  if (fused) {
    plan.push_back({convention.fused_weight,
                    {q + k + v, c.embed_dim},
                    {{&MhaWeights::q_weight, q}, {&MhaWeights::k_weight, k}, {&MhaWeights::v_weight, v}}});
  } else {
    plan.push_back({convention.q_weight, {q, c.embed_dim}, {{&MhaWeights::q_weight, q}}});
    plan.push_back({convention.k_weight, {k, c.kdim}, {{&MhaWeights::k_weight, k}}});
    plan.push_back({convention.v_weight, {v, c.vdim}, {{&MhaWeights::v_weight, v}}});
  }
  if (c.qkv_bias) {
    if (fused || convention.q_bias == nullptr) {
      plan.push_back({convention.fused_bias,
                      {q + k + v},
                      {{&MhaWeights::q_bias, q}, {&MhaWeights::k_bias, k}, {&MhaWeights::v_bias, v}},
                      /*is_bias=*/true});
    } else {
      plan.push_back({convention.q_bias, {q}, {{&MhaWeights::q_bias, q}}, true});
      plan.push_back({convention.k_bias, {k}, {{&MhaWeights::k_bias, k}}, true});
      plan.push_back({convention.v_bias, {v}, {{&MhaWeights::v_bias, v}}, true});
    }
  }
  if (c.output_projection) {
    plan.push_back({convention.out_weight,
                    {c.output_dim, c.AttentionWidth()},
                    {{&MhaWeights::out_weight, c.output_dim}}});
  }
  if (c.output_bias) {
    plan.push_back({convention.out_bias, {c.output_dim}, {{&MhaWeights::out_bias, c.output_dim}}, true});
  }
  return plan;
}

// Explains a missing tensor beyond "is missing" where the cause is guessable.
std::string MissingHint(const SourceTensor& tensor, const TensorSource& source,
                        absl::string_view prefix) {
  if (!prefix.empty()) {
    const std::vector<std::string> names = source.Names();
    const bool any = std::any_of(names.begin(), names.end(), [&](const std::string& name) {
      return absl::StartsWith(name, prefix);
    });
    if (!any) return absl::StrCat(" (no tensor starts with prefix \"", prefix, "\")");
  }
  if (tensor.is_bias) {
    return " (for checkpoints without biases set config.no_qkv_bias / config.no_output_bias)";
  }
  return "";
}

}  // namespace

bool WireTensorSource::Contains(const std::string& name) const {
  return weights_.tensors().count(name) > 0;
}

std::vector<std::string> WireTensorSource::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : weights_.tensors()) names.push_back(name);
  std::sort(names.begin(), names.end());
  return names;
}

absl::StatusOr<wire::FloatTensor> WireTensorSource::Read(const std::string& name) const {
  auto found = weights_.tensors().find(name);
  if (found == weights_.tensors().end()) return Invalid(Describe(name), " is missing");
  return wire::DecodeFloatTensor(found->second, Describe(name));
}

std::string WireTensorSource::Describe(const std::string& name) const {
  return absl::StrCat(field_, ".tensors[\"", name, "\"]");
}

bool SafetensorsTensorSource::Contains(const std::string& name) const {
  return file_.Find(name) != nullptr;
}

std::vector<std::string> SafetensorsTensorSource::Names() const {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : file_.tensors()) names.push_back(name);
  return names;
}

absl::StatusOr<wire::FloatTensor> SafetensorsTensorSource::Read(const std::string& name) const {
  const core::SafetensorsTensor* tensor = file_.Find(name);
  if (tensor == nullptr) return Invalid(Describe(name), " is missing");
  auto values = file_.ReadFloats(*tensor);
  if (!values.ok()) return Invalid(field_, ": ", values.status().message());
  return wire::FloatTensor{tensor->shape, *std::move(values)};
}

std::string SafetensorsTensorSource::Describe(const std::string& name) const {
  return absl::StrCat(field_, ": tensor \"", name, "\" in \"", file_.display_name(), "\"");
}

absl::StatusOr<core::MhaWeights> ConvertWeights(v1::WeightNaming naming,
                                                const TensorSource& source,
                                                absl::string_view prefix,
                                                const core::MhaConfig& config,
                                                absl::string_view naming_field) {
  if (!v1::WeightNaming_IsValid(naming)) {
    return Invalid(naming_field, " = ", static_cast<int>(naming),
                   " is not a known WeightNaming value");
  }
  if (naming == v1::WEIGHT_NAMING_TORCH_MHA) {
    // nn.MultiheadAttention(add_bias_kv=True) appends learned key/value rows that this layer
    // cannot represent; refusing beats serving different numbers.
    for (const char* extra : {"bias_k", "bias_v"}) {
      const std::string name = absl::StrCat(prefix, extra);
      if (source.Contains(name)) {
        return Invalid(source.Describe(name),
                       ": nn.MultiheadAttention(add_bias_kv=True) is not supported");
      }
    }
  }
  ASSIGN_OR_RETURN(const std::vector<SourceTensor> plan,
                   Plan(ConventionFor(naming), source, prefix, config));
  core::MhaWeights weights;
  std::set<std::string> used;
  for (const SourceTensor& tensor : plan) {
    const std::string name = absl::StrCat(prefix, tensor.name);
    if (!source.Contains(name)) {
      return Invalid(source.Describe(name), " is missing; ", v1::WeightNaming_Name(naming),
                     " expects shape ", ShapeString(tensor.shape),
                     MissingHint(tensor, source, prefix));
    }
    ASSIGN_OR_RETURN(wire::FloatTensor read, source.Read(name));
    if (read.shape != tensor.shape) {
      return Invalid(source.Describe(name), " has shape ", ShapeString(read.shape),
                     "; expected ", ShapeString(tensor.shape));
    }
    const int64_t row_size = tensor.shape.size() == 2 ? tensor.shape[1] : 1;
    auto begin = read.values.begin();
    for (const Part& part : tensor.parts) {
      const auto end = begin + part.rows * row_size;
      (weights.*part.member).assign(begin, end);
      begin = end;
    }
    used.insert(name);
  }
  if (source.Strict()) {
    for (const std::string& name : source.Names()) {
      if (used.count(name) == 0) {
        return Invalid(source.Describe(name), " is not a weight of this layer config under ",
                       v1::WeightNaming_Name(naming),
                       prefix.empty() ? "" : absl::StrCat(" with prefix \"", prefix, "\""));
      }
    }
  }
  return weights;
}

}  // namespace attention::server

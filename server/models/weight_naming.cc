#include "server/models/weight_naming.h"

#include <algorithm>
#include <cctype>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"

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

// The convention's names that hold Q, K and V (one fused tensor or three) and the output.
std::vector<std::vector<std::string>> LayerMarkers(const Convention& convention) {
  std::vector<std::vector<std::string>> markers = {
      {convention.q_weight, convention.k_weight, convention.v_weight, convention.out_weight}};
  if (convention.fused_weight != nullptr) {
    markers.push_back({convention.fused_weight, convention.out_weight});
  }
  return markers;
}

// Every tensor name of the convention: what a layer under a prefix may hold.
std::vector<std::string> ConventionNames(const Convention& convention) {
  std::vector<std::string> names;
  for (const char* name : {convention.q_weight, convention.k_weight, convention.v_weight,
                           convention.q_bias, convention.k_bias, convention.v_bias,
                           convention.out_weight, convention.out_bias, convention.fused_weight,
                           convention.fused_bias}) {
    if (name != nullptr) names.push_back(name);
  }
  return names;
}

size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The candidate closest to `prefix`, or "" when there is none.
std::string Nearest(absl::string_view prefix, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = 0;
  for (const std::string& candidate : candidates) {
    const size_t distance = EditDistance(prefix, candidate);
    if (best.empty() || distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

// Explains a missing tensor beyond "is missing": the nearest prefix that has a layer under
// this naming (or another naming's, when this one finds none), or the bias flags.
std::string MissingHint(const SourceTensor& tensor, const TensorSource& source,
                        absl::string_view prefix, v1::WeightNaming naming) {
  // Edit distances cost prefix length x candidate length per candidate: bounded here.
  constexpr size_t kMaxComparedPrefixBytes = 512;
  if (prefix.size() > kMaxComparedPrefixBytes) return " (the prefix is too long to compare)";
  const std::vector<std::string> names = source.Names();
  const std::vector<std::string> prefixes = FindLayerPrefixes(naming, names);
  if (std::find(prefixes.begin(), prefixes.end(), prefix) == prefixes.end()) {
    const std::string nearest = Nearest(prefix, prefixes);
    if (!nearest.empty()) {
      return absl::StrCat(" (nearest prefix with a ", v1::WeightNaming_Name(naming), " layer: ",
                          Quoted(nearest), "; InspectCheckpoint lists them all)");
    }
    for (int other = v1::WeightNaming_MIN; other <= v1::WeightNaming_MAX; ++other) {
      if (other == naming || !v1::WeightNaming_IsValid(other)) continue;
      const auto other_naming = static_cast<v1::WeightNaming>(other);
      const std::string found = Nearest(prefix, FindLayerPrefixes(other_naming, names));
      if (!found.empty()) {
        return absl::StrCat(" (no ", v1::WeightNaming_Name(naming), " layer in the source; it has ",
                            v1::WeightNaming_Name(other_naming), " layers, e.g. prefix ",
                            Quoted(found), ")");
      }
    }
    return absl::StrCat(" (no ", v1::WeightNaming_Name(naming), " layer in the source)");
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

SafetensorsTensorSource::SafetensorsTensorSource(const core::SafetensorsFile& file,
                                                 std::string field)
    : field_(std::move(field)), display_(file.display_name()) {
  for (const auto& [name, tensor] : file.tensors()) tensors_.emplace(name, Located{&file, &tensor});
}

absl::StatusOr<SafetensorsTensorSource> SafetensorsTensorSource::FromShards(
    const std::vector<const core::SafetensorsFile*>& files, std::string field,
    std::string display) {
  SafetensorsTensorSource source(std::move(field), std::move(display));
  for (const core::SafetensorsFile* file : files) {
    for (const auto& [name, tensor] : file->tensors()) {
      const auto [found, inserted] = source.tensors_.emplace(name, Located{file, &tensor});
      if (!inserted) {
        return Invalid(source.field_, ": tensor ", Quoted(name), " is in both ",
                       Quoted(found->second.file->display_name()), " and ",
                       Quoted(file->display_name()));
      }
    }
  }
  return source;
}

const core::SafetensorsTensor* SafetensorsTensorSource::Find(
    const std::string& name, const core::SafetensorsFile** file) const {
  const auto found = tensors_.find(name);
  if (found == tensors_.end()) return nullptr;
  if (file != nullptr) *file = found->second.file;
  return found->second.tensor;
}

bool SafetensorsTensorSource::Contains(const std::string& name) const {
  return tensors_.count(name) > 0;
}

std::vector<std::string> SafetensorsTensorSource::Names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, located] : tensors_) names.push_back(name);
  return names;
}

absl::StatusOr<wire::FloatTensor> SafetensorsTensorSource::Read(const std::string& name) const {
  const core::SafetensorsFile* file = nullptr;
  const core::SafetensorsTensor* tensor = Find(name, &file);
  if (tensor == nullptr) return Invalid(Describe(name), " is missing");
  auto values = file->ReadFloats(*tensor);
  if (!values.ok()) return Invalid(field_, ": ", values.status().message());
  return wire::FloatTensor{tensor->shape, *std::move(values)};
}

std::string SafetensorsTensorSource::Describe(const std::string& name) const {
  const core::SafetensorsFile* file = nullptr;
  if (Find(name, &file) == nullptr) {
    return absl::StrCat(field_, ": tensor ", Quoted(name), " in ", Quoted(display_));
  }
  return absl::StrCat(field_, ": tensor ", Quoted(name), " in ", Quoted(file->display_name()));
}

bool NaturalLess(absl::string_view a, absl::string_view b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (std::isdigit(static_cast<unsigned char>(a[i])) &&
        std::isdigit(static_cast<unsigned char>(b[j]))) {
      size_t i_end = i, j_end = j;
      while (i_end < a.size() && std::isdigit(static_cast<unsigned char>(a[i_end]))) ++i_end;
      while (j_end < b.size() && std::isdigit(static_cast<unsigned char>(b[j_end]))) ++j_end;
      // Without leading zeros, the longer run is the larger number.
      absl::string_view x = a.substr(i, i_end - i), y = b.substr(j, j_end - j);
      while (x.size() > 1 && x.front() == '0') x.remove_prefix(1);
      while (y.size() > 1 && y.front() == '0') y.remove_prefix(1);
      if (x.size() != y.size()) return x.size() < y.size();
      if (x != y) return x < y;
      i = i_end;
      j = j_end;
      continue;
    }
    if (a[i] != b[j]) return a[i] < b[j];
    ++i;
    ++j;
  }
  return a.size() - i < b.size() - j;
}

std::vector<std::string> FindLayerPrefixes(v1::WeightNaming naming,
                                           const std::vector<std::string>& names) {
  const std::set<std::string> present(names.begin(), names.end());
  std::set<std::string> prefixes;
  for (const std::vector<std::string>& marker : LayerMarkers(ConventionFor(naming))) {
    for (const std::string& name : names) {
      if (!absl::EndsWith(name, marker[0])) continue;
      const std::string prefix = name.substr(0, name.size() - marker[0].size());
      // A prefix ends a module path: "x." or nothing, never half a name ("xq_proj.weight").
      if (!prefix.empty() && prefix.back() != '.') continue;
      const bool complete = std::all_of(marker.begin(), marker.end(), [&](const std::string& part) {
        return present.count(absl::StrCat(prefix, part)) > 0;
      });
      if (complete) prefixes.insert(prefix);
    }
  }
  std::vector<std::string> sorted(prefixes.begin(), prefixes.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const std::string& a, const std::string& b) { return NaturalLess(a, b); });
  return sorted;
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
                     MissingHint(tensor, source, prefix, naming));
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
  // A tensor of this layer that the config leaves unused would be silently dropped (Qwen2's
  // q/k/v biases under no_qkv_bias give different numbers): refused by name instead.
  std::vector<std::string> ignored;
  for (const std::string& known : ConventionNames(ConventionFor(naming))) {
    const std::string name = absl::StrCat(prefix, known);
    if (used.count(name) == 0 && source.Contains(name)) ignored.push_back(name);
  }
  if (!ignored.empty()) {
    return Invalid(source.Describe(ignored.front()),
                   ": the layer holds tensors that this config would ignore: ",
                   QuotedListForMessage(ignored), " (check config.no_qkv_bias, no_output_bias, "
                   "skip_output_projection and the naming)");
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

#include "server/models/layer_builder.h"

#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/models/hf_checkpoint.h"
#include "server/common/status_util.h"
#include "server/models/weight_naming.h"
#include "server/models/layer_config.h"

namespace attention::server {

absl::StatusOr<std::shared_ptr<const core::MhaLayer>> BuildLayer(
    const v1::LayerSpec& spec, absl::string_view field,
    std::shared_ptr<const core::Backend> backend, const ModelRepository* repository,
    const std::function<absl::Status(int64_t weight_bytes)>& admit_weight_bytes) {
  // A Hugging Face checkpoint brings its own config (the sent one must agree with it).
  std::optional<HfLayer> hf_layer;
  if (spec.weights_case() == v1::LayerSpec::kHfCheckpoint) {
    const std::string source_field = absl::StrCat(field, ".hf_checkpoint");
    if (repository == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          source_field, ": the server has no model repository; start it with "
          "--model_repository"));
    }
    ASSIGN_OR_RETURN(hf_layer, OpenHfLayer(*repository, spec.hf_checkpoint(), spec.config(),
                                           source_field, absl::StrCat(field, ".config")));
  }
  ASSIGN_OR_RETURN(core::MhaConfig converted,
                   ConvertConfig(hf_layer ? hf_layer->parsed.config : spec.config(),
                                 absl::StrCat(field, ".config")));
  auto config = core::MhaConfig::Resolve(converted);
  if (!config.ok()) return Invalid(field, ".", config.status().message());
  // Resolve() caps every dimension at 2^16, so the parameter count cannot overflow.
  if (admit_weight_bytes) RETURN_IF_ERROR(admit_weight_bytes(config->ParameterCount() * 4));
  core::MhaWeights weights;
  switch (spec.weights_case()) {
    case v1::LayerSpec::kInlineWeights: {
      const std::string weights_field = absl::StrCat(field, ".inline_weights");
      const v1::LayerWeights& inline_weights = spec.inline_weights();
      WireTensorSource source(inline_weights, weights_field);
      ASSIGN_OR_RETURN(weights, ConvertWeights(inline_weights.naming(), source,
                                               inline_weights.prefix(), *config,
                                               absl::StrCat(weights_field, ".naming")));
      break;
    }
    case v1::LayerSpec::kRandomInit: {
      // Inline and file weights are bounded by the message and the file; random init is
      // bounded here, before anything is allocated.
      constexpr int64_t kMaxRandomInitBytes = int64_t{4} << 30;
      const int64_t bytes = config->ParameterCount() * 4;
      if (bytes > kMaxRandomInitBytes) {
        return absl::ResourceExhaustedError(absl::StrCat(
            field, ".random_init: the config needs ", bytes, " bytes of weights (",
            config->ParameterCount(), " parameters); random init is limited to ",
            kMaxRandomInitBytes, " bytes"));
      }
      weights = core::MhaWeights::Random(*config, spec.random_init().seed());
      break;
    }
    case v1::LayerSpec::kSafetensors: {
      const std::string source_field = absl::StrCat(field, ".safetensors");
      const v1::SafetensorsSource& safetensors = spec.safetensors();
      if (repository == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat(
            source_field, ": the server has no model repository; start it with "
            "--model_repository"));
      }
      ASSIGN_OR_RETURN(std::unique_ptr<core::SafetensorsFile> file,
                       repository->OpenSafetensors(safetensors.path(),
                                                   absl::StrCat(source_field, ".path")));
      SafetensorsTensorSource source(*file, source_field);
      ASSIGN_OR_RETURN(weights, ConvertWeights(safetensors.naming(), source, safetensors.prefix(),
                                               *config, absl::StrCat(source_field, ".naming")));
      break;
    }
    case v1::LayerSpec::kHfCheckpoint: {
      ASSIGN_OR_RETURN(weights, ConvertWeights(hf_layer->parsed.naming, *hf_layer->source,
                                               hf_layer->prefix, *config,
                                               absl::StrCat(field, ".hf_checkpoint")));
      break;
    }
    case v1::LayerSpec::WEIGHTS_NOT_SET:
      return Invalid(field, ".weights is not set: give inline_weights, safetensors, random_init "
                     "or hf_checkpoint");
  }
  return core::MhaLayer::Create(*config, std::move(weights), std::move(backend));
}

}  // namespace attention::server

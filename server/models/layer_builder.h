// Builds a layer from its wire description (LayerSpec): the models side of layer loading,
// used by LoadLayer and inline layers. It reads the model repository; wire_convert, which
// the repository uses for names and configs, stays below it.
#ifndef ATTENTION_SERVER_MODELS_LAYER_BUILDER_H_
#define ATTENTION_SERVER_MODELS_LAYER_BUILDER_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attention/v1/attention.pb.h"
#include "core/backend.h"
#include "core/mha_layer.h"
#include "server/models/model_repository.h"

namespace attention::server {

// Resolves the config and builds the weights named in `spec`: inline tensors, a safetensors
// file of `repository` (FAILED_PRECONDITION when it is null), or seeded random init, and
// prepares the layer on `backend`. `admit_weight_bytes`, when given, is asked with the
// weights' size before any is allocated, and its error is returned.
absl::StatusOr<std::shared_ptr<const core::MhaLayer>> BuildLayer(
    const v1::LayerSpec& spec, absl::string_view field,
    std::shared_ptr<const core::Backend> backend, const ModelRepository* repository = nullptr,
    const std::function<absl::Status(int64_t weight_bytes)>& admit_weight_bytes = {});

}  // namespace attention::server

#endif  // ATTENTION_SERVER_MODELS_LAYER_BUILDER_H_

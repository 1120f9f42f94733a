// kserve_convert.h's answer half: native statuses, answers and layers in the protocol's
// terms.
#include <string>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/common/status_util.h"
#include "server/kserve/kserve_convert.h"
#include "server/validation/wire_convert.h"

namespace attention::server::kserve {

using InputTensor = inference::ModelInferRequest::InferInputTensor;

absl::Status ToKserveStatus(const absl::Status& status,
                            const inference::ModelInferRequest& request) {
  if (status.ok()) return status;
  // Longer paths first: "query.raw_data" must not be read as "query" then ".raw_data".
  std::vector<std::pair<std::string, std::string>> renames = {
      {"layer", "model_name"},
      {"request_id", "id"},
      {"options.scale", "parameters[\"scale\"]"},
      {"options.need_weights", "parameters[\"need_weights\"]"},
      {"options.queue_timeout_us", "parameters[\"timeout\"]"},
      {"options.key_padding_polarity", "parameters[\"bool_mask_polarity\"]"},
      {"options.attn_mask_polarity", "parameters[\"bool_mask_polarity\"]"}};
  for (const core::DTypeInfo& info : core::kDTypes) {
    if (absl::string_view(info.name) != info.kserve_name) {
      renames.emplace_back(info.name, info.kserve_name);
    }
  }
  const std::pair<const char*, const char*> kTensors[] = {
      {"query", kQuery},
      {"key", kKey},
      {"value", kValue},
      {"options.key_padding_mask", kKeyPaddingMask},
      {"options.attn_mask", kAttnMask}};
  for (const auto& [native, name] : kTensors) {
    const std::string input = absl::StrCat("inputs[\"", name, "\"]");
    // Where its bytes came from: a raw entry (counted past inputs in shared memory), a
    // region, or typed contents.
    std::string source = absl::StrCat(input, ".contents");
    int raw_index = 0;
    for (const InputTensor& given : request.inputs()) {
      const auto region = given.parameters().find(kRegionParameter);
      const bool shared = region != given.parameters().end();
      if (given.name() == name && shared) {
        source = absl::StrCat(input, " (shared memory region ",
                              Quoted(region->second.string_param()), ")");
      } else if (given.name() == name && raw_index < request.raw_input_contents_size()) {
        source = absl::StrCat("raw_input_contents[", raw_index, "] (", input, ")");
      }
      if (given.name() == name) break;
      raw_index += shared ? 0 : 1;
    }
    renames.emplace_back(absl::StrCat(native, ".raw_data"), source);
    renames.emplace_back(absl::StrCat(native, ".float_data"),
                         absl::StrCat(input, ".contents.fp32_contents"));
    renames.emplace_back(absl::StrCat(native, ".dtype"), absl::StrCat(input, ".datatype"));
    renames.emplace_back(native, input);
  }
  auto is_name_char = [](char c) { return absl::ascii_isalnum(c) || c == '_'; };
  const absl::string_view message = status.message();
  std::string renamed;
  bool quoted = false;  // caller strings (layer names) are left as they are
  for (size_t i = 0; i < message.size();) {
    const bool starts_name =
        !quoted && (i == 0 || (!is_name_char(message[i - 1]) && message[i - 1] != '.'));
    const std::pair<std::string, std::string>* found = nullptr;
    for (const auto& rename : renames) {
      if (!starts_name || !absl::StartsWith(message.substr(i), rename.first)) continue;
      const size_t end = i + rename.first.size();
      const char next = end < message.size() ? message[end] : ' ';
      // Plain words (query, key, value, layer) are fields only where a path stands.
      const bool word = absl::c_all_of(rename.first, absl::ascii_islower);
      if (is_name_char(next) || (word && i != 0 && next != '.' && next != '[')) continue;
      found = &rename;
      break;
    }
    if (found != nullptr) {
      renamed += found->second;
      i += found->first.size();
      continue;
    }
    quoted ^= message[i] == '"';
    renamed += message[i++];
  }
  return absl::Status(status.code(), renamed);
}

const char* DatatypeName(v1::DataType dtype) {
  const core::DTypeInfo* info = core::FindDType(v1::DataType_Name(dtype), &core::DTypeInfo::name);
  return info != nullptr ? info->kserve_name : "";
}

absl::Status ToInferResponse(v1::MultiHeadAttentionResponse& native, const OutputPlan& plan,
                             const std::string& model_name,
                             inference::ModelInferResponse* response) {
  response->set_model_name(model_name);
  response->set_model_version(absl::StrCat(native.layer_version()));
  response->set_id(native.request_id());
  for (size_t k = 0; k < plan.names.size(); ++k) {
    const std::string& name = plan.names[k];
    v1::Tensor& tensor =
        name == kOutputName ? *native.mutable_output() : *native.mutable_attention_weights();
    auto* output = response->add_outputs();
    output->set_name(name);
    output->set_datatype(DatatypeName(tensor.dtype()));
    output->mutable_shape()->CopyFrom(tensor.shape());
    if (k < plan.destinations.size() && plan.destinations[k].has_value()) {
      // The layer wrote an output on the GPU itself.
      if (name != kOutputName || !plan.output_on_gpu) {
        RETURN_IF_ERROR(WriteSlice(*plan.destinations[k], tensor.raw_data()));
      }
      // An empty entry keeps raw_output_contents one per output, as tritonclient reads it.
      if (plan.binary_data) response->add_raw_output_contents();
    } else if (plan.binary_data) {
      response->add_raw_output_contents()->swap(*tensor.mutable_raw_data());
    } else {
      // FLOAT32, as ToNativeRequest asked for.
      RawToFloatData(&tensor);
      output->mutable_contents()->mutable_fp32_contents()->Swap(tensor.mutable_float_data());
    }
  }
  return absl::OkStatus();
}

void DescribeModel(const core::MhaConfig& config, inference::ModelMetadataResponse* metadata) {
  metadata->set_platform("attention-service");
  auto add = [](auto* list, const char* name, const char* datatype,
                std::initializer_list<int64_t> shape) {
    auto* tensor = list->Add();
    tensor->set_name(name);
    tensor->set_datatype(datatype);
    for (int64_t dim : shape) tensor->add_shape(dim);
  };
  auto* inputs = metadata->mutable_inputs();
  add(inputs, kQuery, "FP32", {-1, -1, config.embed_dim});
  add(inputs, kKey, "FP32", {-1, -1, config.kdim});
  add(inputs, kValue, "FP32", {-1, -1, config.vdim});
  add(inputs, kKeyPaddingMask, "BOOL", {-1, -1});
  add(inputs, kAttnMask, "BOOL", {-1, -1});
  auto* outputs = metadata->mutable_outputs();
  add(outputs, kOutputName, "FP32", {-1, -1, config.output_dim});
  add(outputs, kWeightsName, "FP32", {-1, -1, -1});
}

}  // namespace attention::server::kserve
